// PowerSGD gradient compression as a DDP communication hook (torch's
// torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook, Vogels et al. 2019): each gradient
// matrix M (a parameter's gradient viewed as rows x the rest) is sent as two thin factors,
// P = M Q (all-reduced, then orthonormalised) and Q = M^T P (all-reduced, averaged), and replaced
// by P Q^T: (rows + cols) * rank numbers on the wire instead of rows * cols. Gradients too small
// to gain (vectors, biases, or below min_compression_rate) go through one plain all-reduce per
// bucket. Error feedback keeps what the approximation lost on each rank and adds it to the next
// step's gradient; warm start reuses Q from the previous step. powerSGD_hook keeps that state per
// parameter (by name), so it does not depend on the bucket layout: the same after DDP's bucket
// rebuild, and restorable into a fresh DDP (state_dict / load_state_dict: tandem train resumes
// bit for bit). batched_powerSGD_hook keeps it per bucket, as torch does.
//
//   auto state = std::make_shared<tandem::parallel::PowerSGDState>(
//       tandem::parallel::PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 100});
//   ddp.register_comm_hook(tandem::parallel::powerSGD_hook(state));
//
// The first start_powerSGD_iter iterations use the plain average (allreduce_hook). A 16-bit bucket
// (O2's bf16 / f16 parameters, or an f32 one through fp16/bf16_compress_wrapper) is compressed
// too: computed in f32, its P, Q and small gradients sent in its dtype, the result rounded into
// it; other dtypes always take the plain average. The result of a step is the same on every
// rank (bit for bit); it is an approximation of the average, exact when the rank reaches the
// smaller side of every compressed matrix.
//
// Beyond torch: a warm-start Q column that went to zero (after a rank-deficient or zero
// gradient) is redrawn from the parameter's stream instead of staying zero for good; and a step
// whose summed P is not finite (some rank's gradient overflowed, as fp16 loss scaling does now
// and then) gives NaN compressed gradients on every rank (a GradScaler skips the step) and
// leaves the error feedback and the warm-start Qs as they were, where storing them would turn
// every later step into NaN.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "tandem/core/rng.h"
#include "tandem/parallel/reducer.h"

namespace tandem::parallel {

// torch's PowerSGDState arguments and defaults.
struct PowerSGDOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;
  // Compress a rows x cols matrix only when (rows + cols) * rank * min_compression_rate < rows * cols.
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  // Added to each column's norm before dividing. (A column in the span of the earlier ones, a
  // zero one included, becomes zero whatever the epsilon.)
  double orthogonalization_epsilon = 0;
  // A fresh Q (the first compressed step, every step without warm start) is drawn from a stream
  // keyed by (random_seed, iteration, parameter name) -- batched: bucket index --, the same on
  // every rank and whatever the bucket layout.
  uint64_t random_seed = 0;
};

class PowerSGDState {
 public:
  // Throws ValueError for a rank below 1, a negative rate, or start_powerSGD_iter <= 1 with error
  // feedback or warm start (torch's rule: batched_powerSGD_hook's per-bucket state would not
  // survive DDP's bucket rebuild after the first iteration).
  explicit PowerSGDState(PowerSGDOptions options = {});

  const PowerSGDOptions& options() const { return options_; }
  // Iterations seen (counted at each iteration's last bucket).
  int64_t iter() const { return iter_; }
  // Elements the compressible gradients would have sent, and sent instead, since construction.
  struct CompressionStats {
    double rate = 0;  // before / after (0 before any compression)
    int64_t numel_before = 0, numel_after = 0;
  };
  CompressionStats compression_stats() const;
  // This rank's error (error feedback) for parameter `name` (powerSGD_hook) or bucket `bucket`
  // (batched_powerSGD_hook, padded to the square), flat; undefined before its first compressed step.
  Tensor error(const std::string& name) const;
  Tensor error(int64_t bucket) const;

  // What powerSGD_hook's state is after some steps: the counters, the warm-start Q of every
  // compressed parameter (the same on every rank) and this rank's errors. load_state_dict into a
  // fresh state (same options) continues exactly where state_dict was taken; each rank restores
  // its own errors. Throws ValueError from state_dict when batched_powerSGD_hook used this state
  // (its per-bucket state belongs to one bucket layout).
  struct Dict {
    int64_t iter = 0, numel_before = 0, numel_after = 0;
    std::map<std::string, Tensor> q;      // parameter name -> Q (cols x rank), flat
    std::map<std::string, Tensor> error;  // parameter name -> this rank's error, flat
  };
  Dict state_dict() const;
  void load_state_dict(const Dict& dict);

 private:
  friend HookResult powersgd_bucket(const std::shared_ptr<PowerSGDState>& state, dist::ProcessGroup& group,
                                    GradBucket& bucket);
  friend HookResult batched_powersgd_bucket(const std::shared_ptr<PowerSGDState>& state, dist::ProcessGroup& group,
                                            GradBucket& bucket);
  void maybe_increase_iter(const GradBucket& bucket);
  // Before start_powerSGD_iter, or for a bucket that is not f32, f16 or bf16: the plain average this time
  // (counting the iteration).
  bool plain_average_now(const GradBucket& bucket);
  // The stream a fresh Q of this iteration is drawn from, for a parameter name or a bucket.
  Generator q_stream(const std::string& key) const;

  PowerSGDOptions options_;
  int64_t iter_ = 0;
  int64_t numel_before_ = 0, numel_after_ = 0;
  std::map<std::string, Tensor> error_, q_memory_;           // powerSGD_hook, by parameter name
  std::map<int64_t, Tensor> bucket_error_, bucket_q_memory_;  // batched_powerSGD_hook, by bucket
};

// The hook to register on DistributedDataParallel (ddp.register_comm_hook).
CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state);
// torch's batched_powerSGD_hook: the whole bucket, zero-padded to a square side x side matrix
// (side = ceil(sqrt(numel))), is compressed as one matrix at rank min(side, rank): fewer, larger
// products and no per-parameter split (min_compression_rate is not used), a coarser
// approximation. Same state and options otherwise; do not share one state between both hooks.
CommHook batched_powerSGD_hook(std::shared_ptr<PowerSGDState> state);

}  // namespace tandem::parallel
