// PowerSGD as a DDP communication hook (parallel/powersgd.h). What is checked, on 2 and 3 forked
// ranks over shm: the plain average before start_powerSGD_iter (bit for bit); the exact average
// (to f32 rounding) when the rank covers every compressed matrix; at rank 1 with error feedback,
// results equal on every rank, rank-1 compressed gradients, and nothing lost: the average of what
// the ranks put in (their gradients plus their previous errors) equals the result plus the
// average of their new errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <cstring>

#include "tandem/autograd/grad_mode.h"
#include "tandem/dist/process_group.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/reduce.h"
#include "tandem/ops/shape.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/powersgd.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::dist::ProcessGroup;
using td::parallel::DDPOptions;
using td::parallel::DistributedDataParallel;
using td::parallel::PowerSGDOptions;
using td::parallel::PowerSGDState;

namespace {

void on_ranks(int n, const td::testing::RankFn& fn) {
  td::testing::on_ranks(n, fn, std::chrono::seconds(120), std::chrono::seconds(20));
}
using td::testing::bitwise_equal;
using td::testing::fail;
using td::testing::rel_diff;
using td::testing::same_everywhere;

// x -> linear(w1 12x16, b1) -> tanh -> linear(w2 5x12, b2) -> tanh -> linear(w3 20x5): three
// matrices worth compressing at rank 1 (wide and tall) and two vectors that are not (at the
// default rate).
// `w3_first`: the same values, w3 registered first (DDP's initial layout then differs from the
// order backward produces the gradients in, so the rebuild changes it).
struct Net : td::nn::Module {
  explicit Net(bool w3_first = false) : Module("Net") {
    td::Generator gen(21);
    Tensor v1 = td::ops::mul(td::randn({12, 16}, td::kFloat32, &gen), 0.3);
    Tensor c1 = td::ops::mul(td::randn({12}, td::kFloat32, &gen), 0.1);
    Tensor v2 = td::ops::mul(td::randn({5, 12}, td::kFloat32, &gen), 0.3);
    Tensor c2 = td::ops::mul(td::randn({5}, td::kFloat32, &gen), 0.1);
    Tensor v3 = td::ops::mul(td::randn({20, 5}, td::kFloat32, &gen), 0.3);
    if (w3_first) w3 = register_parameter("w3", v3);
    w1 = register_parameter("w1", v1);
    b1 = register_parameter("b1", c1);
    w2 = register_parameter("w2", v2);
    b2 = register_parameter("b2", c2);
    if (!w3_first) w3 = register_parameter("w3", v3);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = td::ops::tanh(td::ops::linear(td::ops::tanh(td::ops::linear(x, w1, b1)), w2, b2));
    return td::ops::linear(h, w3);
  }
  Tensor w1, b1, w2, b2, w3;
};

Tensor batch(int step, int rank) {
  td::Generator gen(static_cast<uint64_t>(900 + 31 * step + rank));
  return td::randn({7, 16}, td::kFloat32, &gen);
}
// Regression on random targets (a loss of the output alone would give w3 a gradient whose columns
// lie in w3's own column space on every rank, which hides a Q that differs across ranks).
Tensor target(int step, int rank) {
  td::Generator gen(static_cast<uint64_t>(5000 + 31 * step + rank));
  return td::randn({7, 20}, td::kFloat32, &gen);
}
Tensor loss_of(const Tensor& out, const Tensor& y) {
  Tensor d = td::ops::sub(out, y);
  return td::ops::mul(td::ops::sum(td::ops::mul(d, d)), 1.0 / d.numel());
}


// The sum over ranks.
Tensor sum_over_ranks(ProcessGroup& group, const Tensor& t) {
  Tensor s = t.contiguous().clone();
  group.all_reduce(s, td::dist::ReduceOp::SUM)->wait();
  return s;
}

// This rank's own gradients (no averaging), from a copy of the model's current parameters.
std::vector<Tensor> local_grads(const Net& model, const Tensor& x, const Tensor& y) {
  Net copy;
  {
    td::NoGradGuard no_grad;
    auto src = model.parameters(), dst = copy.parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  loss_of(copy.forward(x), y).backward();
  std::vector<Tensor> g;
  for (auto& p : copy.parameters()) g.push_back(p.grad().clone());
  return g;
}

}  // namespace

// Before start_powerSGD_iter the hook is the plain average: the same gradients, bit for bit, as
// DDP without a hook. From then on the compressed ones differ (a rank-1 approximation).
TEST(DDPPowerSGD, IsThePlainAverageBeforeStartIter) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto a = std::make_shared<Net>(), b = std::make_shared<Net>();
    DistributedDataParallel with(a, group), without(b, group);
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 3});
    with.register_comm_hook(td::parallel::powerSGD_hook(state));
    for (int s = 0; s < 4; ++s) {
      a->zero_grad();
      b->zero_grad();
      loss_of(with(batch(s, rank)), target(s, rank)).backward();
      loss_of(without(batch(s, rank)), target(s, rank)).backward();
      const bool equal = bitwise_equal(a->w1.grad(), b->w1.grad()) && bitwise_equal(a->w2.grad(), b->w2.grad()) &&
                         bitwise_equal(a->b1.grad(), b->b1.grad());
      if (s < 3 && !equal) fail(fmt::format("rank {} step {}: gradients differ from the plain average before start", rank, s));
      if (s == 3 && bitwise_equal(a->w1.grad(), b->w1.grad()))
        fail(fmt::format("rank {} step 3: w1's gradient is still the plain average; PowerSGD did not start", rank));
      if (state->iter() != s + 1) fail(fmt::format("rank {} step {}: iter() is {}", rank, s, state->iter()));
    }
    const auto st = state->compression_stats();
    // w1 12x16 -> 28, w2 5x12 -> 17, w3 20x5 -> 25 at rank 1; the biases go as they are.
    if (st.numel_before != 12 * 16 + 12 + 5 * 12 + 5 + 20 * 5 || st.numel_after != 28 + 12 + 17 + 5 + 25)
      fail(fmt::format("compression stats {} -> {}", st.numel_before, st.numel_after));
  });
}

// With the rank at least the smaller side of every matrix, P spans the summed matrix's columns (for
// the tall w3 only if every rank drew the same Q) and P Q^T is the average itself (vectors too, compressed as one column at min_compression_rate 0):
// equal to the plain average within f32 rounding of the three products and the orthogonalisation,
// which the orthogonalisation amplifies by the condition number of M Q (a random Q): rel 1e-4
// (f32 eps 6e-8 times conditions up to ~1e3; measured up to 2e-5 here).
// The per-matrix hook or the batched one (the whole bucket as one square matrix).
td::parallel::CommHook make_hook(bool batched, std::shared_ptr<PowerSGDState> state) {
  return batched ? td::parallel::batched_powerSGD_hook(std::move(state)) : td::parallel::powerSGD_hook(std::move(state));
}

// Three steps of DDP with full-rank PowerSGD (no error feedback, no warm start) against DDP with
// the plain average, on `samples` samples per rank: every gradient within rel 1e-4 of the average
// and the same on every rank.
void expect_full_rank_is_the_average(ProcessGroup& group, std::shared_ptr<ProcessGroup> shared, int64_t samples,
                                     bool batched = false) {
  const int rank = group.rank();
  auto a = std::make_shared<Net>(), b = std::make_shared<Net>();
  DistributedDataParallel with(a, shared), without(b, shared);
  // 16 covers every matrix of Net; the batched hook's one matrix is 20 x 20 (369 gradients).
  auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.matrix_approximation_rank = batched ? 20 : 16,
                                                               .start_powerSGD_iter = 0,
                                                               .min_compression_rate = 0,
                                                               .use_error_feedback = false,
                                                               .warm_start = false});
  with.register_comm_hook(make_hook(batched, state));
  for (int s = 0; s < 3; ++s) {
    const Tensor x = batch(s, rank).narrow(0, 0, samples), y = target(s, rank).narrow(0, 0, samples);
    a->zero_grad();
    b->zero_grad();
    loss_of(with(x), y).backward();
    loss_of(without(x), y).backward();
    auto ga = a->named_parameters(), gb = b->named_parameters();
    for (size_t i = 0; i < ga.size(); ++i) {
      const double d = rel_diff(ga[i].second.grad(), gb[i].second.grad());
      if (!(d <= 1e-4))
        fail(fmt::format("world {} rank {} step {} ({} samples, batched {}): '{}' differs from the average by rel {:.3g}",
                         group.size(), rank, s, samples, batched, ga[i].first, d));
      if (!same_everywhere(group, ga[i].second.grad())) fail(fmt::format("'{}' differs across ranks", ga[i].first));
    }
  }
  if (state->compression_stats().numel_after <= 0) fail("nothing went through PowerSGD");
}

TEST(DDPPowerSGD, FullRankIsTheAverage) {
  for (int world : {2, 3}) {
    on_ranks(world, [&](std::shared_ptr<ProcessGroup> group) {
      expect_full_rank_is_the_average(*group, group, 7);
      expect_full_rank_is_the_average(*group, group, 7, /*batched=*/true);
    });
  }
}

// PowerSGD in 16 bits, at full rank on 2 ranks (no error feedback, no warm start): through
// fp16_compress_wrapper / bf16_compress_wrapper on an f32 model (torch's pairing; the factors go
// in 16 bits), and directly on a model whose parameters are bf16 (O2). Against the plain f32
// average, per gradient: at full rank P spans every column, so what remains is rounding: the
// bucket rounded to 16 bits, Q's all-reduce in 16 bits, the result rounded to 16 bits (three
// half-ulps: ~8e-4 for fp16, ~6e-3 for bf16): bounds 3e-3 and 2e-2, measured 5.2e-4 and 6.3e-3.
// With bf16 parameters the forward and backward also run in bf16 (their gradients are bf16
// before any communication): bound 3e-2, measured 1.1e-2. Equal on every rank; the wrapped f32
// result differs from the unwrapped one.
TEST(DDPPowerSGD, SixteenBitWrappersAndBf16ParametersStayWithinTheirRounding) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    const PowerSGDOptions full{.matrix_approximation_rank = 16,
                               .start_powerSGD_iter = 0,
                               .min_compression_rate = 0,
                               .use_error_feedback = false,
                               .warm_start = false};
    for (int variant = 0; variant < 3; ++variant) {  // fp16 wrapper, bf16 wrapper, bf16 parameters
      const bool bf16_params = variant == 2;
      const double tol = variant == 0 ? 3e-3 : variant == 1 ? 2e-2 : 3e-2;
      auto a = std::make_shared<Net>(), ref = std::make_shared<Net>(), plain = std::make_shared<Net>();
      if (bf16_params) a->to(td::kBFloat16);
      DistributedDataParallel with(a, group), reference(ref, group), unwrapped(plain, group);
      auto state = std::make_shared<PowerSGDState>(full);
      td::parallel::CommHook hook = td::parallel::powerSGD_hook(state);
      if (variant == 0) hook = td::parallel::fp16_compress_wrapper(hook);
      if (variant == 1) hook = td::parallel::bf16_compress_wrapper(hook);
      with.register_comm_hook(hook);
      unwrapped.register_comm_hook(td::parallel::powerSGD_hook(std::make_shared<PowerSGDState>(full)));
      for (int s = 0; s < 2; ++s) {
        const Tensor x = batch(s, rank), y = target(s, rank);
        for (auto* m : {static_cast<Net*>(a.get()), ref.get(), plain.get()}) m->zero_grad();
        const Tensor out = bf16_params ? with(x.to(td::kBFloat16)).to(td::kFloat32) : with(x);
        loss_of(out, y).backward();
        loss_of(reference(x), y).backward();
        loss_of(unwrapped(x), y).backward();
        auto ga = a->named_parameters(), gr = ref->named_parameters(), gp = plain->named_parameters();
        bool wrapper_changed_something = false;
        for (size_t i = 0; i < ga.size(); ++i) {
          const Tensor g = ga[i].second.grad();
          const double d = rel_diff(g, gr[i].second.grad());
          if (!(d <= tol)) {
            fail(fmt::format("variant {} step {}: '{}' differs from the f32 average by rel {:.3g} (bound {})", variant, s,
                             ga[i].first, d, tol));
          }
          if (!same_everywhere(*group, g)) fail(fmt::format("variant {}: '{}' differs across ranks", variant, ga[i].first));
          if (g.dtype() != (bf16_params ? td::kBFloat16 : td::kFloat32)) fail("a gradient changed dtype");
          wrapper_changed_something = wrapper_changed_something || !bitwise_equal(g.to(td::kFloat32), gp[i].second.grad());
        }
        if (!wrapper_changed_something) fail(fmt::format("variant {}: the same bits as f32 PowerSGD", variant));
      }
      if (state->compression_stats().numel_after <= 0) fail(fmt::format("variant {}: nothing compressed", variant));
    }
  });
}

// Rank-deficient gradients at full rank: 2 ranks x 2 samples give a 12x16 gradient of rank <= 4,
// so P = M Q has dependent columns; they must not turn into normalised rounding noise that is not
// orthogonal to the rest, for P Q^T to stay the average (within rel 1e-4 as above).
TEST(DDPPowerSGD, RankDeficientGradientsStayExactAtFullRank) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) { expect_full_rank_is_the_average(*group, group, 2); });
}

// Rank 1 with error feedback and warm start, per matrix and batched: every rank gets the same
// gradients; (per matrix) w1's, w2's and w3's are rank 1 (every row parallel to the largest); and nothing is lost: sum over ranks of (local
// gradient + previous error) = world x result + sum over ranks of the new error, per element,
// within f32 rounding (rel 1e-5 of the norm).
void expect_rank_one_loses_nothing(std::shared_ptr<ProcessGroup> group, bool batched) {
  {
    const int rank = group->rank();
    const double world = group->size();
    auto model = std::make_shared<Net>();
    DistributedDataParallel ddp(model, group);
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 2});
    ddp.register_comm_hook(make_hook(batched, state));
    td::optim::SGD opt(model->parameters(), {.lr = 0.1});
    for (int s = 0; s < 6; ++s) {
      const Tensor x = batch(s, rank), y = target(s, rank);
      const std::vector<Tensor> local = local_grads(*model, x, y);
      const auto layout = ddp.reducer().bucket_indices();
      // The error of bucket bi: the batched hook keeps one per bucket (padded to a square, the
      // bucket's elements first); the per-matrix hook one per parameter, put together here in the
      // bucket's order (undefined until every parameter of the bucket has one).
      const auto names = model->named_parameters();
      const auto error_of = [&](size_t bi) {
        if (batched) return state->error(static_cast<int64_t>(bi));
        std::vector<Tensor> parts;
        for (int64_t p : layout[bi]) {
          Tensor e = state->error(names[static_cast<size_t>(p)].first);
          if (!e.defined()) return Tensor();
          parts.push_back(e);
        }
        return td::ops::cat(parts, 0);
      };
      std::vector<Tensor> before;
      for (size_t bi = 0; bi < layout.size(); ++bi) {
        Tensor e = error_of(bi);
        before.push_back(e.defined() ? e.clone() : Tensor());
      }
      opt.zero_grad();
      loss_of(ddp(x), y).backward();
      auto params = model->parameters();
      for (auto& p : params) {
        if (!same_everywhere(*group, p.grad())) fail(fmt::format("step {}: a gradient differs across ranks", s));
      }
      if (s >= 2 && !batched) {
        for (const Tensor* w : {&model->w1, &model->w2, &model->w3}) {
          Tensor g = w->grad().to(td::kFloat64).contiguous();
          const int64_t n = g.size(0), m = g.size(1);
          const double* a = g.data_ptr<double>();
          int64_t best = 0;
          double best_norm = 0;
          for (int64_t r = 0; r < n; ++r) {
            double nr = 0;
            for (int64_t c = 0; c < m; ++c) nr += a[r * m + c] * a[r * m + c];
            if (nr > best_norm) best_norm = nr, best = r;
          }
          for (int64_t r = 0; r < n; ++r) {
            double dot = 0, nr = 0;
            for (int64_t c = 0; c < m; ++c) dot += a[r * m + c] * a[best * m + c], nr += a[r * m + c] * a[r * m + c];
            const double residual2 = nr - dot * dot / best_norm;
            if (residual2 > 1e-8 * nr + 1e-30) fail(fmt::format("step {}: a compressed gradient is not rank 1 (row {})", s, r));
          }
        }
      }
      if (s >= 2) {
        // Conservation, bucket by bucket.
        for (size_t bi = 0; bi < layout.size(); ++bi) {
          std::vector<Tensor> in, out;
          for (int64_t p : layout[bi]) {
            in.push_back(local[static_cast<size_t>(p)].reshape({-1}));
            out.push_back(params[static_cast<size_t>(p)].grad().reshape({-1}));
          }
          Tensor input = td::ops::cat(in, 0), result = td::ops::cat(out, 0);
          if (before[bi].defined()) input = td::ops::add(input, before[bi].narrow(0, 0, input.numel()));
          Tensor after = error_of(bi);
          if (!after.defined()) fail(fmt::format("step {}: bucket {} has no error state", s, bi));
          after = after.narrow(0, 0, input.numel());
          Tensor lhs = sum_over_ranks(*group, input);
          Tensor rhs = td::ops::add(td::ops::mul(result, world), sum_over_ranks(*group, after));
          const double d = rel_diff(rhs, lhs);
          if (!(d <= 1e-5))
            fail(fmt::format("step {} bucket {} (batched {}): lost rel {:.3g} of the gradient", s, bi, batched, d));
        }
      }
      opt.step();
    }
    if (batched) {
      bool threw = false;
      try {
        state->state_dict();
      } catch (const td::ValueError&) {
        threw = true;
      }
      if (!threw) fail("state_dict after batched_powerSGD_hook (per-bucket state) did not throw");
    }
  }
}

// powerSGD_hook keeps its state per parameter, so state_dict carries it into a fresh DDP, whose
// first iteration runs the initial layout and then rebuilds it: 3 steps, state_dict, a new model
// with those weights, a new DDP and a state loaded from the dict, 3 more steps = 6 steps without a
// break, bit for bit, on every rank (rank 1, error feedback and warm start on from step 2; one
// parameter per bucket, and w3 registered first, so the layout does change at the rebuild).
// Without the loaded state (a fresh Q, no error) the continuation differs.
TEST(DDPPowerSGD, StateDictCarriesIntoAFreshDDPBitwise) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    const DDPOptions tiny{.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6};
    const PowerSGDOptions o{.start_powerSGD_iter = 2};
    const auto train = [&](Net& model, DistributedDataParallel& ddp, int from, int to) {
      td::optim::SGD opt(model.parameters(), {.lr = 0.1});
      for (int s = from; s < to; ++s) {
        opt.zero_grad();
        loss_of(ddp(batch(s, rank)), target(s, rank)).backward();
        opt.step();
      }
    };
    const auto copy_weights = [](const Net& from, Net& to) {
      td::NoGradGuard no_grad;
      auto src = from.parameters(), dst = to.parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    };

    auto straight = std::make_shared<Net>(true);
    DistributedDataParallel ddp_straight(straight, group, tiny);
    ddp_straight.register_comm_hook(td::parallel::powerSGD_hook(std::make_shared<PowerSGDState>(o)));
    train(*straight, ddp_straight, 0, 6);

    auto first = std::make_shared<Net>(true);
    PowerSGDState::Dict saved;
    std::vector<std::vector<int64_t>> rebuilt;
    {
      DistributedDataParallel ddp(first, group, tiny);
      auto state = std::make_shared<PowerSGDState>(o);
      ddp.register_comm_hook(td::parallel::powerSGD_hook(state));
      train(*first, ddp, 0, 3);
      saved = state->state_dict();
      rebuilt = ddp.reducer().bucket_indices();
    }
    if (saved.iter != 3 || saved.q.size() != 3 || saved.error.size() != 5) {
      fail(fmt::format("state_dict: iter {}, {} Qs, {} errors (want 3, 3 matrices, 5 parameters)", saved.iter,
                       saved.q.size(), saved.error.size()));
    }
    for (bool load : {true, false}) {
      auto resumed = std::make_shared<Net>(true);
      copy_weights(*first, *resumed);
      DistributedDataParallel ddp(resumed, group, tiny);
      if (ddp.reducer().bucket_indices() == rebuilt) fail("the fresh DDP starts with the rebuilt layout: nothing tested");
      auto state = std::make_shared<PowerSGDState>(o);
      if (load) {
        state->load_state_dict(saved);
      } else {
        state->load_state_dict({.iter = saved.iter});  // the counter alone: compressing, but from scratch
      }
      ddp.register_comm_hook(td::parallel::powerSGD_hook(state));
      train(*resumed, ddp, 3, 6);
      bool same = true;
      auto a = resumed->parameters(), b = straight->parameters();
      for (size_t i = 0; i < a.size(); ++i) same = same && bitwise_equal(a[i], b[i]);
      if (same != load) {
        fail(load ? "resumed from state_dict: the weights differ from the uninterrupted run's"
                  : "resumed without the state: the same weights, so the state was not used");
      }
    }
  });
}

TEST(DDPPowerSGD, RankOneWithErrorFeedbackLosesNothing) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    expect_rank_one_loses_nothing(group, false);
    expect_rank_one_loses_nothing(group, true);
  });
}

TEST(DDPPowerSGD, RejectsOptionsItCannotServe) {
  EXPECT_THROW(PowerSGDState(PowerSGDOptions{.matrix_approximation_rank = 0}), td::ValueError);
  EXPECT_THROW(PowerSGDState(PowerSGDOptions{.start_powerSGD_iter = 1}), td::ValueError);
  EXPECT_THROW(PowerSGDState(PowerSGDOptions{.min_compression_rate = -1}), td::ValueError);
  EXPECT_NO_THROW(PowerSGDState(PowerSGDOptions{.start_powerSGD_iter = 0, .use_error_feedback = false, .warm_start = false}));
  EXPECT_THROW(td::parallel::powerSGD_hook(nullptr), td::ValueError);
  EXPECT_THROW(td::parallel::batched_powerSGD_hook(nullptr), td::ValueError);
}

namespace {
// Whether some two rows of a (rows, cols) f32 matrix are not parallel (sin of their angle above
// 1e-2): the matrix has rank >= 2.
bool rank_at_least_two(const Tensor& m) {
  const Tensor c = m.contiguous();
  const float* a = c.data_ptr<float>();
  const int64_t rows = c.size(0), cols = c.size(1);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = i + 1; j < rows; ++j) {
      double aa = 0, bb = 0, ab = 0;
      for (int64_t k = 0; k < cols; ++k) {
        aa += double(a[i * cols + k]) * a[i * cols + k];
        bb += double(a[j * cols + k]) * a[j * cols + k];
        ab += double(a[i * cols + k]) * a[j * cols + k];
      }
      if (aa > 0 && bb > 0 && aa * bb - ab * ab > 1e-4 * aa * bb) return true;
    }
  }
  return false;
}
bool all_finite(const Tensor& t) {
  const Tensor c = t.contiguous();
  for (int64_t i = 0; i < c.numel(); ++i) {
    if (!std::isfinite(c.data_ptr<float>()[i])) return false;
  }
  return true;
}
}  // namespace

// A warm-start Q keeps what the last step left in it. A column that went to zero -- here step 2's
// gradients are the same single sample on both ranks, so w1's (12x16) is rank 1 and Q's second
// column ends up zero; with the batched hook the whole bucket's gradient is zero at step 2 -- stayed
// zero forever (P = M Q, Q = M^T P), and the approximation kept rank 1 (or 0) for good. Zero
// columns are now redrawn: at step 5, on full-rank data, w1's rank-2 gradient has rank 2 (batched:
// is not zero) and is the same on every rank.
TEST(DDPPowerSGD, AWarmStartQWhoseColumnWentToZeroRecovers) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    for (bool batched : {false, true}) {
      auto model = std::make_shared<Net>();
      DistributedDataParallel ddp(model, group);
      auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{
          .matrix_approximation_rank = 2, .start_powerSGD_iter = 2, .use_error_feedback = false, .warm_start = true});
      ddp.register_comm_hook(make_hook(batched, state));
      for (int s = 0; s < 6; ++s) {
        model->zero_grad();
        if (s == 2) {
          const Tensor loss = loss_of(ddp(batch(s, 0).narrow(0, 0, 1)), target(s, 0).narrow(0, 0, 1));
          (batched ? td::ops::mul(loss, 0.0) : loss).backward();
        } else {
          loss_of(ddp(batch(s, rank)), target(s, rank)).backward();
        }
      }
      const Tensor g = model->w1.grad();
      if (!same_everywhere(*group, g)) fail(fmt::format("batched {}: w1's gradient differs across ranks", batched));
      if (batched ? td::ops::sum(td::ops::mul(g, g)).item<float>() == 0.0f : !rank_at_least_two(g)) {
        fail(fmt::format("batched {}: three full-rank steps after the degenerate one, w1's rank-2 gradient is still "
                         "{}: the warm-start Q kept its zero column(s)",
                         batched, batched ? "zero" : "rank 1"));
      }
    }
  });
}

// A step whose gradients are not finite on some rank (an fp16 loss-scale overflow) used to store
// input - NaN as the error feedback and NaN as the warm-start Q, so every later step was NaN too
// (a GradScaler would skip steps forever). Now that step's compressed gradients are NaN on every
// rank, the state is kept, and the next finite step is finite again.
TEST(DDPPowerSGD, ANonFiniteStepDoesNotPoisonTheErrorFeedbackOrTheWarmStart) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    // The per-matrix hook, the batched one, and the per-matrix one with nothing worth compressing
    // (every gradient goes through the plain all-reduce, whose error feedback is kept too).
    for (int variant = 0; variant < 3; ++variant) {
      const bool batched = variant == 1;
      auto model = std::make_shared<Net>();
      DistributedDataParallel ddp(model, group);
      auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{
          .matrix_approximation_rank = 1, .start_powerSGD_iter = 2, .min_compression_rate = variant == 2 ? 1e9 : 2});
      ddp.register_comm_hook(make_hook(batched, state));
      for (int s = 0; s < 5; ++s) {
        model->zero_grad();
        const Tensor loss = loss_of(ddp(batch(s, rank)), target(s, rank));
        (s == 3 && rank == 0 ? td::ops::mul(loss, std::numeric_limits<float>::infinity()) : loss).backward();
        const bool finite = all_finite(model->w1.grad());
        if (s == 3 && finite) fail(fmt::format("variant {}: the overflowing step gave a finite w1 gradient", variant));
        if (s != 3 && !finite) {
          fail(fmt::format("variant {}: step {} (finite inputs) gave a non-finite w1 gradient{}", variant, s,
                           s == 4 ? ": the state kept the earlier step's NaN" : ""));
        }
      }
    }
  });
}
