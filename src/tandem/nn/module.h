// Module: the base of every layer and model. It owns named parameters, buffers and child
// modules, in registration order, and gives them PyTorch's dotted names ("layers.0.weight").
// Invariant: a parameter's Tensor is shared (same TensorImpl) between the module, its users and
// optimizers, so to(dtype) and load_state_dict change values in place, never rebind.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = NamedTensors;

// What load_state_dict did not match (PyTorch's _IncompatibleKeys), in the module's and the
// checkpoint's order: both empty after a strict load, which throws instead.
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;     // the module's names the checkpoint lacks (left unchanged)
  std::vector<std::string> unexpected_keys;  // the checkpoint's names the module lacks (ignored)
};

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The single-input forward most layers have; modules without one throw Error naming themselves.
  virtual Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // ---- registration (names: non-empty, no '.', unique within this module) ----
  // Makes `t` a leaf parameter (requires_grad unless told otherwise) and returns the shared handle.
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  Tensor register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // ---- traversal (a tensor shared by two modules, e.g. tied weights, is listed once) ----
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const { return children_; }
  // This module (name "") and every descendant, depth first.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules();
  // Total number of parameter elements.
  int64_t num_parameters() const;

  // ---- mode and dtype ----
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Converts floating parameters and buffers (and their grads) to `dtype`, in place.
  void to(DType dtype);
  // Drops (set_to_none) or zeroes every parameter's gradient.
  void zero_grad(bool set_to_none = true);

  // ---- state ----
  // Parameters and persistent buffers with dotted names, values shared (not copied). A tied
  // tensor appears under each of its names, as in PyTorch.
  StateDict state_dict() const;
  // Copies values in (converted to each tensor's dtype). strict: every key must match both ways,
  // else ValueError listing the missing and unexpected keys; not strict: only the common keys are
  // copied and the others are returned, as PyTorch's load_state_dict returns them. A shape
  // mismatch always throws ValueError naming the key and both shapes. Every check runs before
  // anything is copied, so a throw leaves the module unchanged.
  IncompatibleKeys load_state_dict(const StateDict& state, bool strict = true);

  const std::string& type_name() const { return type_name_; }
  // A one-line-per-module summary like PyTorch's repr.
  std::string to_string() const;
  virtual std::string extra_repr() const { return ""; }

 protected:
  void add_child(const std::string& name, std::shared_ptr<Module> m);

 private:
  // dedup: list a tensor registered in several places once (named_parameters) or under every
  // name (state_dict, as PyTorch's does for tied weights).
  void collect(const std::string& prefix, bool params, bool recurse, bool persistent_only, bool dedup, NamedTensors& out,
               std::vector<const TensorImpl*>& seen) const;
  void check_name(const std::string& name, const char* what) const;

  std::string type_name_;
  bool training_ = true;
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<std::string> non_persistent_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

}  // namespace tandem::nn
