// PowerSGD (see powersgd.h): per bucket, plain all-reduce of the small gradients, then
// P = M Q -> all-reduce -> orthonormalise -> Q = M^T P -> all-reduce / world -> M = P Q^T.
#include "tandem/parallel/powersgd.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/error.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/shape.h"

namespace tandem::parallel {
namespace {

// Orthonormalises the columns of a contiguous (rows, cols) f32 matrix in place: Gram-Schmidt in
// f64, each column projected off the earlier ones twice ("twice is enough" keeps the columns
// orthogonal to f64 rounding), then divided by its norm (+ epsilon). A column that was (nearly)
// in the span of the earlier ones -- what remains is below 1e-5 of its norm, f32 input rounding --
// is set to zero rather than normalised noise: a rank-deficient P (fewer samples than the rank,
// a rank that has joined with zeros) still projects onto exactly its own column space.
void orthogonalize(Tensor& m, double epsilon) {
  const int64_t rows = m.size(0), cols = m.size(1);
  float* a = m.data_ptr<float>();
  std::vector<double> x(static_cast<size_t>(rows * cols));
  for (int64_t k = 0; k < rows * cols; ++k) x[static_cast<size_t>(k)] = a[k];
  auto at = [&](int64_t r, int64_t c) -> double& { return x[static_cast<size_t>(r * cols + c)]; };
  auto norm_of = [&](int64_t c) {
    double n2 = 0;
    for (int64_t r = 0; r < rows; ++r) n2 += at(r, c) * at(r, c);
    return std::sqrt(n2);
  };
  for (int64_t i = 0; i < cols; ++i) {
    const double original = norm_of(i);
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j = 0; j < i; ++j) {
        double dot = 0;
        for (int64_t r = 0; r < rows; ++r) dot += at(r, j) * at(r, i);
        for (int64_t r = 0; r < rows; ++r) at(r, i) -= dot * at(r, j);
      }
    }
    const double norm = norm_of(i);
    const bool dependent = original == 0 || norm <= 1e-5 * original;
    const double scale = dependent ? 0.0 : 1.0 / (norm + epsilon);
    for (int64_t r = 0; r < rows; ++r) at(r, i) *= scale;
  }
  for (int64_t k = 0; k < rows * cols; ++k) a[k] = static_cast<float>(x[static_cast<size_t>(k)]);
}

}  // namespace

PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(options), rng_(options.random_seed) {
  TANDEM_CHECK(options_.matrix_approximation_rank >= 1, ValueError,
               "PowerSGD: matrix_approximation_rank must be at least 1, got {}", options_.matrix_approximation_rank);
  TANDEM_CHECK(options_.min_compression_rate >= 0 && options_.orthogonalization_epsilon >= 0, ValueError,
               "PowerSGD: min_compression_rate and orthogonalization_epsilon must be >= 0, got {} and {}",
               options_.min_compression_rate, options_.orthogonalization_epsilon);
  TANDEM_CHECK(!((options_.use_error_feedback || options_.warm_start) && options_.start_powerSGD_iter <= 1), ValueError,
               "PowerSGD: start_powerSGD_iter must be > 1 with use_error_feedback or warm_start (got {}): DDP rebuilds "
               "its buckets after the first iteration, which would invalidate the per-bucket state",
               options_.start_powerSGD_iter);
}

PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats s;
  s.numel_before = numel_before_;
  s.numel_after = numel_after_;
  s.rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / static_cast<double>(numel_after_) : 0.0;
  return s;
}

Tensor PowerSGDState::error(int64_t bucket) const {
  auto it = error_.find(bucket);
  return it == error_.end() ? Tensor() : it->second;
}

void PowerSGDState::maybe_increase_iter(const GradBucket& bucket) {
  if (bucket.is_last) ++iter_;
}

bool PowerSGDState::plain_average_now(const GradBucket& bucket) {
  if (iter_ >= options_.start_powerSGD_iter && bucket.buffer.dtype() == kFloat32) return false;
  maybe_increase_iter(bucket);
  return true;
}

void PowerSGDState::add_error(int64_t bi, Tensor& input) {
  auto it = error_.find(bi);
  if (it != error_.end() && it->second.numel() == input.numel()) {
    input.add_(it->second);
  } else {
    error_[bi] = zeros({input.numel()}, kFloat32);
  }
}

HookResult powersgd_bucket(const std::shared_ptr<PowerSGDState>& sp, dist::ProcessGroup& group, GradBucket& bucket) {
  PowerSGDState& state = *sp;
  const PowerSGDOptions& o = state.options_;
  if (state.plain_average_now(bucket)) return allreduce_hook(group, bucket);
  NoGradGuard no_grad;
  const int64_t bi = bucket.index;
  const double world = group.size();
  Tensor input = bucket.buffer;
  Tensor input_copy;
  if (o.use_error_feedback) {
    state.add_error(bi, input);
    input_copy = input.clone();
  }

  // Which gradients to compress: viewed as (rows, rest) (a vector as one column), worth it at this
  // rank and rate.
  std::vector<Tensor> matrices, plain;
  std::vector<int64_t> ranks;
  int64_t p_size = 0, q_size = 0;
  for (const Tensor& g : bucket.gradients) {
    const int64_t n = g.dim() == 0 ? 1 : g.size(0);
    const int64_t m = n == 0 ? 0 : g.numel() / n;
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    const int64_t before = n * m, after = (n + m) * r;
    state.numel_before_ += before;
    if (r > 0 && static_cast<double>(after) * o.min_compression_rate < static_cast<double>(before)) {
      matrices.push_back(g.view({n, m}));
      ranks.push_back(r);
      p_size += n * r;
      q_size += m * r;
      state.numel_after_ += after;
    } else {
      plain.push_back(g);
      state.numel_after_ += before;
    }
  }

  // P and Q live in one flat buffer each per bucket (one all-reduce each), kept across steps with
  // warm start.
  bool randomize = true;
  auto pm = state.p_memory_.find(bi);
  if (o.warm_start && pm != state.p_memory_.end() && pm->second.numel() == p_size &&
      state.q_memory_[bi].numel() == q_size) {
    randomize = false;
  } else {
    state.p_memory_[bi] = empty({p_size}, kFloat32);
    state.q_memory_[bi] = empty({q_size}, kFloat32);
  }
  Tensor p_flat = state.p_memory_[bi], q_flat = state.q_memory_[bi];
  std::vector<Tensor> ps, qs;
  int64_t po = 0, qo = 0;
  for (size_t i = 0; i < matrices.size(); ++i) {
    const int64_t n = matrices[i].size(0), m = matrices[i].size(1), r = ranks[i];
    ps.push_back(p_flat.narrow(0, po, n * r).view({n, r}));
    qs.push_back(q_flat.narrow(0, qo, m * r).view({m, r}));
    po += n * r;
    qo += m * r;
  }
  for (Tensor& q : qs) {
    // A fresh start draws Q from the state's stream, which advances alike on every rank.
    if (randomize) q.copy_(randn(q.shape(), kFloat32, &state.rng_));
    orthogonalize(q, o.orthogonalization_epsilon);
  }
  for (size_t i = 0; i < matrices.size(); ++i) ps[i].copy_(ops::matmul(matrices[i], qs[i]));

  // The small gradients go first, as one flat all-reduce (summed; divided below).
  Tensor plain_flat;
  if (!plain.empty()) {
    std::vector<Tensor> flat;
    for (const Tensor& g : plain) flat.push_back(g.reshape({-1}));
    plain_flat = ops::cat(flat, 0);
  } else {
    plain_flat = empty({0}, kFloat32);
  }
  std::shared_ptr<dist::Work> work =
      plain_flat.numel() > 0 ? group.all_reduce(plain_flat, dist::ReduceOp::SUM) : dist::Work::completed();

  auto then = [sp, &group, bucket, plain, plain_flat, matrices, ps, qs, p_flat, q_flat, input_copy, world]() mutable {
    PowerSGDState& st = *sp;
    NoGradGuard no_grad;
    plain_flat.mul_(1.0 / world);
    int64_t off = 0;
    for (Tensor& g : plain) {
      g.copy_(plain_flat.narrow(0, off, g.numel()).view(g.shape()));
      off += g.numel();
    }
    // Summed P: orthonormalised next, so no division.
    if (p_flat.numel() > 0) group.all_reduce(p_flat, dist::ReduceOp::SUM)->wait();
    for (Tensor& p : ps) orthogonalize(p, st.options_.orthogonalization_epsilon);
    for (size_t i = 0; i < matrices.size(); ++i) qs[i].copy_(ops::matmul(matrices[i].t(), ps[i]));
    if (q_flat.numel() > 0) group.all_reduce(q_flat, dist::ReduceOp::SUM)->wait();
    q_flat.mul_(1.0 / world);
    for (size_t i = 0; i < matrices.size(); ++i) matrices[i].copy_(ops::matmul(ps[i], qs[i].t()));
    if (st.options_.use_error_feedback) st.error_[bucket.index] = ops::sub(input_copy, bucket.buffer);
    if (!st.options_.warm_start) {
      st.p_memory_.erase(bucket.index);
      st.q_memory_.erase(bucket.index);
    }
    st.maybe_increase_iter(bucket);
  };
  return {work, then};
}

HookResult batched_powersgd_bucket(const std::shared_ptr<PowerSGDState>& sp, dist::ProcessGroup& group,
                                   GradBucket& bucket) {
  PowerSGDState& state = *sp;
  const PowerSGDOptions& o = state.options_;
  if (state.plain_average_now(bucket)) return allreduce_hook(group, bucket);
  NoGradGuard no_grad;
  const int64_t bi = bucket.index, total = bucket.buffer.numel();
  const double world = group.size();
  int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  while (side * side < total) ++side;  // guard the rounding of sqrt
  const int64_t r = std::min(side, o.matrix_approximation_rank);
  state.numel_before_ += total;
  state.numel_after_ += 2 * side * r;

  // The bucket, zero-padded to side x side (the bucket's own memory cannot grow).
  Tensor padded = zeros({side * side}, kFloat32);
  padded.narrow(0, 0, total).copy_(bucket.buffer);
  if (o.use_error_feedback) state.add_error(bi, padded);
  Tensor input_copy = o.use_error_feedback ? padded.clone() : Tensor();
  Tensor matrix = padded.view({side, side});

  auto pm = state.p_memory_.find(bi), qm = state.q_memory_.find(bi);
  const bool reuse = o.warm_start && pm != state.p_memory_.end() && qm != state.q_memory_.end() &&
                     qm->second.numel() == side * r;
  if (!reuse) {
    state.p_memory_[bi] = empty({side * r}, kFloat32);
    state.q_memory_[bi] = randn({side * r}, kFloat32, &state.rng_);
  }
  Tensor p = state.p_memory_[bi].view({side, r}), q = state.q_memory_[bi].view({side, r});
  orthogonalize(q, o.orthogonalization_epsilon);
  p.copy_(ops::matmul(matrix, q));
  std::shared_ptr<dist::Work> work = group.all_reduce(p, dist::ReduceOp::SUM);  // orthonormalised next

  auto then = [sp, &group, bucket, padded, matrix, p, q, input_copy, total, world]() mutable {
    PowerSGDState& st = *sp;
    NoGradGuard no_grad;
    orthogonalize(p, st.options_.orthogonalization_epsilon);
    q.copy_(ops::matmul(matrix.t(), p));
    group.all_reduce(q, dist::ReduceOp::SUM)->wait();
    q.mul_(1.0 / world);
    matrix.copy_(ops::matmul(p, q.t()));
    if (st.options_.use_error_feedback) st.error_[bucket.index] = ops::sub(input_copy, padded);
    bucket.buffer.copy_(padded.narrow(0, 0, total));
    if (!st.options_.warm_start) {
      st.p_memory_.erase(bucket.index);
      st.q_memory_.erase(bucket.index);
    }
    st.maybe_increase_iter(bucket);
  };
  return {work, then};
}

CommHook batched_powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  TANDEM_CHECK(state != nullptr, ValueError, "batched_powerSGD_hook: state is null");
  return [state](dist::ProcessGroup& group, GradBucket& bucket) { return batched_powersgd_bucket(state, group, bucket); };
}

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  TANDEM_CHECK(state != nullptr, ValueError, "powerSGD_hook: state is null");
  return [state](dist::ProcessGroup& group, GradBucket& bucket) { return powersgd_bucket(state, group, bucket); };
}

}  // namespace tandem::parallel
