// DistributedDataParallel: wraps a module so that backward averages its gradients over a process
// group while backward still runs (torch.nn.parallel.DistributedDataParallel, same options and
// defaults). The reducer (reducer.h) does the bucketing; this file handles construction-time
// agreement, forward bookkeeping, no_sync, buffers, replica checks, join (uneven inputs) and the
// deterministic mode.
//
// Invariant: every rank holds the same parameters after construction (broadcast from rank 0) and,
// given the same optimizer, after every step; check_replicas() proves it on demand.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tandem/dist/metrics.h"
#include "tandem/dist/process_group.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/reducer.h"

namespace tandem::optim { class Optimizer; }

namespace tandem::parallel {

// Runs `collective` on one flat copy of `tensors` per dtype (in their order; one collective per
// dtype) and copies the result back into them: DDP's broadcasts, the model averagers' all-reduce.
// The flat buffers are fresh, or `flat_for(dtype, numel)`'s (a contiguous 1-d tensor the caller
// keeps, e.g. memory from the group's allocate(), which shm reduces in place).
void coalesced(const std::vector<Tensor>& tensors, const std::function<void(Tensor& flat)>& collective,
               const std::function<Tensor(DType, int64_t)>& flat_for = {});

struct DDPOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;          // torch's _DEFAULT_FIRST_BUCKET_BYTES
  // Rank 0's buffers (BatchNorm running stats) at construction and at a forward after a synced one,
  // the source rank's at the end of join. false: every rank keeps its own buffers throughout (as
  // torch 2.x's broadcast_buffers=False: not broadcast at construction either, nor compared there).
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  // The set of used parameters never changes (torch's static_graph): the first synchronized
  // iteration reduces after backward (no overlap) and takes the parameters whose gradient did not
  // arrive as the unused ones (as torch counts the hooks that fired: no graph search, so a loss
  // built also from tensors forward did not return, or from parameters outside forward, is fine);
  // later iterations take that set; a change of that set is an error naming the parameter.
  bool static_graph = false;
  bool delay_allreduce = false;          // Apex: reduce after backward, no overlap
  // Beyond PyTorch: every N training forwards, compare a checksum of parameters (and of the
  // attached optimizer's state) across ranks; 0 = never.
  int64_t check_replicas_every = 0;
  // Beyond PyTorch: bitwise reproducible training across world sizes. Each backward is one
  // micro-batch of a fixed size; run the step's micro-batches under no_sync() except the last
  // (do not divide the loss by their number). The gradients of all micro-batches of all ranks are
  // then summed in one fixed binary tree (rank r owns micro-batches r*k ... r*k+k-1) and divided by
  // their count, so world sizes 1, 2, 4 with the same micro-batches in the same global order give
  // bitwise equal gradients when k (micro-batches per rank) is a power of two. Costs an
  // all_gather of all gradients instead of overlapped all-reduces.
  bool deterministic = false;
  // Fully qualified names (as the wrapped module's named_parameters() / named_buffers() give them)
  // of tensors DDP leaves alone (torch's _set_params_and_buffers_to_ignore_for_model): a parameter
  // trained rank-locally or synchronized by other means, a rank-specific buffer. They are not
  // compared or broadcast at construction, not bucketed or reduced (an ignored parameter keeps its
  // rank's own gradient), not broadcast at forwards or at the end of join, and left out of
  // check_replicas (with their optimizer state). A name the module does not have is a ValueError.
  std::vector<std::string> params_and_buffers_to_ignore;
  // torch's init_sync: false skips the construction-time comparison of the replicas (and of the
  // options) and the broadcast of rank 0's parameters and buffers; the caller guarantees equal
  // replicas (e.g. every rank loaded the same checkpoint). check_replicas_every catches a broken
  // promise.
  bool init_sync = true;
};

// DistributedDataParallel::join's arguments (torch's DistributedDataParallel.join).
struct JoinOptions {
  // Gradients are averaged over the whole world, the ranks that ran out of inputs counting as
  // zeros (true, torch's default), or over the ranks still training in that iteration (false).
  bool divide_by_initial_world_size = true;
  // false: join() just runs the loop.
  bool enable = true;
  // Instead of carrying on without them, every rank throws ValueError at the first iteration in
  // which some rank has run out of inputs.
  bool throw_on_early_termination = false;
};

class DistributedDataParallel : public nn::Module {
 public:
  // Broadcasts rank 0's parameters and buffers, after checking that every rank has the same
  // parameter and buffer names, shapes and dtypes, the same BatchNorm layers synchronized
  // (SyncBatchNorm), and the same options among those that decide which collectives a rank
  // issues (bucket sizes, broadcast_buffers, find_unused_parameters, static_graph,
  // delay_allreduce, check_replicas_every, deterministic, params_and_buffers_to_ignore). An error
  // names the first difference and the ranks, where a mismatch would otherwise surface later as
  // a collective mismatch that does not say what caused it.
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<dist::ProcessGroup> group,
                          DDPOptions options = {});
  ~DistributedDataParallel() override;

  Tensor forward(const Tensor& x) override;
  // For modules with other inputs: run `fn` as the forward (same bookkeeping).
  Tensor forward_with(const std::function<Tensor()>& fn);
  // A forward with several outputs (torch's tuple or dict outputs): find_unused_parameters counts
  // a parameter as used when any of them depends on it. Returns fn's outputs.
  std::vector<Tensor> forward_with(const std::function<std::vector<Tensor>()>& fn);

  const std::shared_ptr<nn::Module>& module() const { return module_; }
  dist::ProcessGroup& process_group() const { return *group_; }
  Reducer& reducer() { return *reducer_; }
  const DDPOptions& options() const { return options_; }

  // Gradients of backward passes inside the guard accumulate locally; the next backward outside
  // reduces the sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.require_sync_) {
      ddp.require_sync_ = false;
    }
    ~NoSyncGuard() { ddp_.require_sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  void register_comm_hook(CommHook hook) { reducer_->register_comm_hook(std::move(hook)); }

  // Uneven inputs (torch's `with ddp.join():`): runs `loop`, this rank's training loop, in which
  // ranks may run different numbers of iterations. A rank whose loop has ended keeps answering
  // the collectives the others' iterations issue (their forwards' buffer broadcasts, one
  // all-reduce of zeros per bucket in their backwards, the unused-parameter map, the one-time
  // bucket rebuild), so the others neither hang nor time out; its own parameters and optimizer
  // state are left as they were. When every rank's loop has ended, every rank takes the
  // parameters and buffers (the buffers only with broadcast_buffers) of the highest rank among
  // those that ran the most iterations. The optimizer state of a rank that sat iterations out is
  // not brought up to date (as in PyTorch): training on after join with momentum or Adam lets the
  // replicas drift, which check_replicas with attach_optimizer reports.
  // While join is active, each forward costs one extra small all-reduce (which ranks still
  // train, whether a synchronized backward follows), buffers are broadcast from the highest rank
  // still training (torch's authoritative rank), and check_replicas_every is skipped in
  // iterations where some rank has joined. Every rank must call join with the same options.
  // Not supported (ValueError): the deterministic mode, and SyncBatchNorm unless with
  // throw_on_early_termination (its forward is a collective no joined rank can answer; torch asks
  // for that option there too). Other collectives inside the loop (a found_inf reducer, metric
  // all-reduces) are the caller's to match. A communication hook runs on zeros
  // for a joined rank; with divide_by_initial_world_size=false the default hook's average is
  // rescaled to the ranks still training, a user hook's result is left as it is.
  void join(const std::function<void()>& loop, JoinOptions options = {});

  // The optimizer whose state check_replicas compares too.
  void attach_optimizer(const optim::Optimizer* optimizer) { optimizer_ = optimizer; }

  // The optimizer step moves into backward (torch's DistributedDataParallel._register_fused_optim):
  // in every synchronized backward, as soon as a bucket's all-reduce has completed, `optimizer`
  // updates that bucket's parameters (Optimizer::step_subset) while the later buckets' all-reduces
  // still run; its step post hooks run once, after the last bucket. The update fills time that
  // was spent waiting for communication, and reads each gradient right after the all-reduce wrote
  // it. The result equals backward then optimizer.step(), bit for bit (each parameter's update
  // reads only its own averaged gradient and state). After backward returns, grad() holds the
  // averaged gradients (zero_grad() as before) and the parameters are updated: do not call
  // optimizer.step() (it throws Error, as do GradScaler's step and unscale_ on it). So nothing
  // that must see every gradient before the update fits: clip_grad_norm_ (a norm computed after
  // backward is still right, but clipping comes too late), a GradScaler's unscale and inf/nan
  // check (fp16). no_sync backwards do not step (the synchronized one after them steps on the
  // sum); a rank inside join whose inputs ran out does not step. With find_unused_parameters or
  // static_graph, and in the deterministic mode, the buckets are stepped after the last
  // all-reduce (no overlap): only then are the used parameters known. Every parameter of
  // `optimizer` must be one this DDP reduces or a frozen one of the module (never stepped: it gets
  // no gradient), else ValueError naming the first that is not (another module's, one in
  // params_and_buffers_to_ignore, amp O2's f32 master copy of one); DDP's parameters that the
  // optimizer does not hold are reduced and left alone. The optimizer is also attached for
  // check_replicas. One per DDP and one DDP per optimizer; DDP keeps it alive and, when DDP is
  // destroyed, gives step() back to the caller.
  void register_fused_optimizer(std::shared_ptr<optim::Optimizer> optimizer);
  const std::shared_ptr<optim::Optimizer>& fused_optimizer() const { return fused_optimizer_; }
  // Compares checksums of every parameter (and the attached optimizer's state) across ranks;
  // throws ValueError naming the first tensor that differs and the ranks that disagree with rank 0.
  // Collective: every rank must call it.
  void check_replicas();

 private:
  void check_same_model();
  // `tensors` (the wrapped module's named parameters or buffers) less params_and_buffers_to_ignore.
  nn::NamedTensors without_ignored(nn::NamedTensors tensors) const;
  std::vector<Tensor> synced_buffer_tensors() const;  // the buffers DDP broadcasts
  std::vector<Tensor> synced_states() const;          // the parameters, then the buffers
  void broadcast_tensors(const std::vector<Tensor>& tensors, int root = 0);
  void before_forward();
  void after_forward(const std::vector<Tensor>& outputs);
  // One join round: every rank says whether it still trains and whether the backward after this
  // forward reduces; all learn how many ranks train, the highest of them, and whether any reduces.
  struct JoinRound {
    int active = 0;
    int highest_active = -1;
    bool sync = false;
  };
  JoinRound join_round(bool active, bool sync);

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  DDPOptions options_;
  std::shared_ptr<Reducer> reducer_;
  std::vector<std::pair<std::string, DType>> dtypes_;  // at construction, to detect a later cast
  std::set<std::string> ignored_;                       // options_.params_and_buffers_to_ignore
  bool require_sync_ = true;
  // Whether the next forward broadcasts buffers: after construction and after a forward whose
  // backward reduces (PyTorch's require_forward_param_sync).
  bool require_forward_param_sync_ = true;
  int64_t forwards_ = 0;
  const optim::Optimizer* optimizer_ = nullptr;
  std::shared_ptr<optim::Optimizer> fused_optimizer_;
  bool join_active_ = false;  // inside join(): forwards take part in join rounds
  JoinOptions join_options_;
};

// ---- metric helpers (dist/metrics.h) ----
using dist::all_reduce_mean;
using dist::print_rank0;
// A found_inf reducer for amp::GradScaler: MAX over ranks, so every rank skips the same steps.
std::function<bool(bool)> found_inf_reducer(std::shared_ptr<dist::ProcessGroup> group);

}  // namespace tandem::parallel
