// Post-local SGD (see local_sgd.h): the hook decides per bucket between the plain all-reduce,
// the subgroup's and none; the averager all-reduces flattened parameters, one dtype at a time.
#include "tandem/parallel/local_sgd.h"

#include <map>
#include <utility>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/error.h"
#include "tandem/ops/shape.h"

namespace tandem::parallel {

PostLocalSGDState::PostLocalSGDState(PostLocalSGDOptions options) : options_(std::move(options)) {
  TANDEM_CHECK(options_.start_localSGD_iter >= 0, ValueError, "PostLocalSGDState: start_localSGD_iter must be >= 0, got {}",
               options_.start_localSGD_iter);
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
  NoGradGuard no_grad;
  // One flat buffer per dtype, in the parameters' order.
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (const Tensor& p : params) by_dtype[p.dtype()].push_back(p);
  for (auto& [dtype, ps] : by_dtype) {
    std::vector<Tensor> flat;
    for (const Tensor& p : ps) flat.push_back(p.reshape({-1}));
    Tensor all = ops::cat(flat, 0);
    group.all_reduce(all, dist::ReduceOp::AVG)->wait();
    int64_t off = 0;
    for (Tensor& p : ps) {
      p.copy_(all.narrow(0, off, p.numel()).view(p.shape()));
      off += p.numel();
    }
  }
  return true;
}

}  // namespace tandem::parallel
