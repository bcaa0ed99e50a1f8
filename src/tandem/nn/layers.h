// Basic layers with PyTorch's names, parameter names and default initialisation.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/nn/module.h"

namespace tandem::nn {

// y = x W^T + b. weight (out, in) and bias (out) start uniform in +-1/sqrt(in), as in PyTorch.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, DType dtype = kFloat32);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void reset_parameters();

  Tensor weight;
  Tensor bias;  // undefined without bias
  int64_t in_features, out_features;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override;
};

class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override { return "approximate='" + approximate_ + "'"; }

 private:
  std::string approximate_;
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override;
};

class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override;
};

// Zeroes elements with probability p in training mode (Philox, reproducible from the seed).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 private:
  double p_;
};

// Flattens dims [start_dim, end_dim] (default: all but the batch dim).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, end_); }
  std::string extra_repr() const override { return fmt::format("start_dim={}, end_dim={}", start_, end_); }

 private:
  int64_t start_, end_;
};

// A lookup table: weight (num_embeddings, embedding_dim) ~ N(0, 1); padding_idx row zero and
// frozen (gets no gradient). padding_idx as in PyTorch: none by default, a negative one counts
// from the end (-1 is the last row); outside [-num_embeddings, num_embeddings) is a ValueError.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt,
            DType dtype = kFloat32);
  Tensor forward(const Tensor& indices) override;
  std::string extra_repr() const override;

  Tensor weight;
  int64_t num_embeddings, embedding_dim;
  int64_t padding_idx;  // the row, in [0, num_embeddings), or -1 for none
};

// The index of item i of a container of n modules, a negative i counting from the end (Python's
// rule); out of range is a ValueError naming the container, i and n (PyTorch's IndexError).
int64_t module_index(const std::string& container, int64_t i, size_t n);

// Holds modules named "0", "1", ... without a forward of its own (torch.nn.ModuleList).
// Indexing takes negative indices from the end; out of range throws ValueError.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  void push_back(std::shared_ptr<Module> m) {
    register_module(std::to_string(items_.size()), m);
    items_.push_back(std::move(m));
  }
  ModuleList& append(std::shared_ptr<Module> m) {  // PyTorch's name; returns *this
    push_back(std::move(m));
    return *this;
  }
  size_t size() const { return items_.size(); }
  std::shared_ptr<Module> operator[](int64_t i) const {
    return items_[static_cast<size_t>(module_index(type_name(), i, items_.size()))];
  }
  // Item i as an M; ValueError when it is another type.
  template <class M>
  std::shared_ptr<M> at(int64_t i) const {
    std::shared_ptr<M> m = std::dynamic_pointer_cast<M>((*this)[i]);
    TANDEM_CHECK(m != nullptr, ValueError, "ModuleList: item {} is a {}, not the type asked for", i,
                 (*this)[i]->type_name());
    return m;
  }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

// Runs children in order; children are named "0", "1", ... as in PyTorch. Indexing as ModuleList.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  void push_back(std::shared_ptr<Module> m);
  Sequential& append(std::shared_ptr<Module> m) {
    push_back(std::move(m));
    return *this;
  }
  Tensor forward(const Tensor& x) override;
  size_t size() const { return layers_.size(); }
  std::shared_ptr<Module> operator[](int64_t i) const {
    return layers_[static_cast<size_t>(module_index(type_name(), i, layers_.size()))];
  }
  auto begin() const { return layers_.begin(); }
  auto end() const { return layers_.end(); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace tandem::nn
