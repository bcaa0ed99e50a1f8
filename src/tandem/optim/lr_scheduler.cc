#include "tandem/optim/lr_scheduler.h"

#include <cmath>
#include <limits>

#include "tandem/autograd/grad_mode.h"

namespace tandem::optim {

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {
  // PyTorch's group.setdefault("initial_lr", group["lr"]): the base lr is recorded in the group
  // (and so in the optimizer's state_dict), so that a second scheduler, or one made after the
  // optimizer's state was loaded, schedules from the original lr and not from an already
  // scheduled one.
  for (auto& g : optimizer_.param_groups()) {
    const double base = g.options.emplace(kInitialLr, g.options.at("lr")).first->second;
    base_lrs_.push_back(base);
  }
}

void LRScheduler::apply() {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < base_lrs_.size(); ++i) groups[i].options["lr"] = lr_at(base_lrs_[i], step_);
}

void LRScheduler::step() {
  ++step_;
  apply();
}

void LRScheduler::set_last_step(int64_t step) {
  TANDEM_CHECK(step >= 0, ValueError, "LRScheduler: step must be >= 0, got {}", step);
  step_ = step;
  apply();
}

std::vector<double> LRScheduler::get_last_lr() const {
  std::vector<double> out;
  for (const auto& g : optimizer_.param_groups()) out.push_back(g.options.at("lr"));
  return out;
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  TANDEM_CHECK(step_size > 0, ValueError, "StepLR: step_size must be positive, got {}", step_size);
  apply();
}

double StepLR::lr_at(double base, int64_t step) const {
  return base * std::pow(gamma_, static_cast<double>(step / step_size_));
}

WarmupCosineLR::WarmupCosineLR(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps, double min_lr)
    : LRScheduler(optimizer), warmup_(warmup_steps), total_(total_steps), min_lr_(min_lr) {
  TANDEM_CHECK(warmup_steps >= 0 && total_steps > 0 && warmup_steps <= total_steps, ValueError,
               "WarmupCosineLR: need 0 <= warmup_steps <= total_steps and total_steps > 0 (got warmup={}, total={})",
               warmup_steps, total_steps);
  apply();
}

double WarmupCosineLR::lr_at(double base, int64_t step) const {
  if (step < warmup_) return base * static_cast<double>(step) / static_cast<double>(warmup_);
  if (step >= total_) return min_lr_;
  const double progress = static_cast<double>(step - warmup_) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
  return min_lr_ + (base - min_lr_) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> fn) : LRScheduler(optimizer), fn_(std::move(fn)) {
  apply();
}

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  TANDEM_CHECK(norm_type >= 1.0, ValueError, "clip_grad_norm_: norm_type must be >= 1 or inf, got {}", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  double total = 0.0;
  bool any = false;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    any = true;
    const Tensor gc = g.contiguous();
    TANDEM_DISPATCH_FLOATING(gc.dtype(), "clip_grad_norm_", [&] {
      const auto* d = static_cast<const scalar_t*>(gc.data_ptr());
      for (int64_t i = 0; i < gc.numel(); ++i) {
        const double a = std::abs(static_cast<double>(static_cast<compute_t<scalar_t>>(d[i])));
        if (inf_norm) total = std::max(total, a) + (std::isnan(a) ? a : 0.0);
        else if (norm_type == 2.0) total += a * a;
        else total += std::pow(a, norm_type);
      }
    });
  }
  if (!any) return 0.0;
  if (!inf_norm) total = std::pow(total, 1.0 / norm_type);
  TANDEM_CHECK(!error_if_nonfinite || std::isfinite(total), ValueError,
               "clip_grad_norm_: the total norm of order {} of the gradients is non-finite ({}); pass "
               "error_if_nonfinite=false to clip anyway",
               norm_type, total);
  const double coef = max_norm / (total + 1e-6);
  // A nan norm scales every gradient by nan, as PyTorch's clamp(coef, max=1) does: the step is
  // then visibly bad (a GradScaler skips it) rather than an unclipped update of the finite ones.
  if (coef < 1.0 || std::isnan(coef)) {
    NoGradGuard no_grad;
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined()) g.mul_(coef);
    }
  }
  return total;
}

}  // namespace tandem::optim
