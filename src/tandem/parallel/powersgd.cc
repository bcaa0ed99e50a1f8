// PowerSGD (see powersgd.h): per bucket, plain all-reduce of the small gradients, then
// P = M Q -> all-reduce -> orthonormalise -> Q = M^T P -> all-reduce / world -> M = P Q^T.
#include "tandem/parallel/powersgd.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/error.h"
#include "tandem/core/hash.h"
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

// Orthonormalises Q. A column left zero (a warm-start Q whose column went to zero, e.g. after a
// rank-deficient or all-zero gradient) would stay zero forever: P = M Q and the next Q = M^T P
// keep it so, and the approximation loses that rank for good (torch's QR path redraws nothing
// either, its Gram-Schmidt divides by zero). Such columns get fresh random values from the
// parameter's stream (the same on every rank: Q is the all-reduced one) and are orthonormalised
// against the others.
void orthogonalize_q(Tensor& q, double epsilon, const std::function<Generator()>& stream) {
  orthogonalize(q, epsilon);
  const int64_t rows = q.size(0), cols = q.size(1);
  for (int attempt = 0; attempt < 3; ++attempt) {
    float* a = q.data_ptr<float>();
    std::vector<int64_t> zero_cols;
    for (int64_t c = 0; c < cols; ++c) {
      bool zero = true;
      for (int64_t r = 0; r < rows && zero; ++r) zero = a[r * cols + c] == 0.0f;
      if (zero) zero_cols.push_back(c);
    }
    if (zero_cols.empty()) return;
    Generator gen = stream();
    for (int k = 0; k < attempt; ++k) (void)randn({rows, cols}, kFloat32, &gen);
    const Tensor fresh = randn({rows, cols}, kFloat32, &gen);
    const float* f = fresh.data_ptr<float>();
    for (const int64_t c : zero_cols) {
      for (int64_t r = 0; r < rows; ++r) a[r * cols + c] = f[r * cols + c];
    }
    orthogonalize(q, epsilon);
  }
}

bool all_finite(const Tensor& t) {
  const float* x = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

}  // namespace

PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(options) {
  TANDEM_CHECK(options_.matrix_approximation_rank >= 1, ValueError,
               "PowerSGD: matrix_approximation_rank must be at least 1, got {}", options_.matrix_approximation_rank);
  TANDEM_CHECK(options_.min_compression_rate >= 0 && options_.orthogonalization_epsilon >= 0, ValueError,
               "PowerSGD: min_compression_rate and orthogonalization_epsilon must be >= 0, got {} and {}",
               options_.min_compression_rate, options_.orthogonalization_epsilon);
  TANDEM_CHECK(!((options_.use_error_feedback || options_.warm_start) && options_.start_powerSGD_iter <= 1), ValueError,
               "PowerSGD: start_powerSGD_iter must be > 1 with use_error_feedback or warm_start (got {}): DDP rebuilds "
               "its buckets after the first iteration, which would invalidate batched_powerSGD_hook's per-bucket state",
               options_.start_powerSGD_iter);
}

PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats s;
  s.numel_before = numel_before_;
  s.numel_after = numel_after_;
  s.rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / static_cast<double>(numel_after_) : 0.0;
  return s;
}

Tensor PowerSGDState::error(const std::string& name) const {
  auto it = error_.find(name);
  return it == error_.end() ? Tensor() : it->second;
}

Tensor PowerSGDState::error(int64_t bucket) const {
  auto it = bucket_error_.find(bucket);
  return it == bucket_error_.end() ? Tensor() : it->second;
}

PowerSGDState::Dict PowerSGDState::state_dict() const {
  TANDEM_CHECK(bucket_error_.empty() && bucket_q_memory_.empty(), ValueError,
               "PowerSGDState::state_dict: this state was used by batched_powerSGD_hook, whose state is per bucket and "
               "belongs to one bucket layout (a fresh DDP starts with another); only powerSGD_hook's state can be saved");
  Dict d;
  d.iter = iter_;
  d.numel_before = numel_before_;
  d.numel_after = numel_after_;
  for (const auto& [name, q] : q_memory_) d.q[name] = q.clone();
  for (const auto& [name, e] : error_) d.error[name] = e.clone();
  return d;
}

void PowerSGDState::load_state_dict(const Dict& dict) {
  TANDEM_CHECK(dict.iter >= 0 && dict.numel_before >= 0 && dict.numel_after >= 0, ValueError,
               "PowerSGDState::load_state_dict: negative counter (iter {}, numel_before {}, numel_after {})", dict.iter,
               dict.numel_before, dict.numel_after);
  std::map<std::string, Tensor> q, error;
  for (const auto& [name, t] : dict.q) {
    TANDEM_CHECK(t.defined() && t.dtype() == kFloat32, ValueError,
                 "PowerSGDState::load_state_dict: Q of \"{}\" is not an f32 tensor", name);
    q[name] = t.reshape({-1}).clone();
  }
  for (const auto& [name, t] : dict.error) {
    TANDEM_CHECK(t.defined() && t.dtype() == kFloat32, ValueError,
                 "PowerSGDState::load_state_dict: error of \"{}\" is not an f32 tensor", name);
    error[name] = t.reshape({-1}).clone();
  }
  iter_ = dict.iter;
  numel_before_ = dict.numel_before;
  numel_after_ = dict.numel_after;
  q_memory_ = std::move(q);
  error_ = std::move(error);
  bucket_error_.clear();
  bucket_q_memory_.clear();
}

Generator PowerSGDState::q_stream(const std::string& key) const {
  // Philox keyed by a hash of (seed, iteration, key): distinct keys, distinct streams.
  const uint64_t seed = options_.random_seed;
  const int64_t iter = iter_;
  uint64_t h = fnv1a(&seed, sizeof seed);
  h = fnv1a(&iter, sizeof iter, h);
  return Generator(fnv1a(key.data(), key.size(), h));
}

void PowerSGDState::maybe_increase_iter(const GradBucket& bucket) {
  if (bucket.is_last) ++iter_;
}

bool PowerSGDState::plain_average_now(const GradBucket& bucket) {
  const DType d = bucket.buffer.dtype();
  const bool floating = d == kFloat32 || d == kFloat16 || d == kBFloat16;
  if (iter_ >= options_.start_powerSGD_iter && floating) return false;
  maybe_increase_iter(bucket);
  return true;
}

namespace {
// Error feedback: adds the kept error to `input` (or starts a zero one of input's length).
void add_error(Tensor& kept, Tensor& input) {
  if (kept.defined() && kept.numel() == input.numel()) {
    input.add_(kept.view(input.shape()));
  } else {
    kept = zeros({input.numel()}, kFloat32);
  }
}

// Sums an f32 tensor over the ranks, sent in `wire` (f32 in place; a 16-bit copy otherwise, the
// backend accumulating in f32).
void all_reduce_sum(dist::ProcessGroup& group, Tensor& t, DType wire) {
  if (t.numel() == 0) return;
  if (wire == kFloat32) {
    group.all_reduce(t, dist::ReduceOp::SUM)->wait();
    return;
  }
  Tensor w = t.to(wire);
  group.all_reduce(w, dist::ReduceOp::SUM)->wait();
  t.copy_(w);
}
}  // namespace

HookResult powersgd_bucket(const std::shared_ptr<PowerSGDState>& sp, dist::ProcessGroup& group, GradBucket& bucket) {
  PowerSGDState& state = *sp;
  const PowerSGDOptions& o = state.options_;
  if (state.plain_average_now(bucket)) return allreduce_hook(group, bucket);
  NoGradGuard no_grad;
  const double world = group.size();
  const DType wire = bucket.buffer.dtype();
  const std::vector<std::string>& names = bucket.parameter_names;
  TANDEM_CHECK(names.size() == bucket.gradients.size(), Error,
               "powerSGD_hook: bucket {} has {} parameter names for {} gradients", bucket.index, names.size(),
               bucket.gradients.size());

  // The f32 gradients to work on: the bucket's own memory for an f32 bucket, copies of a 16-bit
  // one (written back, rounded, at the end). Error feedback, per parameter: the input is the
  // gradient plus what was lost last time; a copy of it gives this step's loss at the end.
  std::vector<Tensor> work_grads, input_copies;
  for (size_t i = 0; i < names.size(); ++i) {
    Tensor g = wire == kFloat32 ? bucket.gradients[i] : bucket.gradients[i].to(kFloat32);
    if (o.use_error_feedback) {
      add_error(state.error_[names[i]], g);
      input_copies.push_back(g.clone());
    }
    work_grads.push_back(g);
  }

  // Which gradients to compress: viewed as (rows, rest) (a vector as one column), worth it at this
  // rank and rate.
  std::vector<Tensor> matrices, plain;
  std::vector<std::string> matrix_names;
  std::vector<int64_t> ranks;
  int64_t p_size = 0, q_size = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const Tensor& g = work_grads[i];
    const int64_t n = g.dim() == 0 ? 1 : g.size(0);
    const int64_t m = n == 0 ? 0 : g.numel() / n;
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    const int64_t before = n * m, after = (n + m) * r;
    state.numel_before_ += before;
    if (r > 0 && static_cast<double>(after) * o.min_compression_rate < static_cast<double>(before)) {
      matrices.push_back(g.view({n, m}));
      matrix_names.push_back(names[i]);
      ranks.push_back(r);
      p_size += n * r;
      q_size += m * r;
      state.numel_after_ += after;
    } else {
      plain.push_back(g);
      state.numel_after_ += before;
    }
  }

  // The bucket's Ps and Qs lie in one flat buffer each (one all-reduce each); with warm start each
  // parameter's Q is kept from its previous step.
  Tensor p_flat = empty({p_size}, kFloat32), q_flat = empty({q_size}, kFloat32);
  std::vector<Tensor> ps, qs;
  int64_t po = 0, qo = 0;
  for (size_t i = 0; i < matrices.size(); ++i) {
    const int64_t n = matrices[i].size(0), m = matrices[i].size(1), r = ranks[i];
    ps.push_back(p_flat.narrow(0, po, n * r).view({n, r}));
    qs.push_back(q_flat.narrow(0, qo, m * r).view({m, r}));
    po += n * r;
    qo += m * r;
    auto kept = state.q_memory_.find(matrix_names[i]);
    if (o.warm_start && kept != state.q_memory_.end() && kept->second.numel() == m * r) {
      qs[i].copy_(kept->second.view({m, r}));
    } else {
      Generator gen = state.q_stream(matrix_names[i]);
      qs[i].copy_(randn({m, r}, kFloat32, &gen));
    }
    orthogonalize_q(qs[i], o.orthogonalization_epsilon, [&] { return state.q_stream(matrix_names[i]); });
  }
  for (size_t i = 0; i < matrices.size(); ++i) ps[i].copy_(ops::matmul(matrices[i], qs[i]));

  // The small gradients go first, as one flat all-reduce in the bucket's dtype (summed; divided
  // below).
  Tensor plain_flat;
  if (!plain.empty()) {
    std::vector<Tensor> flat;
    for (const Tensor& g : plain) flat.push_back(g.reshape({-1}));
    plain_flat = ops::cat(flat, 0);
  } else {
    plain_flat = empty({0}, kFloat32);
  }
  Tensor plain_wire = wire == kFloat32 ? plain_flat : plain_flat.to(wire);
  std::shared_ptr<dist::Work> work =
      plain_wire.numel() > 0 ? group.all_reduce(plain_wire, dist::ReduceOp::SUM) : dist::Work::completed();

  auto then = [sp, &group, bucket, wire, work_grads, plain, plain_flat, plain_wire, matrices, matrix_names, ps, qs, p_flat,
               q_flat, input_copies, world]() mutable {
    PowerSGDState& st = *sp;
    NoGradGuard no_grad;
    if (wire != kFloat32) plain_flat.copy_(plain_wire);
    plain_flat.mul_(1.0 / world);
    int64_t off = 0;
    for (Tensor& g : plain) {
      g.copy_(plain_flat.narrow(0, off, g.numel()).view(g.shape()));
      off += g.numel();
    }
    // Summed P: orthonormalised next, so no division.
    all_reduce_sum(group, p_flat, wire);
    if (!all_finite(p_flat) || !all_finite(plain_flat)) {
      // Some rank's gradient was not finite (an fp16 loss-scale overflow, say). The summed P and
      // the averaged small gradients are the same on every rank, so every rank takes this branch
      // and skips the Q all-reduce. The
      // compressed gradients become NaN (a GradScaler skips the step), and the error feedback
      // and the warm-start Qs stay as they were: storing input - NaN would poison every later
      // step.
      for (Tensor& mtx : matrices) mtx.fill_(std::numeric_limits<float>::quiet_NaN());
      if (wire != kFloat32) {
        for (size_t i = 0; i < work_grads.size(); ++i) bucket.gradients[i].copy_(work_grads[i]);
      }
      st.maybe_increase_iter(bucket);
      return;
    }
    for (Tensor& p : ps) orthogonalize(p, st.options_.orthogonalization_epsilon);
    for (size_t i = 0; i < matrices.size(); ++i) qs[i].copy_(ops::matmul(matrices[i].t(), ps[i]));
    all_reduce_sum(group, q_flat, wire);
    q_flat.mul_(1.0 / world);
    for (size_t i = 0; i < matrices.size(); ++i) matrices[i].copy_(ops::matmul(ps[i], qs[i].t()));
    for (size_t i = 0; i < matrices.size(); ++i) {
      if (st.options_.warm_start) {
        st.q_memory_[matrix_names[i]] = qs[i].reshape({-1}).clone();
      } else {
        st.q_memory_.erase(matrix_names[i]);
      }
    }
    // A 16-bit bucket gets the result rounded to its dtype; the error is measured against that.
    if (wire != kFloat32) {
      for (size_t i = 0; i < work_grads.size(); ++i) bucket.gradients[i].copy_(work_grads[i]);
    }
    if (st.options_.use_error_feedback) {
      for (size_t i = 0; i < input_copies.size(); ++i) {
        const Tensor result = wire == kFloat32 ? bucket.gradients[i] : bucket.gradients[i].to(kFloat32);
        st.error_[bucket.parameter_names[i]] = ops::sub(input_copies[i], result).reshape({-1});
      }
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
  const DType wire = bucket.buffer.dtype();
  int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  while (side * side < total) ++side;  // guard the rounding of sqrt
  const int64_t r = std::min(side, o.matrix_approximation_rank);
  state.numel_before_ += total;
  state.numel_after_ += 2 * side * r;

  // The bucket in f32, zero-padded to side x side (the bucket's own memory cannot grow).
  Tensor padded = zeros({side * side}, kFloat32);
  padded.narrow(0, 0, total).copy_(bucket.buffer);
  if (o.use_error_feedback) add_error(state.bucket_error_[bi], padded);
  Tensor input_copy = o.use_error_feedback ? padded.clone() : Tensor();
  Tensor matrix = padded.view({side, side});

  Tensor p = empty({side, r}, kFloat32), q = empty({side, r}, kFloat32);
  auto kept = state.bucket_q_memory_.find(bi);
  if (o.warm_start && kept != state.bucket_q_memory_.end() && kept->second.numel() == side * r) {
    q.copy_(kept->second.view({side, r}));
  } else {
    Generator gen = state.q_stream(fmt::format("bucket {}", bi));
    q.copy_(randn({side, r}, kFloat32, &gen));
  }
  orthogonalize_q(q, o.orthogonalization_epsilon, [&] { return state.q_stream(fmt::format("bucket {}", bi)); });
  p.copy_(ops::matmul(matrix, q));
  // Summed P (orthonormalised next), in the bucket's dtype.
  Tensor p_wire = wire == kFloat32 ? p : p.to(wire);
  std::shared_ptr<dist::Work> work = group.all_reduce(p_wire, dist::ReduceOp::SUM);

  auto then = [sp, &group, bucket, wire, padded, matrix, p, p_wire, q, input_copy, total, world]() mutable {
    PowerSGDState& st = *sp;
    NoGradGuard no_grad;
    if (wire != kFloat32) p.copy_(p_wire);
    if (!all_finite(p)) {  // as in powerSGD_hook: NaN out, error and Q kept
      bucket.buffer.fill_(std::numeric_limits<float>::quiet_NaN());
      st.maybe_increase_iter(bucket);
      return;
    }
    orthogonalize(p, st.options_.orthogonalization_epsilon);
    q.copy_(ops::matmul(matrix.t(), p));
    all_reduce_sum(group, q, wire);
    q.mul_(1.0 / world);
    matrix.copy_(ops::matmul(p, q.t()));
    bucket.buffer.copy_(padded.narrow(0, 0, total));
    if (st.options_.use_error_feedback) {
      // Against what the bucket holds (rounded, for a 16-bit one); the padding is exact.
      if (wire != kFloat32) padded.narrow(0, 0, total).copy_(bucket.buffer);
      st.bucket_error_[bucket.index] = ops::sub(input_copy, padded);
    }
    if (st.options_.warm_start) {
      st.bucket_q_memory_[bucket.index] = q.reshape({-1}).clone();
    } else {
      st.bucket_q_memory_.erase(bucket.index);
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
