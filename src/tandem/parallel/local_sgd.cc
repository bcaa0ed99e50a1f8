// Post-local SGD (see local_sgd.h): the hook decides per bucket between the plain all-reduce,
// the subgroup's and none; the averagers all-reduce the parameters coalesced per dtype.
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

void GroupAverage::operator()(const std::vector<Tensor>& params, dist::ProcessGroup& group) {
  coalesced(
      params, [&](Tensor& flat) { group.all_reduce(flat, dist::ReduceOp::AVG)->wait(); },
      [&](DType dt, int64_t numel) {
        Flat& f = flats_[dt];
        if (!f.tensor.defined() || f.tensor.numel() != numel) {
          f.memory = group.allocate(static_cast<size_t>(numel) * element_size(dt));
          f.tensor = from_blob(f.memory.get(), {numel}, dt);
        }
        return f.tensor;
      });
}

bool PeriodicModelAverager::average_parameters(const std::vector<Tensor>& params) {
  const int64_t s = step_++;
  if (s < warmup_steps_ || (s - warmup_steps_) % period_ != 0) return false;
  average_(params, group_ ? *group_ : *dist::default_group());
  return true;
}

void ModelAverager::set_step(int64_t step) {
  TANDEM_CHECK(step >= 0, ValueError, "ModelAverager: step must be >= 0, got {}", step);
  step_ = step;
}

PostLocalSGDOptimizer::PostLocalSGDOptimizer(optim::Optimizer& optim, std::shared_ptr<ModelAverager> averager)
    : optim_(optim), averager_(std::move(averager)) {
  TANDEM_CHECK(averager_ != nullptr, ValueError, "PostLocalSGDOptimizer: the averager is null");
}

bool PostLocalSGDOptimizer::step() {
  optim_.step();
  std::vector<Tensor> params;
  for (const auto& g : optim_.param_groups()) params.insert(params.end(), g.params.begin(), g.params.end());
  return averager_->average_parameters(params);
}

PostLocalSGDOptimizer::State PostLocalSGDOptimizer::state_dict() const {
  return {optim_.state_dict(), averager_->step()};
}

void PostLocalSGDOptimizer::load_state_dict(const State& state) {
  TANDEM_CHECK(state.step >= 0, ValueError, "PostLocalSGDOptimizer: the saved step is {}, expected >= 0", state.step);
  optim_.load_state_dict(state.optimizer);
  averager_->set_step(state.step);
}

HierarchicalModelAverager::HierarchicalModelAverager(std::vector<std::pair<int64_t, int64_t>> period_group_sizes,
                                                     int64_t warmup_steps)
    : warmup_steps_(warmup_steps) {
  TANDEM_CHECK(!period_group_sizes.empty(), ValueError,
               "HierarchicalModelAverager: period_group_sizes is empty; give (period, group size) pairs");
  TANDEM_CHECK(warmup_steps_ >= 0, ValueError, "HierarchicalModelAverager: warmup_steps must be >= 0, got {}", warmup_steps_);
  const std::shared_ptr<dist::ProcessGroup> world_group = dist::default_group();
  const int world = world_group->size();
  for (size_t i = 0; i < period_group_sizes.size(); ++i) {
    const auto [period, size] = period_group_sizes[i];
    TANDEM_CHECK(period >= 1 && (i == 0 || period > period_group_sizes[i - 1].first), ValueError,
                 "HierarchicalModelAverager: periods must be >= 1 and increasing, got {} after {}", period,
                 i == 0 ? 0 : period_group_sizes[i - 1].first);
    TANDEM_CHECK(size >= 1 && size <= world && world % size == 0, ValueError,
                 "HierarchicalModelAverager: group size {} (period {}) does not divide the {} ranks into equal groups",
                 size, period, world);
  }
  TANDEM_CHECK(period_group_sizes.back().second == world, ValueError,
               "HierarchicalModelAverager: the longest period ({}) must average over all {} ranks, not groups of {} "
               "(torch's rule)",
               period_group_sizes.back().first, world, period_group_sizes.back().second);
  for (const auto& [period, size] : period_group_sizes) {
    Level level{period, size, nullptr, {}};
    level.group = size == world ? world_group : dist::new_subgroups(static_cast<int>(size));
    levels_.push_back(std::move(level));
  }
}

bool HierarchicalModelAverager::average_parameters(const std::vector<Tensor>& params) {
  const int64_t s = step_++;
  last_size_ = 0;
  if (s < warmup_steps_) return false;
  // The longest period that divides the step wins (torch counts from 0, warm-up included).
  for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
    if (s % it->period != 0) continue;
    if (it->size > 1) it->average(params, *it->group);
    last_size_ = it->size;
    return true;
  }
  return false;
}

}  // namespace tandem::parallel
