// Learning-rate schedules. A scheduler owns nothing; it rewrites "lr" in its optimizer's
// groups on step(). Call step() once per optimizer step, after optimizer.step().
#pragma once

#include <functional>
#include <vector>

#include "tandem/optim/optimizer.h"

namespace tandem::optim {

class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& optimizer);  // records each group's lr as its base lr
  virtual ~LRScheduler() = default;
  void step();
  int64_t last_step() const { return step_; }
  void set_last_step(int64_t step);  // for resuming
  std::vector<double> get_last_lr() const;

 protected:
  // The lr of a group with base lr `base` after `step` scheduler steps.
  virtual double lr_at(double base, int64_t step) const = 0;
  void apply();

 private:
  Optimizer& optimizer_;  // owned by the caller, outlives the scheduler
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
};

// lr = base * gamma^(step / step_size)   (torch.optim.lr_scheduler.StepLR)
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);

 protected:
  double lr_at(double base, int64_t step) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// Linear warmup from 0 to base over warmup_steps, then cosine decay to min_lr at total_steps
// (held at min_lr after).
class WarmupCosineLR : public LRScheduler {
 public:
  WarmupCosineLR(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);

 protected:
  double lr_at(double base, int64_t step) const override;

 private:
  int64_t warmup_, total_;
  double min_lr_;
};

// lr = base * fn(step)   (torch.optim.lr_scheduler.LambdaLR)
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> fn);

 protected:
  double lr_at(double base, int64_t step) const override { return base * fn_(step); }

 private:
  std::function<double(int64_t)> fn_;
};

// Scales all gradients so that their global norm is at most max_norm (norm_type 2 or inf; any
// p >= 1 works). Returns the norm before clipping. With error_if_nonfinite, a nan/inf norm
// throws ValueError instead of scaling.
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace tandem::optim
