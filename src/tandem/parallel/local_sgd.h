// Post-local SGD (Lin et al. 2018, "Don't Use Large Mini-Batches, Use Local SGD"), torch's two
// pieces of it: the DDP communication hook torch.distributed.algorithms.ddp_comm_hooks.
// post_localSGD_hook and the model averager torch.distributed.algorithms.model_averaging.
// averagers.PeriodicModelAverager. For the first start_localSGD_iter iterations the hook is the
// plain all-reduce (DDP as usual); after that each rank steps on its own gradients (or on
// gradients averaged within `subgroup` only), and the averager brings the replicas back together
// by averaging the parameters every `period` optimizer steps: a fraction of DDP's traffic, for
// slow networks.
//
//   auto state = std::make_shared<PostLocalSGDState>(PostLocalSGDOptions{
//       .start_localSGD_iter = 100, .post_local_gradient_allreduce = false});
//   ddp.register_comm_hook(post_localSGD_hook(state));
//   PeriodicModelAverager averager(/*period=*/4, /*warmup_steps=*/100, group);
//   for (...) { opt.zero_grad(); loss(ddp(x), y).backward(); opt.step();
//               averager.average_parameters(model->parameters()); }
//
// Between two averagings the replicas differ (that is the point); DDP's check_replicas_every
// would report it, so leave it off. With amp O2 the optimizer steps f32 master weights that
// average_parameters does not see: average the parameters the optimizer updates.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "tandem/core/tensor.h"
#include "tandem/dist/process_group.h"
#include "tandem/optim/optimizer.h"
#include "tandem/parallel/reducer.h"

namespace tandem::parallel {

// torch's PostLocalSGDState arguments.
struct PostLocalSGDOptions {
  int64_t start_localSGD_iter = 0;  // iterations of plain all-reduce before local SGD starts
  // After the start: average the gradients within `subgroup` (true) or not at all (false).
  bool post_local_gradient_allreduce = true;
  // The group gradients are averaged in after the start. nullptr: DDP's own group, which on one
  // host is torch's default (the intra-node group); across hosts pass the group of this host's
  // ranks (dist::new_group).
  std::shared_ptr<dist::ProcessGroup> subgroup;
};

class PostLocalSGDState {
 public:
  // Throws ValueError for a negative start_localSGD_iter.
  explicit PostLocalSGDState(PostLocalSGDOptions options);
  const PostLocalSGDOptions& options() const { return options_; }
  // Iterations counted so far (at each iteration's last bucket, until the start).
  int64_t iter() const { return iter_; }
  // Restores the count of a saved state (torch pickles `iter` with the state). Throws ValueError
  // for a negative count.
  void set_iter(int64_t iter);

 private:
  friend HookResult post_localsgd_bucket(PostLocalSGDState& state, dist::ProcessGroup& group, GradBucket& bucket);
  PostLocalSGDOptions options_;
  int64_t iter_ = 0;
};

CommHook post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state);

// The parameters' average over a group, in place: gathered into one flat buffer per dtype that
// this keeps, allocated through the group (shm reduces it in place), so an averaging moves each
// value twice (in, out) plus the all-reduce. The averagers' mechanism.
class GroupAverage {
 public:
  void operator()(const std::vector<Tensor>& params, dist::ProcessGroup& group);

 private:
  struct Flat {
    std::shared_ptr<void> memory;  // from the group's allocate()
    Tensor tensor;                 // a 1-d view of it
  };
  std::map<DType, Flat> flats_;
};

// torch's averagers.ModelAverager: average_parameters after every optimizer step, counting the
// calls (`step`).
class ModelAverager {
 public:
  virtual ~ModelAverager() = default;
  // Call once after every optimizer step. Returns whether this call averaged.
  virtual bool average_parameters(const std::vector<Tensor>& params) = 0;
  // Calls so far (torch's averager.step).
  int64_t step() const { return step_; }
  // Restores the count of a saved run (what torch's PostLocalSGDOptimizer.load_state_dict does
  // with its "step"), so averaging resumes on the same calls. Throws ValueError if negative.
  void set_step(int64_t step);

 protected:
  int64_t step_ = 0;
};

// Averages parameters over `group` (nullptr: the default group) at the calls of
// average_parameters numbered warmup_steps, warmup_steps + period, warmup_steps + 2 period, ...
// (counting from 0; torch's rule), one all-reduce per dtype; every other call only counts.
// Every rank must make the same calls with the same parameters (a collective when it averages).
class PeriodicModelAverager : public ModelAverager {
 public:
  // Throws ValueError for period < 1 or warmup_steps < 0.
  explicit PeriodicModelAverager(int64_t period, int64_t warmup_steps = 0,
                                 std::shared_ptr<dist::ProcessGroup> group = nullptr);
  bool average_parameters(const std::vector<Tensor>& params) override;
  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }

 private:
  int64_t period_, warmup_steps_;
  std::shared_ptr<dist::ProcessGroup> group_;
  GroupAverage average_;
};

// torch's HierarchicalModelAverager: several periods, each averaging within groups of its size
// (consecutive ranks of the default group, torch's new_subgroups), e.g. {{2, 4}, {8, 16}} on 16
// ranks averages within groups of 4 every 2 steps and over all 16 every 8. At call s (counting
// from 0) >= warmup_steps, the longest period that divides s averages; no period, no averaging.
// Periods increase and the last group is all ranks (torch's rules). Cheap averages often within a
// host, costly ones rarely across hosts. Every rank of the default group must construct it (it
// makes the subgroups) and make the same calls.
class HierarchicalModelAverager : public ModelAverager {
 public:
  // Throws ValueError naming the entry for an empty list, periods not increasing, a group size
  // that does not divide the world, or a last group smaller than the world.
  explicit HierarchicalModelAverager(std::vector<std::pair<int64_t, int64_t>> period_group_sizes,
                                     int64_t warmup_steps = 0);
  bool average_parameters(const std::vector<Tensor>& params) override;
  // The size of the groups the last call averaged in (0: it did not average).
  int64_t last_group_size() const { return last_size_; }

 private:
  struct Level {
    int64_t period, size;
    std::shared_ptr<dist::ProcessGroup> group;  // this rank's group of `size`
    GroupAverage average;
  };
  std::vector<Level> levels_;
  int64_t warmup_steps_;
  int64_t last_size_ = 0;
};

// torch.distributed.optim.PostLocalSGDOptimizer: the wrapped optimizer's step, then the
// averager on every parameter of its groups (skip step() on a step GradScaler skips, as torch's
// scaler.step does). With amp O2 the optimizer holds the f32 masters, which this averages; round
// them into the model with amp.copy_masters_to_model() whenever step() returns true.
//
//   PostLocalSGDOptimizer opt(sgd, std::make_shared<PeriodicModelAverager>(4, 100));
//   ... loss.backward(); opt.step();
class PostLocalSGDOptimizer {
 public:
  // Throws ValueError for a null averager. `optim` must outlive this.
  PostLocalSGDOptimizer(optim::Optimizer& optim, std::shared_ptr<ModelAverager> averager);
  // optim.step(), then averager.average_parameters(its parameters). Returns whether it averaged.
  bool step();
  void zero_grad(bool set_to_none = true) { optim_.zero_grad(set_to_none); }
  // torch's state_dict: the wrapped optimizer's, plus "step", the averager's count.
  struct State {
    optim::OptimizerState optimizer;
    int64_t step = 0;
  };
  State state_dict() const;
  void load_state_dict(const State& state);
  optim::Optimizer& optimizer() { return optim_; }
  ModelAverager& averager() { return *averager_; }

 private:
  optim::Optimizer& optim_;
  std::shared_ptr<ModelAverager> averager_;
};

}  // namespace tandem::parallel
