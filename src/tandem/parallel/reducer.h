// The DDP reducer: averages gradients across a process group while backward still runs.
//
// Buckets. Parameters that require grad are grouped, in reverse registration order (backward
// produces the last layers' gradients first) and by dtype, into buckets of at most
// bucket_cap_mb (the first one first_bucket_mb, so communication starts early). Each bucket owns
// one flat buffer from ProcessGroup::allocate (shm reduces it in place, no copy); a parameter's
// gradient lives at a fixed offset in it. After the first synchronized iteration the buckets are
// rebuilt once in the order gradients actually became ready (rank 0's order, broadcast, so every
// rank has the same layout).
//
// Iteration. Each slot is its parameter's gradient destination (autograd, node.h) during a
// synchronized backward: an op that creates the gradient (linear's weight GEMM, autocast's cast
// back to f32) writes it straight into the slot. A post-accumulate-grad hook on every parameter
// copies its gradient into its bucket slot unless it already lies there (or, with
// gradient_as_bucket_view, makes grad() a view of the slot) and decrements the bucket's pending
// count. A bucket whose count reaches zero is launched asynchronously — in bucket
// order, so every rank issues the same collectives in the same order — while backward continues.
// A callback queued on the autograd engine runs when backward ends: it waits for every bucket,
// and puts the averaged values into grad(): a gradient that only its parameter holds is replaced
// by its slot and the bucket moves to other memory (no copy back; the two blocks take turns),
// any other is copied into. At world size 1 with the default hook nothing is copied or reduced.
// Invariant: after a synchronized backward returns, every parameter's grad() holds the average
// over ranks, or backward threw; without gradient_as_bucket_view no grad() aliases a live bucket.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/core/tensor.h"
#include "tandem/dist/process_group.h"

namespace tandem::parallel {

// One bucket as a communication hook sees it (torch.distributed.GradBucket).
struct GradBucket {
  int64_t index = 0;
  Tensor buffer;                        // flat, the bucket's dtype; holds the local gradients
  std::vector<std::string> parameter_names;
  // Each parameter's gradient as a view of `buffer` in the parameter's shape, in bucket order
  // (torch's GradBucket.gradients()); set for hooks other than the default.
  std::vector<Tensor> gradients;
  bool is_last = false;                 // the last bucket of this iteration
};

// What a hook started: `work` completes the communication; `then` (optional) runs after it, on
// the backward thread, and must leave the averaged gradients in bucket.buffer.
struct HookResult {
  std::shared_ptr<dist::Work> work;
  std::function<void()> then;
};
using CommHook = std::function<HookResult(dist::ProcessGroup& group, GradBucket& bucket)>;

struct ReducerOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // Apex's delay_allreduce: reduce every bucket after backward ended (no overlap).
  bool delay_allreduce = false;
  // Bitwise reproducible across world sizes: see DistributedDataParallel's header.
  bool deterministic = false;
};

// Per-bucket timing of the last iteration (seconds since the iteration's first hook), for tests
// and profiling.
struct BucketTiming {
  double ready_s = 0;    // last gradient of the bucket arrived
  double launch_s = 0;   // its collective was issued
  double done_s = 0;     // its collective completed (seen by finalize)
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // `params`: (name, parameter) of every parameter that requires grad, in registration order.
  static std::shared_ptr<Reducer> create(std::vector<std::pair<std::string, Tensor>> params,
                                         std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options);
  ~Reducer();

  // Called by DDP's forward. `sync`: whether this iteration's backward reduces (false inside
  // no_sync). `outputs`: the forward's outputs, whose graph is walked for unused parameters when
  // find_unused_parameters is set (not static_graph: its first synchronized iteration reduces
  // after backward and counts the gradients that arrived).
  void prepare_for_backward(bool sync, const std::vector<Tensor>& outputs);

  void register_comm_hook(CommHook hook);

  // Called once per bucket in each synchronized backward, with the bucket's parameter indices
  // (into the constructor's list), once their averaged gradients are in grad(): as soon as that
  // bucket's collective completed, while the later buckets' still run; with
  // find_unused_parameters or static_graph (whose map of used parameters is reduced after every
  // bucket) and in the deterministic mode, for every bucket after the last one completed.
  // `last`: the iteration's last call. Not called for no_sync backwards or a joined rank's shadow
  // backward. DDP's fused optimizer steps there. An exception from it, or a failed collective
  // after it ran for some buckets, ends backward with those buckets handed over (and stepped),
  // the others waited for and not.
  using BucketDone = std::function<void(const std::vector<int64_t>& params, bool last)>;
  void set_bucket_done(BucketDone fn) { bucket_done_ = std::move(fn); }

  // ---- join (DistributedDataParallel::join) ----
  // The default hook's average in the coming synchronized backwards is over `ranks` ranks instead
  // of the world size (the world's sum divided by `ranks`); 0 restores the world size.
  void set_join_divisor(int64_t ranks);
  // For a rank whose inputs ran out: the collectives one synchronized backward of the other ranks
  // issues after their hooks (each bucket's, through the hook, on zeros; the unused-parameter map;
  // the one-time rebuild), in the same order. Leaves this rank's gradients alone.
  void shadow_backward();

  // The parameters (the constructor's list): indices in bucket_indices() and BucketDone refer to it.
  int64_t num_parameters() const { return static_cast<int64_t>(params_.size()); }
  const Tensor& parameter(int64_t i) const { return params_.at(static_cast<size_t>(i)).tensor; }
  const std::string& parameter_name(int64_t i) const { return params_.at(static_cast<size_t>(i)).name; }

  // The layout: bucket b holds these parameter indices (into the constructor's list), in order.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  std::vector<int64_t> bucket_sizes_bytes() const;
  // Bucket b's flat buffer as it is now (tests: where gradients lie).
  Tensor bucket_buffer(int64_t b) const { return buckets_.at(static_cast<size_t>(b)).flat; }
  const std::vector<BucketTiming>& last_timings() const { return timings_; }
  // Whether the one-time rebuild after the first iteration happened.
  bool buckets_rebuilt() const { return rebuilt_; }
  // Seconds from the iteration's first hook to the end of backward's node execution (when the
  // finalize callback started).
  double last_backward_end_s() const { return backward_end_s_; }

  // Deterministic mode: micro-batches accumulated so far in this step (tests).
  int64_t pending_micro_batches() const { return static_cast<int64_t>(micro_grads_.size()); }

 private:
  struct Param {
    std::string name;
    Tensor tensor;
    int64_t hook = -1;
    int64_t bucket = -1;
    int64_t offset = 0;  // elements into the bucket
  };
  struct Bucket {
    std::vector<int64_t> params;
    DType dtype = kFloat32;
    int64_t numel = 0;
    std::shared_ptr<void> memory;
    std::shared_ptr<void> spare;  // the memory last handed over to grad() (finalize), for reuse
    Tensor flat;          // (numel,) over memory
    int64_t pending = 0;  // gradients still to arrive this iteration
    bool launched = false;
    HookResult result;
  };

  Reducer(std::vector<std::pair<std::string, Tensor>> params, std::shared_ptr<dist::ProcessGroup> group,
          ReducerOptions options);
  void install_hooks();
  // Builds buckets from `order` (parameter indices, first-ready first).
  void build_buckets(const std::vector<int64_t>& order);
  Tensor slot(int64_t param) const;  // the parameter's view into its bucket
  // Gives bucket `bi` other memory (its slots' old values are not kept): its current memory was
  // handed over to grad() by finalize.
  void replace_bucket_memory(int64_t bi);
  void on_gradient_ready(int64_t param);
  void mark_ready(int64_t param);
  [[noreturn]] void throw_ready_twice(int64_t param) const;  // the "gradient twice" error, saying why
  // The parameter's gradient into its bucket slot (zeros when it has none; nothing when grad()
  // already is the slot); with gradient_as_bucket_view the slot becomes grad().
  void grad_into_slot(int64_t param);
  // Whether gradients go through bucket slots: not at world size 1 with the default hook and no
  // bucket views, where grad() already is the result.
  bool reads_slots() const { return !local_only_ || options_.gradient_as_bucket_view; }
  void launch_ready_buckets();
  void launch(int64_t bucket);
  // Starts bucket `bi`'s collective over `buffer` (its flat memory, or zeros for a joined rank):
  // the registered hook, with the parameters' names and gradient views, or the default all-reduce.
  HookResult start_collective(int64_t bi, const Tensor& buffer);
  void finalize();
  // Puts bucket `bi`'s averaged values into its parameters' grad() (see finalize), leaving out
  // the parameters no rank used.
  void hand_over(int64_t bi, const std::vector<uint8_t>& globally_used);
  // bucket_done_ (if set) for every bucket in order: when they are not reported one by one.
  void every_bucket_done();
  void finalize_deterministic();
  // The one-time rebuild in rank 0's ready order (a collective: a broadcast from rank 0).
  void rebuild_buckets();
  void reset_iteration();
  // Waits for every launched bucket's collective, failures ignored.
  void drain_launched();
  // The iteration's backward threw before finalize ran (autograd's on_abort).
  void abort_iteration();
  void clear_destinations();  // the parameters' gradient destinations (set by prepare_for_backward)
  double now_s() const;

  std::vector<Param> params_;
  std::shared_ptr<dist::ProcessGroup> group_;
  ReducerOptions options_;
  std::vector<Bucket> buckets_;
  CommHook hook_;
  BucketDone bucket_done_;

  // ---- per-iteration state ----
  bool expect_backward_ = false;   // prepare_for_backward armed the hooks
  bool sync_ = true;
  bool finalize_queued_ = false;
  bool local_only_ = false;        // world size 1, default hook: no collective, no bucket copies
  bool destinations_set_ = false;  // the parameters' slots are their gradient destinations
  std::vector<char> ready_;
  std::vector<char> locally_used_;
  // Got a gradient in a no_sync backward since the last synchronized one: counts as locally used
  // at the next synchronized backward (its accumulated gradient must be averaged, even if this
  // pass does not use it). Cleared by each synchronized finalize.
  std::vector<char> used_since_sync_;
  // Marked ready at the first hook (find_unused_parameters): their slot gets the gradient they
  // hold from earlier no_sync passes (zeros if none), as a used parameter's would.
  std::vector<int64_t> unused_;
  int64_t next_launch_ = 0;
  std::vector<int64_t> ready_order_;  // the current synced iteration's, until the rebuild (reset per iteration)
  bool rebuilt_ = false;
  int64_t iteration_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::vector<BucketTiming> timings_;
  double backward_end_s_ = 0;
  std::vector<int64_t> static_unused_;  // static_graph: unused set found in the first iteration
  bool static_known_ = false;
  bool static_discovery_ = false;  // this is static_graph's first synchronized backward: no bucket launches before its end
  int64_t join_divisor_ = 0;  // 0: the world size

  // ---- deterministic mode ----
  // Per micro-batch of this step, every parameter's gradient as f32 (the tensors autograd made,
  // taken over, not copied; undefined = zeros).
  std::vector<std::vector<Tensor>> micro_grads_;
  // This rank's sum (flat, registration order) and every rank's, gathered: kept between steps,
  // allocated through the group (shm gathers straight from the first).
  std::shared_ptr<void> det_local_memory_, det_all_memory_;
  Tensor det_local_, det_all_;
};

// What a collective that failed inside DistributedDataParallel::join most likely means.
inline constexpr const char* kJoinLockstepHint =
    "DistributedDataParallel.join: the ranks' iterations fell out of step. Inside join every forward of the DDP "
    "module with gradients enabled must be followed by its backward (a batch skipped after its forward belongs "
    "under NoGradGuard or no_sync), and every rank must call join with the same options";

// ---- built-in communication hooks (torch.distributed.algorithms.ddp_comm_hooks) ----
// all_reduce with AVG in the bucket's dtype (the default).
HookResult allreduce_hook(dist::ProcessGroup& group, GradBucket& bucket);

// f32 bucket sent as f16 / bf16 (the backend accumulates in f32), averaged, cast back.
HookResult fp16_compress_hook(dist::ProcessGroup& group, GradBucket& bucket);
HookResult bf16_compress_hook(dist::ProcessGroup& group, GradBucket& bucket);
// torch's debugging_hooks.noop_hook: no communication, every rank keeps its own gradients. For
// measuring what the all-reduce costs (DDP on N ranks minus the communication); the replicas
// diverge, so it is not for training.
HookResult noop_hook(dist::ProcessGroup& group, GradBucket& bucket);
// torch's fp16_compress_wrapper / bf16_compress_wrapper: `hook` runs on a 16-bit copy of the bucket
// (buffer and per-parameter views), whose result is cast back into the bucket. Meant for
// powerSGD_hook (its factors then go in 16 bits; it computes in f32 either way). A bucket that is
// not f32 is handed to `hook` as it is.
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);

}  // namespace tandem::parallel
