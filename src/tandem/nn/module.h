// Module: the base of every layer and model. It owns named parameters, buffers and child
// modules, in registration order, and gives them PyTorch's dotted names ("layers.0.weight").
// Invariant: a parameter's Tensor is shared (same TensorImpl) between the module, its users and
// optimizers, so to(dtype) and load_state_dict change values in place, never rebind.
#pragma once

#include <functional>
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

  // ---- traversal, in registration order, depth first (PyTorch's order) ----
  // As in PyTorch, a tensor shared by two modules (tied weights) and a module registered under
  // two names are listed once, under the first name met.
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  // Direct children (a module registered twice here: once, under its first name).
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  std::vector<std::shared_ptr<Module>> children() const;
  // This module (name "") and every descendant, depth first, each module once. Works on a module
  // not owned by a shared_ptr too: its own entry then does not own it.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules();
  std::vector<std::shared_ptr<Module>> modules();
  // Calls fn on every child's subtree (children() order, recursively), then on this module — the
  // post-order of PyTorch's Module.apply (e.g. a custom init). Returns *this.
  Module& apply(const std::function<void(Module&)>& fn);
  // Total number of parameter elements.
  int64_t num_parameters() const;

  // ---- mode and dtype (each returns *this, as PyTorch's return self) ----
  // Sets this module and every descendant to training (on) or evaluation mode.
  virtual Module& train(bool on = true);
  Module& eval() { return train(false); }
  bool is_training() const { return training_; }
  // Sets requires_grad on every parameter (freezing: requires_grad_(false)).
  Module& requires_grad_(bool requires_grad = true);
  // Converts floating parameters and buffers (and their grads) to `dtype`, in place.
  Module& to(DType dtype);
  // Drops (set_to_none) or zeroes every parameter's gradient. Note the default: true, as in
  // PyTorch 2.x (PyTorch 1.13's default was false). Zeroing keeps the gradient tensor but cuts
  // any graph it carries (a create_graph backward), as PyTorch's detach_() does.
  void zero_grad(bool set_to_none = true);

  // ---- state ----
  // Parameters and persistent buffers with dotted names, values shared (not copied). A tied
  // tensor, and a submodule registered under two names, appear under each name, as in PyTorch.
  // Unlike PyTorch's (detached) values these are the parameters themselves: write into them
  // under NoGradGuard.
  StateDict state_dict() const;
  // Copies values in (converted to each tensor's dtype). strict: every key must match both ways,
  // else ValueError listing the missing and unexpected keys; not strict: only the common keys are
  // copied and the others are returned, as PyTorch's load_state_dict returns them (missing in
  // state_dict order; unexpected module by module in traversal order, as PyTorch lists them;
  // a non-persistent buffer's name is unexpected). A shape
  // mismatch always throws ValueError naming the key and both shapes. Every check runs before
  // anything is copied, so a throw leaves the module unchanged.
  IncompatibleKeys load_state_dict(const StateDict& state, bool strict = true);

  const std::string& type_name() const { return type_name_; }
  // The module tree printed as PyTorch's repr prints it (extra_repr() inside the parentheses).
  std::string to_string() const;
  virtual std::string extra_repr() const { return ""; }
  // This module's own state_dict entries (local names) a checkpoint may lack: load_state_dict
  // keeps their current values, also when strict (PyTorch's BatchNorm does so for
  // num_batches_tracked, which checkpoints of old torchvision models do not hold).
  virtual std::vector<std::string> optional_state_keys() const { return {}; }

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

// Strips `prefix` from every key of `state` that starts with it, in place (PyTorch's
// torch.nn.modules.utils.consume_prefix_in_state_dict_if_present): a DistributedDataParallel's
// state_dict ("module.fc.weight") loads into the bare model after consuming "module.".
void consume_prefix_in_state_dict_if_present(StateDict& state, const std::string& prefix);

}  // namespace tandem::nn
