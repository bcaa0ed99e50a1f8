// autocast: the guard's scoping and nesting, the policy categories at op entry, backward dtypes,
// the weight cast cache (counted), f16 matmul/conv accuracy, precision "auto".
#include <cmath>
#include <thread>

#include <gtest/gtest.h>

#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;

Tensor param(const Shape& s, uint64_t seed) {
  Generator g(seed);
  Tensor t = randn(s, kFloat32, &g);
  t.requires_grad_(true);
  return t;
}

TEST(Autocast, GuardScopesNestsAndRestores) {
  const Tensor x = randn({4, 8}), w = randn({6, 8});
  EXPECT_FALSE(amp::autocast_active());
  EXPECT_EQ(ops::linear(x, w).dtype(), kFloat32);
  {
    amp::autocast outer(kBFloat16);
    EXPECT_TRUE(amp::autocast_active());
    EXPECT_EQ(ops::linear(x, w).dtype(), kBFloat16);
    {
      amp::autocast off({.enabled = false});
      EXPECT_FALSE(amp::autocast_active());
      EXPECT_EQ(ops::linear(x, w).dtype(), kFloat32);  // f32 again inside
      {
        amp::autocast inner(kFloat16);
        EXPECT_EQ(ops::linear(x, w).dtype(), kFloat16);
      }
      EXPECT_EQ(ops::linear(x, w).dtype(), kFloat32);
    }
    EXPECT_EQ(ops::linear(x, w).dtype(), kBFloat16);
    EXPECT_EQ(amp::get_autocast_dtype(), kBFloat16);
  }
  EXPECT_FALSE(amp::autocast_active());
  EXPECT_FALSE(amp::is_autocast_enabled());
  EXPECT_EQ(ops::linear(x, w).dtype(), kFloat32);
}

TEST(Autocast, ThreadLocal) {
  amp::autocast ac(kBFloat16);
  DType other = kFloat64;
  std::thread t([&] { other = ops::matmul(randn({2, 3}), randn({3, 2})).dtype(); });
  t.join();
  EXPECT_EQ(other, kFloat32);
  EXPECT_EQ(ops::matmul(randn({2, 3}), randn({3, 2})).dtype(), kBFloat16);
}

TEST(Autocast, RejectsBadOptions) {
  EXPECT_THROW(amp::autocast{kFloat64}, DTypeError);
  EXPECT_THROW((amp::autocast{amp::AutocastOptions{.device = Device{DeviceType::cuda, 0}}}), ValueError);
  EXPECT_FALSE(amp::autocast_active());  // a failed guard leaves no state behind
  EXPECT_EQ(amp::parse_precision("bf16"), kBFloat16);
  EXPECT_EQ(amp::parse_precision("f16"), kFloat16);
  EXPECT_EQ(amp::parse_precision("fp32"), kFloat32);
  EXPECT_THROW(amp::parse_precision("fp8"), ValueError);
  const DType a = amp::auto_precision();
  EXPECT_EQ(a, (cpu_features().avx512_bf16 || cpu_features().amx_bf16) ? kBFloat16 : kFloat16);
}

TEST(Autocast, Categories) {
  amp::autocast ac(kBFloat16);
  const Tensor xb = randn({4, 8}).to(kBFloat16), xf = randn({4, 8});
  // lower precision, f32 and f16 inputs alike; f64 is never cast
  EXPECT_EQ(ops::matmul(xf, randn({8, 3})).dtype(), kBFloat16);
  EXPECT_EQ(ops::matmul(randn({4, 8}, kFloat64), randn({8, 3}, kFloat64)).dtype(), kFloat64);
  EXPECT_EQ(ops::conv2d(randn({1, 2, 5, 5}), randn({3, 2, 3, 3})).dtype(), kBFloat16);
  EXPECT_EQ(ops::scaled_dot_product_attention(randn({1, 4, 8}), randn({1, 4, 8}), randn({1, 4, 8}), true).dtype(), kBFloat16);
  // f32: reductions, softmax, norms, losses widen bf16 inputs
  EXPECT_EQ(ops::softmax(xb, 1).dtype(), kFloat32);
  EXPECT_EQ(ops::sum(xb).dtype(), kFloat32);
  EXPECT_EQ(ops::layer_norm(xb, {8}).dtype(), kFloat32);
  EXPECT_EQ(ops::exp(xb).dtype(), kFloat32);
  EXPECT_EQ(ops::cross_entropy(xb, tensor(std::vector<int64_t>{0, 1, 2, 3}, {4})).dtype(), kFloat32);
  // promote: widest input
  EXPECT_EQ(ops::cat({xb, xf}).dtype(), kFloat32);
  EXPECT_EQ(ops::cat({xb, xb}).dtype(), kBFloat16);
  EXPECT_EQ(ops::where(ops::gt(xf, 0.0), xb, xf).dtype(), kFloat32);
  // not in the table: untouched. batch_norm keeps its input's dtype (statistics in f32 inside)
  // and updates its f32 running statistics in place.
  Tensor rm = zeros({3}), rv = ones({3});
  const Tensor bn = ops::batch_norm(randn({4, 3, 5}).to(kBFloat16), rm, rv, ones({3}), zeros({3}), true);
  EXPECT_EQ(bn.dtype(), kBFloat16);
  EXPECT_EQ(rm.dtype(), kFloat32);
  EXPECT_NE(rm.to_vector()[0], 0.0);
  EXPECT_EQ(ops::relu(xb).dtype(), kBFloat16);
  EXPECT_EQ(ops::relu(xf).dtype(), kFloat32);
}

// The values: a bf16 linear under autocast equals the f32 linear of bf16-rounded operands
// (f32 accumulation; one rounding of the output: relative 2^-8), and backward runs in the
// forward's dtypes with the gradient arriving at the f32 parameter as f32.
TEST(Autocast, ValuesAndBackwardDtypes) {
  const Tensor x = randn({16, 32});
  Tensor w = param({8, 32}, 1), b = param({8}, 2);
  Tensor y;
  {
    amp::autocast ac(kBFloat16);
    y = ops::linear(x, w, b);
  }
  ASSERT_EQ(y.dtype(), kBFloat16);
  const Tensor ref = ops::linear(x.to(kBFloat16).to(kFloat32), w.detach().to(kBFloat16).to(kFloat32),
                                 b.detach().to(kBFloat16).to(kFloat32));
  EXPECT_TRUE(all_close(y.to(kFloat32), ref, 1.0 / 128, 1e-3));
  ops::sum(y.to(kFloat32)).backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), kFloat32);
  EXPECT_EQ(b.grad().dtype(), kFloat32);
  // d sum / dW = column sums of x (rounded to bf16 on the way: ones(bf16) @ x(bf16), f32 accumulation)
  const Tensor gw_ref = ops::sum(x.to(kBFloat16).to(kFloat32), {0}).unsqueeze(0).expand({8, 32});
  EXPECT_TRUE(all_close(w.grad(), gw_ref, 1.0 / 64, 1e-2));
  EXPECT_TRUE(all_close(b.grad(), full({8}, 16.0), 0, 0));
}

// Weight cast cache: a parameter used by three ops in one region is cast once; the three
// gradient contributions still reach it; the next region casts again; cache_enabled = false
// casts every time.
TEST(Autocast, WeightCastCacheCastsOncePerRegion) {
  Tensor w = param({8, 8}, 3);
  const Tensor x = randn({4, 8});
  auto forward = [&] { return ops::linear(ops::linear(ops::linear(x, w), w), w); };
  amp::reset_cast_stats();
  Tensor y;
  {
    amp::autocast ac(kBFloat16);
    y = forward();
    const amp::CastStats s = amp::cast_stats();
    EXPECT_EQ(s.casts, 2);       // w once, x once (x is not a parameter: never cached)
    EXPECT_EQ(s.cache_hits, 2);  // the second and third use of w
    EXPECT_EQ(s.cache_size, 1);
    {
      amp::autocast nested(kBFloat16);  // nested regions share the outer cache
      ops::linear(x, w);
      EXPECT_EQ(amp::cast_stats().cache_hits, 3);
    }
    EXPECT_EQ(amp::cast_stats().cache_size, 1);  // not freed by the inner guard
  }
  EXPECT_EQ(amp::cast_stats().cache_size, 0);  // freed by the outermost guard
  ops::sum(y.to(kFloat32)).backward();
  const Tensor g_cached = w.grad().clone();
  // The same without the cache: the same gradient up to where the three contributions are
  // summed: with the cache they meet at the one bf16 cast and are summed in bf16 (as in
  // PyTorch), without it each is widened first and summed in f32. Sums of 3 terms of similar
  // size: within 2 bf16 roundings (2 * 2^-8 relative) of the larger terms.
  w.set_grad(Tensor());
  amp::reset_cast_stats();
  {
    amp::autocast ac({.dtype = kBFloat16, .cache_enabled = false});
    y = forward();
    EXPECT_EQ(amp::cast_stats().casts, 4);
    EXPECT_EQ(amp::cast_stats().cache_hits, 0);
  }
  ops::sum(y.to(kFloat32)).backward();
  EXPECT_TRUE(all_close(w.grad(), g_cached, 2.0 / 256, 0.05));
  EXPECT_FALSE(all_close(w.grad(), zeros({8, 8}), 0, 1e-3));
  // A new region casts again (the parameter may have changed in between).
  amp::reset_cast_stats();
  {
    amp::autocast ac(kBFloat16);
    forward();
  }
  EXPECT_EQ(amp::cast_stats().casts, 2);
  // Under no_grad nothing is cached (a cast without a graph must not serve a later grad use).
  amp::reset_cast_stats();
  {
    amp::autocast ac(kBFloat16);
    {
      NoGradGuard ng;
      forward();
    }
    EXPECT_EQ(amp::cast_stats().cache_size, 0);
  }
}

// STYLE.md's training step calls backward inside the autocast scope. The gradients must be the
// ones a backward outside the scope gives (backward runs in the dtypes the forward chose).
TEST(Autocast, BackwardInsideTheRegionEqualsOutside) {
  const Tensor x = randn({16, 12});
  const Tensor y = randint(0, 5, {16});
  Tensor w1 = param({20, 12}, 5), b1 = param({20}, 6), w2 = param({5, 20}, 7);
  auto loss_fn = [&] {
    const Tensor h = ops::layer_norm(ops::relu(ops::linear(x, w1, b1)), {20});
    return ops::cross_entropy(ops::matmul(h, w2.t()), y);
  };
  {
    amp::autocast ac(kBFloat16);
    loss_fn().backward();
  }
  const Tensor g1 = w1.grad().clone(), gb = b1.grad().clone(), g2 = w2.grad().clone();
  EXPECT_EQ(g1.dtype(), kFloat32);
  for (Tensor* t : {&w1, &b1, &w2}) t->set_grad(Tensor());
  Tensor loss;
  {
    amp::autocast ac(kBFloat16);
    loss = loss_fn();
  }
  loss.backward();
  EXPECT_TRUE(all_close(w1.grad(), g1, 0, 0));
  EXPECT_TRUE(all_close(b1.grad(), gb, 0, 0));
  EXPECT_TRUE(all_close(w2.grad(), g2, 0, 0));
}

// Two forward/backward passes inside one autocast region (gradient accumulation under one guard):
// the first backward released the cached weight cast's node, and the second pass reused the cached
// tensor and failed with "backward through the graph a second time". The second pass casts anew
// and the gradients equal two passes in separate regions, bitwise.
TEST(Autocast, TwoBackwardsInOneRegionEqualTwoRegions) {
  const Tensor x = randn({16, 12});
  const Tensor y = randint(0, 5, {16});
  Tensor w1 = param({20, 12}, 5), w2 = param({5, 20}, 7);
  auto loss_fn = [&] { return ops::cross_entropy(ops::matmul(ops::relu(ops::linear(x, w1)), w2.t()), y); };
  {
    amp::autocast ac(kBFloat16);
    for (int i = 0; i < 2; ++i) loss_fn().backward();
  }
  const Tensor g1 = w1.grad().clone(), g2 = w2.grad().clone();
  for (Tensor* t : {&w1, &w2}) t->set_grad(Tensor());
  for (int i = 0; i < 2; ++i) {
    amp::autocast ac(kBFloat16);
    loss_fn().backward();
  }
  EXPECT_TRUE(all_close(w1.grad(), g1, 0, 0));
  EXPECT_TRUE(all_close(w2.grad(), g2, 0, 0));
}

TEST(Autocast, OffCostsNoCasts) {
  amp::reset_cast_stats();
  ops::linear(randn({4, 8}), param({2, 8}, 4));
  EXPECT_EQ(amp::cast_stats().casts, 0);
}

// f16 matmul and conv on this CPU (no oneDNN f16 path): exact widening, f32 accumulation, one
// rounding. Compared with an f64 computation on the same f16-rounded inputs: error <= one f16
// rounding of the output (2^-11 relative) plus f32 accumulation (K * 2^-24, negligible).
TEST(Autocast, F16MatmulAndConvAccurate) {
  const Tensor a = randn({33, 70}).to(kFloat16), b = randn({70, 19}).to(kFloat16);
  Tensor y;
  {
    amp::autocast ac(kFloat16);
    y = ops::matmul(a, b);
  }
  ASSERT_EQ(y.dtype(), kFloat16);
  const Tensor ref = ops::matmul(a.to(kFloat64), b.to(kFloat64));
  EXPECT_TRUE(all_close(y.to(kFloat64), ref, 1.0 / 2048, 1e-3));
  const Tensor x = randn({2, 3, 9, 9}).to(kFloat16), k = randn({4, 3, 3, 3}).to(kFloat16);
  Tensor c;
  {
    amp::autocast ac(kFloat16);
    c = ops::conv2d(x, k, Tensor(), {.padding = {1, 1}});
  }
  ASSERT_EQ(c.dtype(), kFloat16);
  const Tensor cref = ops::conv2d(x.to(kFloat64), k.to(kFloat64), Tensor(), {.padding = {1, 1}});
  EXPECT_TRUE(all_close(c.to(kFloat64), cref, 1.0 / 2048, 1e-3));
}

}  // namespace
}  // namespace tandem
