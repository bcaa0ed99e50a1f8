// Basic layers with PyTorch's names, parameter names and default initialisation.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>

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

 private:
  int64_t start_, end_;
};

// A lookup table: weight (num_embeddings, embedding_dim) ~ N(0, 1); padding_idx row zero and
// frozen (gets no gradient).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx = -1, DType dtype = kFloat32);
  Tensor forward(const Tensor& indices) override;
  std::string extra_repr() const override;

  Tensor weight;
  int64_t num_embeddings, embedding_dim, padding_idx;
};

// Holds modules named "0", "1", ... without a forward of its own (torch.nn.ModuleList).
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  void push_back(std::shared_ptr<Module> m) {
    register_module(std::to_string(items_.size()), m);
    items_.push_back(std::move(m));
  }
  size_t size() const { return items_.size(); }
  std::shared_ptr<Module> operator[](size_t i) const { return items_.at(i); }
  template <class M>
  std::shared_ptr<M> at(size_t i) const { return std::static_pointer_cast<M>(items_.at(i)); }

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

// Runs children in order; children are named "0", "1", ... as in PyTorch.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  void push_back(std::shared_ptr<Module> m);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return layers_.size(); }
  std::shared_ptr<Module> operator[](size_t i) const { return layers_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace tandem::nn
