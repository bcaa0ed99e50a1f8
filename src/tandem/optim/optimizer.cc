#include "tandem/optim/optimizer.h"

#include <set>

#include "tandem/autograd/grad_mode.h"

namespace tandem::optim {

Optimizer::Optimizer(std::vector<ParamGroup> groups, Options defaults, std::string name)
    : name_(std::move(name)), defaults_(std::move(defaults)) {
  // A list of tensors arrives as one group, so count parameters rather than groups.
  size_t count = 0;
  for (const auto& g : groups) count += g.params.size();
  TANDEM_CHECK(count > 0, ValueError, "{}: got an empty parameter list", name_);
  for (auto& g : groups) add_param_group(std::move(g));
}

void Optimizer::add_param_group(ParamGroup group) {
  std::set<const TensorImpl*> seen;
  for (const auto& g : groups_)
    for (const auto& p : g.params) seen.insert(&p.impl());
  for (const Tensor& p : group.params) {
    TANDEM_CHECK(p.defined() && p.is_leaf(), ValueError, "{}: can only optimize defined leaf tensors", name_);
    TANDEM_CHECK(is_floating(p.dtype()), DTypeError, "{}: parameter of dtype {} is not floating-point", name_,
                 dtype_name(p.dtype()));
    TANDEM_CHECK(seen.insert(&p.impl()).second, ValueError,
                 "{}: some parameters appear in more than one parameter group{}", name_,
                 p.name().empty() ? "" : " (\"" + p.name() + "\")");
  }
  for (const auto& [key, value] : group.options) {
    TANDEM_CHECK(defaults_.count(key) || key == kInitialLr, ValueError, "{}: unknown option \"{}\" in a parameter group",
                 name_, key);
  }
  for (const auto& [key, value] : defaults_) group.options.emplace(key, value);
  groups_.push_back(std::move(group));
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& g : groups_) {
    for (auto& p : g.params) {
      if (!p.grad().defined()) continue;
      if (set_to_none) {
        p.set_grad(Tensor());
      } else {
        NoGradGuard no_grad;
        Tensor grad = p.grad();
        grad.zero_();
      }
    }
  }
}

double Optimizer::option(const ParamGroup& g, const std::string& key) const {
  auto it = g.options.find(key);
  TANDEM_CHECK(it != g.options.end(), ValueError, "{}: missing option \"{}\"", name_, key);
  return it->second;
}

void Optimizer::step() {
  TANDEM_CHECK(stepped_by_.empty(), Error,
               "{}.step(): this optimizer is stepped by {} (inside backward, bucket by bucket); calling step() too "
               "would update the parameters twice. Drop the step() call (and GradScaler/clip_grad_norm_ around it: "
               "a fused optimizer cannot be unscaled or clipped first)",
               name_, stepped_by_);
  update();
  bump_versions();
  run_step_post_hooks();
}

void Optimizer::bump_versions() const {
  // The update wrote through data pointers: mark each stepped parameter as written in place, so a
  // backward through a graph that saved its old value throws instead of mixing old and new
  // (PyTorch's optimizers update with in-place ops, which bump the version the same way).
  for (const auto& g : groups_) {
    for (const Tensor& p : g.params) {
      if (p.grad().defined()) p.bump_version();
    }
  }
}

void Optimizer::step_subset(const std::vector<Tensor>& params) {
  std::set<const TensorImpl*> wanted;
  for (const Tensor& p : params) wanted.insert(&p.impl());
  std::vector<std::vector<Tensor>> all;
  all.reserve(groups_.size());
  size_t found = 0;
  for (auto& g : groups_) {
    std::vector<Tensor> some;
    for (const Tensor& p : g.params) {
      if (wanted.count(&p.impl())) some.push_back(p);
    }
    found += some.size();
    all.push_back(std::move(g.params));
    g.params = std::move(some);
  }
  // The groups get their own lists back however update() ends.
  struct Restore {
    std::vector<ParamGroup>& groups;
    std::vector<std::vector<Tensor>>& all;
    ~Restore() {
      for (size_t i = 0; i < groups.size(); ++i) groups[i].params = std::move(all[i]);
    }
  } restore{groups_, all};
  if (found != wanted.size()) {
    for (const Tensor& p : params) {
      bool mine = false;
      for (const auto& a : all)
        for (const Tensor& q : a) mine = mine || &q.impl() == &p.impl();
      TANDEM_CHECK(mine, ValueError, "{}.step_subset: parameter \"{}\" ({}) is not one of this optimizer's", name_,
                   p.name(), shape_str(p.shape()));
    }
  }
  update();
  bump_versions();
}

int64_t Optimizer::register_step_post_hook(std::function<void(Optimizer&)> hook) {
  step_post_hooks_.emplace(next_hook_, std::move(hook));
  return next_hook_++;
}

void Optimizer::remove_step_post_hook(int64_t handle) { step_post_hooks_.erase(handle); }

void Optimizer::run_step_post_hooks() {
  for (auto& [handle, hook] : step_post_hooks_) hook(*this);
}

std::map<std::string, Tensor>& Optimizer::state_of(const Tensor& param) { return state_[&param.impl()]; }

const std::map<std::string, Tensor>* Optimizer::state(const Tensor& param) const {
  auto it = state_.find(&param.impl());
  return it == state_.end() ? nullptr : &it->second;
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState out;
  for (const auto& g : groups_) {
    out.param_groups.push_back(g.options);
    out.group_sizes.push_back(g.params.size());
    for (const auto& p : g.params) {
      std::map<std::string, Tensor> copy;
      if (auto it = state_.find(&p.impl()); it != state_.end()) {
        for (const auto& [k, v] : it->second) copy[k] = v.clone();
      }
      out.state.push_back(std::move(copy));
    }
  }
  return out;
}

void Optimizer::check_state_dict(const OptimizerState& s) const {
  TANDEM_CHECK(s.param_groups.size() == groups_.size(), ValueError,
               "{}.load_state_dict: the state has {} parameter groups, the optimizer has {}", name_,
               s.param_groups.size(), groups_.size());
  size_t total = 0;
  for (const auto& g : groups_) total += g.params.size();
  TANDEM_CHECK(s.state.size() == total, ValueError,
               "{}.load_state_dict: the state covers {} parameters, the optimizer has {}", name_, s.state.size(), total);
  if (!s.group_sizes.empty()) {
    TANDEM_CHECK(s.group_sizes.size() == groups_.size(), ValueError,
                 "{}.load_state_dict: the state lists the sizes of {} parameter groups, it has {}", name_,
                 s.group_sizes.size(), groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      // Otherwise each group's hyperparameters (and the state by position) would land on other
      // parameters (PyTorch: "loaded state dict contains a parameter group that doesn't match the
      // size of optimizer's group").
      TANDEM_CHECK(s.group_sizes[gi] == groups_[gi].params.size(), ValueError,
                   "{}.load_state_dict: parameter group {} holds {} parameters in the state, {} in the optimizer; "
                   "build the optimizer with the same groups as the one that saved it",
                   name_, gi, s.group_sizes[gi], groups_[gi].params.size());
    }
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    for (const auto& [key, value] : s.param_groups[gi]) {
      TANDEM_CHECK(defaults_.count(key) || key == kInitialLr, ValueError,
                   "{}.load_state_dict: parameter group {} has option \"{}\", which {} does not know", name_, gi, key,
                   name_);
    }
  }
  const std::map<std::string, StateKind> keys = state_keys();
  size_t i = 0;
  for (const auto& g : groups_) {
    for (const auto& p : g.params) {
      for (const auto& [k, v] : s.state[i]) {
        auto kind = keys.find(k);
        if (kind == keys.end()) {
          std::string known;
          for (const auto& [name, unused] : keys) known += (known.empty() ? "" : ", ") + name;
          throw ValueError(fmt::format("{}.load_state_dict: parameter {} has state \"{}\", which {} does not keep ({})",
                                       name_, i, k, name_, known));
        }
        TANDEM_CHECK(v.defined(), ValueError, "{}.load_state_dict: state \"{}\" of parameter {} is undefined", name_, k,
                     i);
        if (kind->second == StateKind::kStep) {
          TANDEM_CHECK(v.numel() == 1 && v.dim() <= 1, ValueError,
                       "{}.load_state_dict: state \"{}\" of parameter {} must be one number, it has shape {}", name_, k,
                       i, shape_str(v.shape()));
        } else {
          TANDEM_CHECK(v.shape() == p.shape(), ValueError,
                       "{}.load_state_dict: state \"{}\" of parameter {} has shape {}, the parameter has {}", name_, k,
                       i, shape_str(v.shape()), shape_str(p.shape()));
          TANDEM_CHECK(is_floating(v.dtype()), DTypeError,
                       "{}.load_state_dict: state \"{}\" of parameter {} has dtype {}, expected a floating-point dtype",
                       name_, k, i, dtype_name(v.dtype()));
        }
      }
      if (!s.state[i].empty()) {
        for (const auto& [k, kind] : keys) {
          TANDEM_CHECK(kind == StateKind::kOptionalLikeParam || s.state[i].count(k), ValueError,
                       "{}.load_state_dict: parameter {} has state but no \"{}\"; the state is incomplete", name_, i,
                       k);
        }
      }
      ++i;
    }
  }
}

void Optimizer::load_state_dict(const OptimizerState& s) {
  check_state_dict(s);
  const std::map<std::string, StateKind> keys = state_keys();
  // Converted copies first, so that nothing changes unless all of it loads.
  std::vector<std::map<std::string, Tensor>> converted(s.state.size());
  size_t i = 0;
  for (const auto& g : groups_) {
    for (const auto& p : g.params) {
      for (const auto& [k, v] : s.state[i]) {
        // PyTorch casts floating-point state to its parameter's dtype; the step count is a number.
        const DType want = keys.at(k) == StateKind::kStep ? kFloat64 : p.dtype();
        Tensor t = v.dtype() == want ? v.clone() : v.to(want);
        converted[i][k] = t.reshape(keys.at(k) == StateKind::kStep ? Shape{} : p.shape()).contiguous();
      }
      ++i;
    }
  }
  i = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Options options = s.param_groups[gi];
    for (const auto& [key, value] : defaults_) options.emplace(key, value);
    groups_[gi].options = std::move(options);
    for (const auto& p : groups_[gi].params) state_[&p.impl()] = std::move(converted[i++]);
  }
}

}  // namespace tandem::optim
