// Post-local SGD (see local_sgd.h): the hook decides per bucket between the plain all-reduce,
// the subgroup's and none; the averager all-reduces the parameters coalesced per dtype.
#include "tandem/parallel/local_sgd.h"

#include <utility>

#include "tandem/core/error.h"
#include "tandem/parallel/ddp.h"

namespace tandem::parallel {

PostLocalSGDState::PostLocalSGDState(PostLocalSGDOptions options) : options_(std::move(options)) {
  TANDEM_CHECK(options_.start_localSGD_iter >= 0, ValueError, "PostLocalSGDState: start_localSGD_iter must be >= 0, got {}",
               options_.start_localSGD_iter);
}

void PostLocalSGDState::set_iter(int64_t iter) {
  TANDEM_CHECK(iter >= 0, ValueError, "PostLocalSGDState: iter must be >= 0, got {}", iter);
  iter_ = iter;
}

HookResult post_localsgd_bucket(PostLocalSGDState& state, dist::ProcessGroup& group, GradBucket& bucket) {
  const PostLocalSGDOptions& o = state.options_;
  if (state.iter_ < o.start_localSGD_iter) {
    if (bucket.is_last) ++state.iter_;
    return allreduce_hook(group, bucket);
  }
  // Local SGD: this rank's own gradients (averaged within the subgroup, if asked).
  if (!o.post_local_gradient_allreduce) return {dist::Work::completed(), nullptr};
  dist::ProcessGroup& sub = o.subgroup ? *o.subgroup : group;
  return {sub.all_reduce(bucket.buffer, dist::ReduceOp::AVG), nullptr};
}

CommHook post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state) {
  TANDEM_CHECK(state != nullptr, ValueError, "post_localSGD_hook: state is null");
  return [state](dist::ProcessGroup& group, GradBucket& bucket) { return post_localsgd_bucket(*state, group, bucket); };
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps, std::shared_ptr<dist::ProcessGroup> group)
    : period_(period), warmup_steps_(warmup_steps), group_(std::move(group)) {
  TANDEM_CHECK(period_ >= 1, ValueError, "PeriodicModelAverager: period must be >= 1, got {}", period_);
  TANDEM_CHECK(warmup_steps_ >= 0, ValueError, "PeriodicModelAverager: warmup_steps must be >= 0, got {}", warmup_steps_);
}

bool PeriodicModelAverager::average_parameters(const std::vector<Tensor>& params) {
  const int64_t s = step_++;
  if (s < warmup_steps_ || (s - warmup_steps_) % period_ != 0) return false;
  dist::ProcessGroup& group = group_ ? *group_ : *dist::default_group();
  coalesced(params, [&](Tensor& flat) { group.all_reduce(flat, dist::ReduceOp::AVG)->wait(); });
  return true;
}

void PeriodicModelAverager::set_step(int64_t step) {
  TANDEM_CHECK(step >= 0, ValueError, "PeriodicModelAverager: step must be >= 0, got {}", step);
  step_ = step;
}

}  // namespace tandem::parallel
