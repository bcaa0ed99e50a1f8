// Optimizer base: parameter groups with per-group hyperparameters (PyTorch's param_groups),
// per-parameter state, zero_grad and state_dict. Updates run without autograd, in the
// parameter's dtype for f32/f64 (FP32 master copies for low-precision parameters come in #4).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::optim {

// Hyperparameters by PyTorch's names: "lr", "momentum", "weight_decay", "beta1", "beta2", ...
using Options = std::map<std::string, double>;

// The lr a group had when its first LRScheduler was made (PyTorch's "initial_lr"), kept in the
// group's options by the scheduler; every optimizer accepts it.
inline constexpr const char* kInitialLr = "initial_lr";

struct ParamGroup {
  std::vector<Tensor> params;
  Options options;  // missing keys take the optimizer's defaults
};

// Everything an optimizer needs to resume: per-parameter state (by index over all groups, in
// order), each group's hyperparameters and each group's number of parameters.
struct OptimizerState {
  std::vector<std::map<std::string, Tensor>> state;  // tensors are copies
  std::vector<Options> param_groups;
  // Parameters per group, as PyTorch's param_groups[i]["params"] lists them; empty when unknown
  // (a checkpoint written before they were saved): then only the total is checked.
  std::vector<size_t> group_sizes;
};

// What a per-parameter state entry is: a step count (one number, kept as f64) or a tensor shaped
// like its parameter (kept in the parameter's dtype, as PyTorch's load_state_dict casts it). All
// but the kOptional ones must be there when a parameter has any state.
enum class StateKind { kStep, kLikeParam, kOptionalLikeParam };

class Optimizer {
 public:
  Optimizer(std::vector<ParamGroup> groups, Options defaults, std::string name);
  virtual ~Optimizer() = default;

  // One update of every parameter that has a gradient, then the step post hooks. An optimizer
  // registered with DistributedDataParallel::register_fused_optimizer steps inside backward
  // instead: calling step() on it throws Error.
  void step();
  // The update step() makes, of `params` only (each one of this optimizer's parameters, in any
  // group; ValueError otherwise), without the step post hooks: DDP's fused optimizer steps bucket
  // by bucket as their all-reduces complete, then runs run_step_post_hooks() once. Each
  // parameter's update depends on its own gradient and state only, so stepping every parameter
  // once this way equals one step().
  void step_subset(const std::vector<Tensor>& params);
  void run_step_post_hooks();

  // Who steps this optimizer instead of step() ("" = the caller); set by
  // DistributedDataParallel::register_fused_optimizer, cleared when that DDP is destroyed.
  void set_stepped_by(std::string owner) { stepped_by_ = std::move(owner); }
  const std::string& stepped_by() const { return stepped_by_; }
  // Drops (set_to_none, the default, as in PyTorch 2) or zeroes every gradient.
  void zero_grad(bool set_to_none = true);

  void add_param_group(ParamGroup group);
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  const std::string& name() const { return name_; }

  // PyTorch's register_step_post_hook: `hook` runs after every step() (amp's O2 copies the f32
  // master weights back into the low-precision model there). Returns a handle for removal.
  int64_t register_step_post_hook(std::function<void(Optimizer&)> hook);
  void remove_step_post_hook(int64_t handle);

  OptimizerState state_dict() const;
  // The live state of `param` (PyTorch's optimizer.state[p], not copied): null before the
  // parameter's first step.
  const std::map<std::string, Tensor>* state(const Tensor& param) const;
  // Throws ValueError naming the group/parameter when the structure (number of groups, parameters
  // per group), a state's name, shape or dtype kind differs; floating-point state is cast to its
  // parameter's dtype. Nothing changes when it throws.
  void load_state_dict(const OptimizerState& state);
  // load_state_dict's checks alone (a checkpoint checks every file before it loads any).
  void check_state_dict(const OptimizerState& state) const;

 protected:
  // Per-parameter state, created empty on first use.
  std::map<std::string, Tensor>& state_of(const Tensor& param);
  double option(const ParamGroup& g, const std::string& key) const;
  // The per-parameter state entries this optimizer keeps, by name (load_state_dict refuses others).
  virtual std::map<std::string, StateKind> state_keys() const = 0;
  // The update of every parameter of param_groups() that has a gradient (step() and step_subset).
  virtual void update() = 0;

 private:
  // Tensor::bump_version() of every parameter update() stepped (those with a gradient).
  void bump_versions() const;

  std::string name_;
  Options defaults_;
  std::vector<ParamGroup> groups_;
  std::map<const TensorImpl*, std::map<std::string, Tensor>> state_;
  std::map<int64_t, std::function<void(Optimizer&)>> step_post_hooks_;
  int64_t next_hook_ = 0;
  std::string stepped_by_;
};

}  // namespace tandem::optim
