// Convolution, pooling, normalisation, attention and selection ops (issue #4):
//  * f64 finite-difference gradchecks of every op and option (tests/util gradcheck);
//  * f32 conv2d (oneDNN) against the f64 loops on the same values, within the f32 accumulation
//    bound; bf16 conv2d / attention / layer_norm / batch_norm against f32 within bf16's rounding;
//  * the fused attention against its composed reference;
//  * memory layout (conv outputs channels-last, kept through relu), batch_norm running stats;
//  * bad inputs throw the right tandem error naming the values.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/ops_test_util.h"
#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;
using testing::leaf;
using testing::within;
using testing::AttentionBounds;
using testing::attention_bf16_bounds;
using V = std::vector<Tensor>;

constexpr double kU32 = 0x1p-24;  // f32 unit roundoff
constexpr double kUBf16 = 0x1p-8;  // bf16 unit roundoff (8 significant bits)

// Expects `stmt` to throw exactly ErrType (or a subclass) whose message contains every needle.
#define EXPECT_THROW_WITH(stmt, ErrType, ...)                                                     \
  do {                                                                                            \
    bool thrown_ = false;                                                                         \
    try {                                                                                         \
      (void)(stmt);                                                                               \
    } catch (const ::tandem::ErrType& e_) {                                                       \
      thrown_ = true;                                                                             \
      for (const std::string& needle_ : std::vector<std::string> __VA_ARGS__)                     \
        EXPECT_NE(std::string(e_.what()).find(needle_), std::string::npos)                       \
            << #stmt ": message \"" << e_.what() << "\" lacks \"" << needle_ << "\"";             \
    } catch (const std::exception& e_) {                                                          \
      thrown_ = true;                                                                             \
      ADD_FAILURE() << #stmt " threw the wrong type (wanted " #ErrType "): " << e_.what();        \
    }                                                                                             \
    if (!thrown_) ADD_FAILURE() << #stmt " did not throw " #ErrType;                              \
  } while (0)

// Finite differences in f64 with eps 1e-6 are accurate to ~1e-9 here (truncation eps^2 f''' ~
// 1e-12, cancellation u |f| / eps ~ 1e-9 for |f| ~ 10), so the checks use rtol 1e-5 and atol
// 1e-7 rather than the helper's defaults (1e-3 / 1e-5): a gradient off by 0.1% fails.
::testing::AssertionResult tight_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                           const std::vector<Tensor>& inputs) {
  return testing::gradcheck(fn, inputs, {.eps = 1e-6, .atol = 1e-7, .rtol = 1e-5});
}

// An f64 leaf whose elements are a random permutation of {0, 1, ..., n-1} * 0.05 - 1: distinct
// values 0.05 apart, so no max_pool2d window has a tie and a finite-difference step (1e-6)
// cannot change which element is the maximum.
Tensor distinct_leaf(const Shape& shape, uint64_t seed) {
  const int64_t n = shape_numel(shape);
  std::vector<double> keys = leaf({n}, 0, 1, seed).detach().to_vector();
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[order[i]] = static_cast<double>(i) * 0.05 - 1.0;
  Tensor t = tensor(values, shape, kFloat64);
  t.requires_grad_(true);
  return t;
}

// The same values in channels-last memory order (still differentiable with respect to x).
Tensor channels_last(const Tensor& x) { return x.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2}); }

Shape channels_last_strides(const Shape& s) { return {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]}; }

Tensor bool_tensor(const std::vector<bool>& values, const Shape& shape) {
  Tensor t = empty(shape, kBool);
  bool* p = t.data_ptr<bool>();
  for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}

// ============================================================================ f64 gradchecks

TEST(ConvGradcheck, StridePaddingDilationGroupsBias) {
  struct Cfg {
    const char* name;
    ops::Conv2dOptions o;
    int64_t C, O;
    std::array<int64_t, 2> k;
    bool bias;
  };
  const std::vector<Cfg> cfgs = {
      {"plain+bias", {}, 3, 4, {3, 3}, true},
      {"plain nobias", {}, 3, 4, {3, 3}, false},
      {"stride2 pad1 bias", {.stride = {2, 2}, .padding = {1, 1}}, 3, 4, {3, 3}, true},
      {"asym stride/pad/dilation nobias", {.stride = {2, 1}, .padding = {1, 2}, .dilation = {2, 1}}, 2, 3, {3, 2}, false},
      {"dilation2 pad2 bias", {.padding = {2, 2}, .dilation = {2, 2}}, 2, 2, {3, 3}, true},
      {"groups2 bias", {.padding = {1, 0}, .groups = 2}, 4, 6, {3, 3}, true},
      {"depthwise stride2 pad1 nobias", {.stride = {2, 2}, .padding = {1, 1}, .groups = 4}, 4, 8, {3, 3}, false},
      {"1x1 groups2 stride2", {.stride = {2, 2}, .groups = 2}, 4, 2, {1, 1}, true},
  };
  uint64_t seed = 100;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE(c.name);
    const Tensor x = leaf({2, c.C, 6, 5}, -1, 1, seed++);
    const Tensor w = leaf({c.O, c.C / c.o.groups, c.k[0], c.k[1]}, -1, 1, seed++);
    V in{x, w};
    if (c.bias) in.push_back(leaf({c.O}, -1, 1, seed++));
    const ops::Conv2dOptions o = c.o;
    EXPECT_TRUE(tight_gradcheck([o](const V& v) { return ops::conv2d(v[0], v[1], v.size() > 2 ? v[2] : Tensor(), o); }, in));
  }
}

TEST(PoolGradcheck, MaxPool) {
  struct Cfg {
    const char* name;
    ops::Pool2dOptions o;
    Shape shape;
  };
  const std::vector<Cfg> cfgs = {
      {"k2 default stride", {.kernel_size = {2, 2}}, {2, 2, 6, 5}},
      {"k3 s2 p1", {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, {2, 2, 7, 6}},
      {"k(3,2) s(2,1) p(1,0) dil(1,2)",
       {.kernel_size = {3, 2}, .stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}}, {1, 3, 7, 7}},
      {"k3 s2 ceil", {.kernel_size = {3, 3}, .stride = {2, 2}, .ceil_mode = true}, {1, 2, 8, 6}},
      {"k3 s2 p1 dil2 ceil", {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .dilation = {2, 2}, .ceil_mode = true},
       {2, 1, 8, 9}},
  };
  uint64_t seed = 200;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE(c.name);
    const ops::Pool2dOptions o = c.o;
    EXPECT_TRUE(tight_gradcheck([o](const V& v) { return ops::max_pool2d(v[0], o); }, {distinct_leaf(c.shape, seed++)}));
  }
  // ceil_mode really adds the partial window: 8 rows, k3 s2 -> 3 without, 4 with.
  const Tensor x = distinct_leaf({1, 1, 8, 8}, 1);
  EXPECT_EQ(ops::max_pool2d(x, {.kernel_size = {3, 3}, .stride = {2, 2}}).shape(), (Shape{1, 1, 3, 3}));
  EXPECT_EQ(ops::max_pool2d(x, {.kernel_size = {3, 3}, .stride = {2, 2}, .ceil_mode = true}).shape(), (Shape{1, 1, 4, 4}));
}

TEST(PoolGradcheck, AvgPool) {
  uint64_t seed = 300;
  for (bool include_pad : {true, false}) {
    for (bool ceil : {false, true}) {
      SCOPED_TRACE(fmt::format("count_include_pad={} ceil_mode={}", include_pad, ceil));
      const std::vector<ops::Pool2dOptions> opts = {
          {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = ceil, .count_include_pad = include_pad},
          {.kernel_size = {2, 3}, .stride = {1, 2}, .padding = {1, 1}, .ceil_mode = ceil, .count_include_pad = include_pad},
          {.kernel_size = {2, 2}, .ceil_mode = ceil, .count_include_pad = include_pad},
      };
      for (const auto& o : opts)
        EXPECT_TRUE(tight_gradcheck([o](const V& v) { return ops::avg_pool2d(v[0], o); }, {leaf({2, 2, 7, 6}, -1, 1, seed++)}));
    }
  }
  // The divisor of a corner window with padding: count_include_pad counts the 9 padded
  // positions, otherwise only the 4 real ones.
  const Tensor ones4 = ones({1, 1, 4, 4}, kFloat64);
  const ops::Pool2dOptions o{.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  EXPECT_NEAR(ops::avg_pool2d(ones4, o).to_vector()[0], 4.0 / 9.0, 1e-15);
  ops::Pool2dOptions o2 = o;
  o2.count_include_pad = false;
  EXPECT_NEAR(ops::avg_pool2d(ones4, o2).to_vector()[0], 1.0, 1e-15);
}

TEST(PoolGradcheck, AdaptiveAvgPoolNonDivisible) {
  uint64_t seed = 400;
  const std::vector<std::pair<Shape, std::array<int64_t, 2>>> cases = {
      {{2, 2, 7, 5}, {3, 2}}, {{1, 3, 5, 7}, {4, 4}}, {{2, 2, 6, 6}, {4, 5}}, {{1, 2, 5, 3}, {1, 1}}, {{1, 1, 3, 4}, {3, 4}}};
  for (const auto& [shape, out] : cases) {
    SCOPED_TRACE(shape_str(shape) + " -> " + std::to_string(out[0]) + "x" + std::to_string(out[1]));
    const auto o = out;
    EXPECT_TRUE(tight_gradcheck([o](const V& v) { return ops::adaptive_avg_pool2d(v[0], o); }, {leaf(shape, -1, 1, seed++)}));
  }
  // Overlapping bins: 7 -> 3 uses rows [0,3), [2,5), [4,7).
  std::vector<double> rows(7);
  std::iota(rows.begin(), rows.end(), 0.0);
  const Tensor x = tensor(rows, {1, 1, 7, 1}, kFloat64);
  const std::vector<double> y = ops::adaptive_avg_pool2d(x, {3, 1}).to_vector();
  EXPECT_EQ(y, (std::vector<double>{1.0, 3.0, 5.0}));
}

TEST(NormGradcheck, BatchNormTrainingAndEval) {
  const Tensor x = leaf({3, 4, 3, 2}, -1, 2, 500);
  const Tensor w = leaf({4}, 0.5, 1.5, 501), b = leaf({4}, -1, 1, 502);
  for (bool cl : {false, true}) {
    SCOPED_TRACE(cl ? "channels-last input" : "NCHW input");
    auto in = [cl](const Tensor& t) { return cl ? channels_last(t) : t; };
    // Training, batch statistics, with and without affine, and with running stats updated on the
    // side (fresh ones for every call, so each finite-difference evaluation is the same function).
    EXPECT_TRUE(tight_gradcheck([in](const V& v) { return ops::batch_norm(in(v[0]), {}, {}, v[1], v[2], true); }, {x, w, b}));
    EXPECT_TRUE(tight_gradcheck([in](const V& v) { return ops::batch_norm(in(v[0]), {}, {}, {}, {}, true, 0.1, 1e-3); }, {x}));
    EXPECT_TRUE(tight_gradcheck(
        [in](const V& v) {
          Tensor rm = zeros({4}, kFloat64), rv = ones({4}, kFloat64);
          return ops::batch_norm(in(v[0]), rm, rv, v[1], v[2], true, 0.3);
        },
        {x, w, b}));
    // Eval: normalised with the running stats (constants).
    const Tensor rm = tensor(std::vector<double>{0.1, -0.2, 0.3, 0.0}, {4}, kFloat64);
    const Tensor rv = tensor(std::vector<double>{0.5, 1.5, 2.0, 0.8}, {4}, kFloat64);
    EXPECT_TRUE(tight_gradcheck([in, rm, rv](const V& v) { return ops::batch_norm(in(v[0]), rm, rv, v[1], v[2], false); }, {x, w, b}));
    // A channels-last input gives a channels-last output.
    if (cl) {
      const Tensor y = ops::batch_norm(channels_last(x.detach()), {}, {}, w.detach(), b.detach(), true);
      EXPECT_EQ(y.strides(), channels_last_strides(y.shape()));
    }
  }
  // (N, C) and (N, C, L) inputs.
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::batch_norm(v[0], {}, {}, v[1], v[2], true); },
                        {leaf({5, 4}, -1, 1, 503), w, b}));
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::batch_norm(v[0], {}, {}, v[1], v[2], true); },
                        {leaf({3, 4, 5}, -1, 1, 504), w, b}));
}

// batch_norm_relu (the fused [BatchNorm2d, ReLU] of the W2 blocks): f64 gradcheck in training
// and eval, both layouts; and equal to relu(batch_norm(x)) forward and backward. The fused op runs
// the same float arithmetic and masks with the same output, so f32 and bf16 agree bitwise.
TEST(NormGradcheck, BatchNormReluFusedEqualsComposed) {
  const Tensor x = leaf({3, 4, 3, 2}, -1, 2, 560);
  const Tensor w = leaf({4}, 0.5, 1.5, 561), b = leaf({4}, -1, 1, 562);
  const Tensor rm = tensor(std::vector<double>{0.1, -0.2, 0.3, 0.0}, {4}, kFloat64);
  const Tensor rv = tensor(std::vector<double>{0.5, 1.5, 2.0, 0.8}, {4}, kFloat64);
  for (bool cl : {false, true}) {
    SCOPED_TRACE(cl ? "channels-last input" : "NCHW input");
    auto in = [cl](const Tensor& t) { return cl ? channels_last(t) : t; };
    EXPECT_TRUE(tight_gradcheck([in](const V& v) { return ops::batch_norm_relu(in(v[0]), {}, {}, v[1], v[2], true); }, {x, w, b}));
    EXPECT_TRUE(tight_gradcheck([in, rm, rv](const V& v) { return ops::batch_norm_relu(in(v[0]), rm, rv, v[1], v[2], false); },
                                {x, w, b}));
  }
  for (DType dt : {kFloat32, kBFloat16}) {
    for (bool cl : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (cl ? " channels-last" : " NCHW"));
      const Tensor x0 = leaf({4, 16, 5, 6}, -2, 3, 570, dt).detach();
      const Tensor xi = cl ? channels_last(x0) : x0;
      Tensor xa = xi.detach(), xb = xi.detach();
      xa.requires_grad_(true);
      xb.requires_grad_(true);
      const Tensor wa = leaf({16}, 0.5, 1.5, 571, kFloat32), ba = leaf({16}, -1, 1, 572, kFloat32);
      Tensor wb = wa.detach().clone(), bb = ba.detach().clone();
      wb.requires_grad_(true);
      bb.requires_grad_(true);
      Tensor rma = zeros({16}), rva = ones({16}), rmb = zeros({16}), rvb = ones({16});
      const Tensor ya = ops::batch_norm_relu(xa, rma, rva, wa, ba, true);
      const Tensor yb = ops::relu(ops::batch_norm(xb, rmb, rvb, wb, bb, true));
      EXPECT_EQ(ya.strides(), yb.strides());
      EXPECT_TRUE(all_close(ya, yb, 0, 0)) << "forward";
      EXPECT_TRUE(all_close(rma, rmb, 0, 0) && all_close(rva, rvb, 0, 0)) << "running stats";
      const Tensor gy = leaf(ya.shape(), -1, 1, 573, dt).detach();
      const V ga = autograd::grad({ops::sum(ops::mul(ya.to(kFloat32), gy.to(kFloat32)))}, {xa, wa, ba});
      const V gb = autograd::grad({ops::sum(ops::mul(yb.to(kFloat32), gy.to(kFloat32)))}, {xb, wb, bb});
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_close(ga[i], gb[i], 0, 0)) << "gradient " << i;
    }
  }
}

// The global average pool (adaptive_avg_pool2d to 1 x 1, the W2 "mean over H, W"): reads a
// channels-last input in place and returns its gradient channels-last; values as mean((2, 3))
// (f32: a 30-term f32 sum, rel 1e-6), f64 gradcheck in both layouts.
TEST(PoolGradcheck, GlobalAvgPoolKeepsChannelsLast) {
  for (bool cl : {false, true}) {
    SCOPED_TRACE(cl ? "channels-last" : "NCHW");
    auto in = [cl](const Tensor& t) { return cl ? channels_last(t) : t; };
    EXPECT_TRUE(tight_gradcheck([in](const V& v) { return ops::adaptive_avg_pool2d(in(v[0]), {1, 1}); },
                                {leaf({2, 5, 3, 4}, -1, 1, 580)}));
    for (DType dt : {kFloat32, kBFloat16}) {
      Tensor x = in(leaf({3, 8, 5, 6}, -1, 1, 581, dt).detach());
      x.requires_grad_(true);
      const Tensor y = ops::adaptive_avg_pool2d(x, {1, 1});
      EXPECT_EQ(y.shape(), (Shape{3, 8, 1, 1}));
      EXPECT_EQ(y.dtype(), dt);
      const Tensor ref = ops::mean(x.detach().to(kFloat32), {2, 3}, true);
      EXPECT_TRUE(all_close(y.to(kFloat32), ref, dt == kBFloat16 ? kUBf16 : 1e-6, 0));
      const Tensor gx = autograd::grad({ops::sum(y.to(kFloat32))}, {x})[0];
      EXPECT_EQ(gx.strides(), x.strides());
      EXPECT_TRUE(all_close(gx.to(kFloat32), full(x.shape(), 1.0 / 30.0), dt == kBFloat16 ? kUBf16 : 1e-7, 0));
    }
  }
}

TEST(NormGradcheck, LayerNormOneAndTwoDims) {
  const Tensor x = leaf({2, 3, 5}, -1, 2, 510);
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::layer_norm(v[0], {5}, v[1], v[2]); },
                        {x, leaf({5}, 0.5, 1.5, 511), leaf({5}, -1, 1, 512)}));
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::layer_norm(v[0], {3, 5}, v[1], v[2], 1e-3); },
                        {x, leaf({3, 5}, 0.5, 1.5, 513), leaf({3, 5}, -1, 1, 514)}));
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::layer_norm(v[0], {5}); }, {x}));
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::layer_norm(v[0], {2, 3, 5}, v[1]); }, {x, leaf({2, 3, 5}, 0.5, 1.5, 515)}));
}

TEST(NormGradcheck, GroupNorm) {
  const Tensor x = leaf({2, 6, 3, 2}, -1, 2, 520);
  const Tensor w = leaf({6}, 0.5, 1.5, 521), b = leaf({6}, -1, 1, 522);
  for (int64_t groups : {1, 2, 3, 6}) {
    SCOPED_TRACE(fmt::format("groups={}", groups));
    EXPECT_TRUE(tight_gradcheck([groups](const V& v) { return ops::group_norm(v[0], groups, v[1], v[2]); }, {x, w, b}));
  }
  EXPECT_TRUE(tight_gradcheck([](const V& v) { return ops::group_norm(v[0], 2); }, {leaf({3, 4, 5}, -1, 1, 523)}));
}

TEST(AttentionGradcheck, CausalNonCausalCrossAndScale) {
  struct Cfg {
    const char* name;
    Shape q, k, v;
    bool causal;
    std::optional<double> scale;
  };
  const std::vector<Cfg> cfgs = {
      {"self", {2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 6}, false, std::nullopt},
      {"self causal", {2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 6}, true, std::nullopt},
      {"T<S", {2, 3, 4}, {2, 6, 4}, {2, 6, 3}, false, std::nullopt},
      {"T<S causal", {2, 3, 4}, {2, 6, 4}, {2, 6, 3}, true, std::nullopt},
      {"T>S causal", {2, 6, 4}, {2, 3, 4}, {2, 3, 5}, true, std::nullopt},
      {"custom scale", {1, 2, 4, 3}, {1, 2, 5, 3}, {1, 2, 5, 2}, false, 0.7},
      {"custom scale causal", {1, 2, 4, 3}, {1, 2, 5, 3}, {1, 2, 5, 2}, true, 1.9},
  };
  uint64_t seed = 600;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE(c.name);
    const bool causal = c.causal;
    const auto scale = c.scale;
    const V in{leaf(c.q, -1.5, 1.5, seed++), leaf(c.k, -1.5, 1.5, seed++), leaf(c.v, -1, 1, seed++)};
    EXPECT_TRUE(tight_gradcheck([=](const V& v) { return ops::scaled_dot_product_attention(v[0], v[1], v[2], causal, scale); }, in));
    // The fused kernel equals the composed reference, values and gradients (f64: 1e-12).
    EXPECT_TRUE(all_close(ops::scaled_dot_product_attention(in[0], in[1], in[2], causal, scale),
                          ops::scaled_dot_product_attention_reference(in[0], in[1], in[2], causal, scale), 1e-12, 1e-12));
  }
}

TEST(SelectGradcheck, WhereMaskedFillTrilTriu) {
  const Tensor cond = bool_tensor({true, false, false, true, true, false, true, false, false, false, true, true}, {3, 4});
  const Tensor a = leaf({3, 4}, -1, 1, 700), b = leaf({4}, -1, 1, 701);
  EXPECT_TRUE(tight_gradcheck([cond](const V& v) { return ops::where(cond, v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(tight_gradcheck([cond](const V& v) { return ops::where(cond, v[1], v[0]); }, {a, b}));
  // A broadcast condition (4,) against (2, 3, 4) values.
  const Tensor row = bool_tensor({false, true, true, false}, {4});
  EXPECT_TRUE(tight_gradcheck([row](const V& v) { return ops::where(row, v[0], v[1]); }, {leaf({2, 3, 4}, -1, 1, 702), leaf({3, 1}, -1, 1, 703)}));
  {
    const std::vector<double> y = ops::where(cond, a, b).to_vector(), av = a.detach().to_vector(), bv = b.detach().to_vector();
    const std::vector<double> cv = cond.to_vector();
    for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], cv[i] != 0 ? av[i] : bv[i % 4]) << i;
  }
  EXPECT_TRUE(tight_gradcheck([row](const V& v) { return ops::masked_fill(v[0], row, -2.5); }, {a}));
  EXPECT_TRUE(tight_gradcheck([cond](const V& v) { return ops::masked_fill(v[0], cond, 3.0); }, {a}));
  {
    const std::vector<double> y = ops::masked_fill(a, row, -2.5).to_vector(), av = a.detach().to_vector();
    for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], (i % 4 == 1 || i % 4 == 2) ? -2.5 : av[i]) << i;
  }
  const Tensor x = leaf({2, 4, 5}, -1, 1, 704);
  const std::vector<double> xv = x.detach().to_vector();
  for (int64_t d : {-2, -1, 0, 1, 3}) {
    SCOPED_TRACE(fmt::format("diagonal={}", d));
    EXPECT_TRUE(tight_gradcheck([d](const V& v) { return ops::tril(v[0], d); }, {x}));
    EXPECT_TRUE(tight_gradcheck([d](const V& v) { return ops::triu(v[0], d); }, {x}));
    const std::vector<double> lo = ops::tril(x, d).to_vector(), up = ops::triu(x, d).to_vector();
    for (int64_t i = 0; i < 40; ++i) {
      const int64_t r = (i / 5) % 4, c = i % 5;
      EXPECT_EQ(lo[i], c - r <= d ? xv[i] : 0.0) << i;
      EXPECT_EQ(up[i], c - r >= d ? xv[i] : 0.0) << i;
    }
  }
}

// ============================================================================ precision

// f32 conv2d runs on oneDNN, f64 on plain loops. On the same (f32-representable) values the f64
// result is exact to ~1e-16, so the difference is the f32 rounding alone: a sum of n = C/g*KH*KW
// products plus the bias, computed in f32 in any order, is within gamma_n * S of the exact sum,
// gamma_n = n u / (1 - n u) ~ n u, S = sum |x w| + |b| (Higham, Accuracy and Stability, 3.1),
// plus the output's own rounding u |y|. S is computed elementwise as conv2d(|x|, |w|) + |b| in
// f64. The same bound with the backward's lengths holds for the input gradient (O/g*KH*KW terms
// of |gy w|: S_x is the input gradient of sum(conv(|x|,|w|) * |gy|)) and the weight gradient
// (N*OH*OW terms of |gy x|). A wrong index, padding or group mapping is off by O(1).
TEST(ConvPrecision, F32OneDnnMatchesF64Loops) {
  struct Cfg {
    const char* name;
    ops::Conv2dOptions o;
    int64_t C, O, H, W, K;
  };
  const std::vector<Cfg> cfgs = {
      {"3x3 pad1", {.padding = {1, 1}}, 16, 32, 12, 11, 3},
      {"stride2 dilation2 pad2", {.stride = {2, 2}, .padding = {2, 2}, .dilation = {2, 2}}, 8, 16, 13, 14, 3},
      {"groups4 stride(2,1)", {.stride = {2, 1}, .padding = {1, 1}, .groups = 4}, 16, 8, 9, 10, 3},
      {"depthwise 5x5", {.padding = {2, 2}, .groups = 12}, 12, 12, 10, 10, 5},
  };
  uint64_t seed = 800;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE(c.name);
    const int64_t N = 3;
    Tensor x32 = leaf({N, c.C, c.H, c.W}, -1, 1, seed++, kFloat32);
    Tensor w32 = leaf({c.O, c.C / c.o.groups, c.K, c.K}, -1, 1, seed++, kFloat32);
    Tensor b32 = leaf({c.O}, -1, 1, seed++, kFloat32);
    Tensor x64 = x32.detach().to(kFloat64), w64 = w32.detach().to(kFloat64), b64 = b32.detach().to(kFloat64);
    x64.requires_grad_(true), w64.requires_grad_(true), b64.requires_grad_(true);
    const Tensor y32 = ops::conv2d(x32, w32, b32, c.o), y64 = ops::conv2d(x64, w64, b64, c.o);
    ASSERT_EQ(y32.shape(), y64.shape());
    const Tensor gy64 = randn(y64.shape(), kFloat64, nullptr).to(kFloat32).to(kFloat64);  // f32-representable
    const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy64.to(kFloat32)))}, {x32, w32, b32});
    const V g64 = autograd::grad({ops::sum(ops::mul(y64, gy64))}, {x64, w64, b64});
    // The bounds S, from |x|, |w|, |gy|.
    Tensor ax = ops::abs(x64.detach()), aw = ops::abs(w64.detach());
    ax.requires_grad_(true), aw.requires_grad_(true);
    const Tensor s_y = ops::add(ops::conv2d(ax, aw, Tensor(), c.o), ops::abs(b64.detach()).view({1, c.O, 1, 1}));
    const V s_g = autograd::grad({ops::sum(ops::mul(ops::conv2d(ax, aw, Tensor(), c.o), ops::abs(gy64)))}, {ax, aw});
    const int64_t OH = y64.size(2), OW = y64.size(3);
    const double n_y = static_cast<double>(c.C / c.o.groups * c.K * c.K + 1);
    const double n_x = static_cast<double>(c.O / c.o.groups * c.K * c.K);
    const double n_w = static_cast<double>(N * OH * OW);
    auto bound = [](const Tensor& s, const Tensor& ref, double n) {
      const double g = n * kU32 / (1 - n * kU32);
      return ops::add(ops::mul(s, g), ops::mul(ops::abs(ref.detach()), kU32));
    };
    EXPECT_TRUE(within(y32, y64, bound(s_y, y64, n_y))) << "output";
    EXPECT_TRUE(within(g32[0], g64[0], bound(s_g[0], g64[0], n_x))) << "input gradient";
    EXPECT_TRUE(within(g32[1], g64[1], bound(s_g[1], g64[1], n_w))) << "weight gradient";
    // The bias gradient is a sum of N*OH*OW f32 values of gy.
    EXPECT_TRUE(within(g32[2], g64[2], bound(ops::sum(ops::abs(gy64), {0, 2, 3}), g64[2], n_w))) << "bias gradient";
    // The bound is not vacuous: it is far below the size of the values.
    EXPECT_LT(ops::max(bound(s_y, y64, n_y)).item(), 1e-3 * ops::max(ops::abs(y64)).item());
  }
}

// bf16 conv2d gradients against the f64 loops on the same bf16-representable x, w and gy: the
// products are exact in f32, so what remains is the f32 accumulation (gamma_n S, n the sum's
// length, S the sum of |terms|) and one rounding to bf16 at the end (u_bf16 |g|). The weight
// gradient of a bf16 conv with C*KH*KW >= 64 runs as GEMMs over im2col blocks of output pixels
// ("4x16x32x32" has 4096 pixels: more than one block); the 1-channel stem and the grouped and
// depthwise convolutions stay on oneDNN. Once per way bf16 products run here (bf16_products.h).
TEST(ConvPrecision, Bf16GradientsMatchF64WithinAccumulationAndOneRounding) {
  ops_test::for_each_bf16_way([&] {
    struct Cfg {
      const char* name;
      ops::Conv2dOptions o;
      int64_t N, C, O, H, W, K;
    };
    const std::vector<Cfg> cfgs = {
        {"4x16x32x32 3x3 pad1", {.padding = {1, 1}}, 4, 16, 40, 32, 32, 3},
        {"stride2 dilation2 pad2", {.stride = {2, 2}, .padding = {2, 2}, .dilation = {2, 2}}, 3, 32, 32, 13, 14, 3},
        {"stride(2,1) 5x5", {.stride = {2, 1}, .padding = {2, 1}}, 2, 8, 12, 11, 9, 5},
        {"1-channel stem", {.padding = {1, 1}}, 4, 1, 32, 12, 12, 3},
        {"groups4 stride(2,1)", {.stride = {2, 1}, .padding = {1, 1}, .groups = 4}, 3, 16, 8, 9, 10, 3},
        {"depthwise 5x5", {.padding = {2, 2}, .groups = 12}, 2, 12, 12, 10, 10, 5},
    };
    uint64_t seed = 1800;
    for (const Cfg& c : cfgs) {
      SCOPED_TRACE(c.name);
      Tensor x16 = leaf({c.N, c.C, c.H, c.W}, -1, 1, seed++, kBFloat16);
      Tensor w16 = leaf({c.O, c.C / c.o.groups, c.K, c.K}, -1, 1, seed++, kBFloat16);
      Tensor b16 = leaf({c.O}, -1, 1, seed++, kBFloat16);
      Tensor x64 = x16.detach().to(kFloat64), w64 = w16.detach().to(kFloat64), b64 = b16.detach().to(kFloat64);
      x64.requires_grad_(true), w64.requires_grad_(true), b64.requires_grad_(true);
      const Tensor y16 = ops::conv2d(x16, w16, b16, c.o), y64 = ops::conv2d(x64, w64, b64, c.o);
      const Tensor gy16 = randn(y64.shape(), kFloat64, nullptr).to(kBFloat16);
      const Tensor gy64 = gy16.to(kFloat64);
      const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy16.to(kFloat32)))}, {x16, w16, b16});
      const V g64 = autograd::grad({ops::sum(ops::mul(y64, gy64))}, {x64, w64, b64});
      for (const Tensor& g : g16) EXPECT_EQ(g.dtype(), kBFloat16);
      Tensor ax = ops::abs(x64.detach()), aw = ops::abs(w64.detach());
      ax.requires_grad_(true), aw.requires_grad_(true);
      const V s_g = autograd::grad({ops::sum(ops::mul(ops::conv2d(ax, aw, Tensor(), c.o), ops::abs(gy64)))}, {ax, aw});
      const double n_x = static_cast<double>(c.O / c.o.groups * c.K * c.K);
      const double n_w = static_cast<double>(c.N * y64.size(2) * y64.size(3));
      auto bound = [](const Tensor& s, const Tensor& ref, double n) {
        const double g = n * kU32 / (1 - n * kU32);
        return ops::add(ops::mul(s, g), ops::mul(ops::abs(ref.detach()), kUBf16));
      };
      EXPECT_TRUE(within(g16[0].to(kFloat64), g64[0], bound(s_g[0], g64[0], n_x))) << "input gradient";
      EXPECT_TRUE(within(g16[1].to(kFloat64), g64[1], bound(s_g[1], g64[1], n_w))) << "weight gradient";
      EXPECT_TRUE(within(g16[2].to(kFloat64), g64[2], bound(ops::sum(ops::abs(gy64), {0, 2, 3}), g64[2], n_w)))
          << "bias gradient";
      // Not vacuous: the weight-gradient bound is far below the values' size.
      EXPECT_LT(ops::max(bound(s_g[1], g64[1], n_w)).item(), 0.02 * ops::max(ops::abs(g64[1])).item());
    }
  });
}

// bf16 against f32 on the same bf16-representable values (the input rounding is taken out, so
// what remains is the op's own bf16 arithmetic). u = 2^-8 is bf16's unit roundoff: rounding an
// f32 result to bf16 (round-to-nearest-even) moves it by at most u |y| relative.
//  * layer_norm, batch_norm: widen bf16 to f32, compute exactly as the f32 op does (f32
//    accumulation, f32/f64 statistics), round once at the end, so |y16 - y32| <= u |y32|, the
//    tolerance used (atol 0: rounding is relative).
//  * attention: rounds P and dS to bf16 as well (attention_bf16_bounds above).
//  * conv2d: oneDNN's bf16 kernel multiplies bf16 values exactly into f32 accumulators, but
//    in its own order, converts the bias to bf16 (|b| u) and rounds the output (u |y|); the two
//    f32 accumulations differ by at most 2 gamma_n S (S = sum |x w|, n = C*KH*KW, ~1e-5 S).
TEST(LowPrecisionCNA, Bf16MatchesF32WithinOneRounding) {
  ops_test::for_each_bf16_way([&] {
    auto both = [](const Shape& s, double lo, double hi, uint64_t seed) {
      const Tensor b16 = leaf(s, lo, hi, seed, kBFloat16);
      Tensor f32 = b16.detach().to(kFloat32);
      f32.requires_grad_(true);
      return std::pair<Tensor, Tensor>{b16, f32};
    };
    // ---- conv2d ----
    {
      auto [x16, x32] = both({2, 16, 10, 9}, -1, 1, 900);
      auto [w16, w32] = both({24, 16, 3, 3}, -0.5, 0.5, 901);
      auto [b16, b32] = both({24}, -1, 1, 902);
      const ops::Conv2dOptions o{.stride = {1, 2}, .padding = {1, 1}};
      const Tensor y16 = ops::conv2d(x16, w16, b16, o), y32 = ops::conv2d(x32, w32, b32, o);
      EXPECT_EQ(y16.dtype(), kBFloat16);
      const Tensor s = ops::conv2d(ops::abs(x32.detach()), ops::abs(w32.detach()), Tensor(), o);
      const double n = 16 * 9 + 1;
      const Tensor bound = ops::add(ops::add(ops::mul(ops::abs(y32.detach()), kUBf16), ops::mul(s, 2 * n * kU32)),
                                    ops::mul(ops::abs(b32.detach()), kUBf16).view({1, 24, 1, 1}));
      EXPECT_TRUE(within(y16.to(kFloat32), y32, bound)) << "bf16 conv2d";
    }
    // ---- attention, forward and backward ----
    for (bool causal : {false, true}) {
      SCOPED_TRACE(causal ? "causal" : "non-causal");
      auto [q16, q32] = both({2, 3, 17, 16}, -2, 2, 910);
      auto [k16, k32] = both({2, 3, 17, 16}, -2, 2, 911);
      auto [v16, v32] = both({2, 3, 17, 8}, -1, 1, 912);
      const Tensor y16 = ops::scaled_dot_product_attention(q16, k16, v16, causal);
      const Tensor y32 = ops::scaled_dot_product_attention(q32, k32, v32, causal);
      EXPECT_EQ(y16.dtype(), kBFloat16);
      const Tensor gy = randn(y32.shape(), kBFloat16, nullptr);
      const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy.to(kFloat32)))}, {q16, k16, v16});
      const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy.to(kFloat32)))}, {q32, k32, v32});
      const AttentionBounds b = attention_bf16_bounds(q32, k32, v32, gy, causal, y32, g32);
      EXPECT_TRUE(within(y16.to(kFloat32), y32, b.y)) << "attention output";
      const Tensor* bounds[3] = {&b.dq, &b.dk, &b.dv};
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(g16[i].dtype(), kBFloat16);
        EXPECT_TRUE(within(g16[i].to(kFloat32), g32[i], *bounds[i])) << "attention gradient " << i;
      }
    }
    // ---- layer_norm ----
    {
      auto [x16, x32] = both({4, 7, 96}, -3, 3, 920);
      auto [w16, w32] = both({96}, 0.5, 1.5, 921);
      auto [b16, b32] = both({96}, -1, 1, 922);
      const Tensor y16 = ops::layer_norm(x16, {96}, w16, b16), y32 = ops::layer_norm(x32, {96}, w32, b32);
      EXPECT_EQ(y16.dtype(), kBFloat16);
      EXPECT_TRUE(all_close(y16, y32, kUBf16, 0)) << "layer_norm";
    }
    // ---- batch_norm, training and eval, NCHW and channels-last ----
    for (bool cl : {false, true}) {
      SCOPED_TRACE(cl ? "channels-last" : "NCHW");
      auto [x16, x32] = both({4, 24, 7, 6}, -2, 3, 930);
      auto [w16, w32] = both({24}, 0.5, 1.5, 931);
      auto [b16, b32] = both({24}, -1, 1, 932);
      const Tensor xi16 = cl ? channels_last(x16) : x16, xi32 = cl ? channels_last(x32) : x32;
      const Tensor y16 = ops::batch_norm(xi16, {}, {}, w16, b16, true), y32 = ops::batch_norm(xi32, {}, {}, w32, b32, true);
      EXPECT_EQ(y16.dtype(), kBFloat16);
      EXPECT_TRUE(all_close(y16, y32, kUBf16, 0)) << "batch_norm training";
      const Tensor rm = leaf({24}, -0.5, 0.5, 933, kFloat32).detach(), rv = leaf({24}, 0.5, 2, 934, kFloat32).detach();
      const Tensor e16 = ops::batch_norm(xi16, rm, rv, w16, b16, false), e32 = ops::batch_norm(xi32, rm, rv, w32, b32, false);
      EXPECT_TRUE(all_close(e16, e32, kUBf16, 0)) << "batch_norm eval";
    }
  });
}

// bf16 batch_norm (with and without the fused ReLU) is the f32 op on the widened values, rounded
// once: the kernels read bf16 in place and widen it exactly, so forward output, input gradient
// (both rounded to bf16 from the f32 result) and the f32 weight and bias gradients must equal the
// f32 op's bit for bit. Shapes exercise both block kinds: NCHW runs of one channel (C == 1 in the
// kernels, 42- and 300-element planes: a lane tail and a 256-element run boundary) and
// channels-last rows (C = 24 and 40: not multiples of the vector width; 168 and 1200 rows: a
// partial 64-row block). f32 weights, as under autocast.
TEST(LowPrecisionCNA, Bf16BatchNormIsTheF32OpOnWidenedValuesBitForBit) {
  struct Case {
    Shape s;
    bool cl;
  };
  const Case cases[] = {{{4, 24, 7, 6}, false}, {{4, 24, 7, 6}, true}, {{3, 40, 20, 15}, false},
                        {{4, 40, 20, 15}, true}};
  uint64_t seed = 940;
  for (const Case& c : cases) {
    for (bool relu : {false, true}) {
      SCOPED_TRACE(::testing::Message() << shape_str(c.s) << (c.cl ? " channels-last" : " NCHW")
                                        << (relu ? " +relu" : ""));
      const int64_t C = c.s[1];
      const Tensor x16 = leaf(c.s, -2, 3, seed++, kBFloat16).detach();
      const Tensor gy16 = leaf(c.s, -1, 1, seed++, kBFloat16).detach();
      Tensor xi16 = c.cl ? channels_last(x16) : x16.clone();
      Tensor xi32 = c.cl ? channels_last(x16.to(kFloat32)) : x16.to(kFloat32);  // same layout, same sums
      const Tensor gyi = c.cl ? channels_last(gy16) : gy16;
      xi16.requires_grad_(true);
      xi32.requires_grad_(true);
      auto params = [&](uint64_t sd) {
        Tensor w = leaf({C}, 0.5, 1.5, sd, kFloat32).detach(), b = leaf({C}, -1, 1, sd + 1, kFloat32).detach();
        w.requires_grad_(true);
        b.requires_grad_(true);
        return std::pair<Tensor, Tensor>{w, b};
      };
      auto [w16, b16] = params(seed);
      auto [w32, b32] = params(seed);
      seed += 2;
      Tensor rm16 = zeros({C}), rv16 = ones({C}), rm32 = zeros({C}), rv32 = ones({C});
      auto bn = relu ? ops::batch_norm_relu : ops::batch_norm;
      const Tensor y16 = bn(xi16, rm16, rv16, w16, b16, true, 0.1, 1e-5);
      const Tensor y32 = bn(xi32, rm32, rv32, w32, b32, true, 0.1, 1e-5);
      ASSERT_EQ(y16.dtype(), kBFloat16);
      auto same_bits = [](const Tensor& a, const Tensor& b) {
        const Tensor ac = a.contiguous(), bc = b.contiguous();
        return ac.dtype() == bc.dtype() && ac.shape() == bc.shape() &&
               std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
      };
      EXPECT_TRUE(same_bits(y16, y32.to(kBFloat16))) << "forward";
      EXPECT_TRUE(same_bits(rm16, rm32) && same_bits(rv16, rv32)) << "running statistics";
      const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gyi.to(kFloat32)))}, {xi16, w16, b16});
      const V g32 = autograd::grad({ops::sum(ops::mul(y32, gyi.to(kFloat32)))}, {xi32, w32, b32});
      ASSERT_EQ(g16[0].dtype(), kBFloat16);
      EXPECT_TRUE(same_bits(g16[0], g32[0].to(kBFloat16))) << "input gradient";
      EXPECT_TRUE(same_bits(g16[1], g32[1])) << "weight gradient";
      EXPECT_TRUE(same_bits(g16[2], g32[2])) << "bias gradient";
      // Not vacuous: the gradient is not all zeros, and the ReLU clips part of the output.
      EXPECT_GT(ops::max(ops::abs(g32[0])).item(), 0.1);
      if (relu) {
        const std::vector<double> y = y32.to_vector();
        EXPECT_GT(std::count(y.begin(), y.end(), 0.0), static_cast<std::ptrdiff_t>(y.size() / 10));
      }
    }
  }
}

// bf16 attention over several 64-row query tiles (causal tiles skip later keys), keys beyond the
// queries, and a value dim unlike the key dim: within attention_bf16_bounds of f32 on the same
// bf16 values, forward and every gradient.
TEST(LowPrecisionCNA, Bf16AttentionMultiTileWithinRoundingBounds) {
  struct Case {
    Shape q, k, v;
    bool causal;
  };
  const Case cases[] = {{{1, 2, 150, 64}, {1, 2, 150, 64}, {1, 2, 150, 64}, true},
                        {{2, 1, 70, 32}, {2, 1, 130, 32}, {2, 1, 130, 48}, false},
                        {{1, 1, 130, 16}, {1, 1, 200, 16}, {1, 1, 200, 16}, true}};
  uint64_t seed = 960;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.q[2] << " S " << c.k[2] << " causal " << c.causal);
    auto both = [&](const Shape& sh, double lo, double hi) {
      const Tensor b16 = leaf(sh, lo, hi, seed++, kBFloat16);
      Tensor f32 = b16.detach().to(kFloat32);
      f32.requires_grad_(true);
      return std::pair<Tensor, Tensor>{b16, f32};
    };
    auto [q16, q32] = both(c.q, -2, 2);
    auto [k16, k32] = both(c.k, -2, 2);
    auto [v16, v32] = both(c.v, -1, 1);
    const Tensor y16 = ops::scaled_dot_product_attention(q16, k16, v16, c.causal);
    const Tensor y32 = ops::scaled_dot_product_attention(q32, k32, v32, c.causal);
    const Tensor gy = randn(y32.shape(), kBFloat16, nullptr);
    const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy.to(kFloat32)))}, {q16, k16, v16});
    const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy.to(kFloat32)))}, {q32, k32, v32});
    const AttentionBounds b = attention_bf16_bounds(q32, k32, v32, gy, c.causal, y32, g32);
    EXPECT_TRUE(within(y16.to(kFloat32), y32, b.y)) << "output";
    const Tensor* bounds[3] = {&b.dq, &b.dk, &b.dv};
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(within(g16[i].to(kFloat32), g32[i], *bounds[i])) << "gradient " << i;
  }
}

// The fused attention (never materialises T x S) equals softmax(q k^T * scale + mask) v from
// matmul/softmax/masked_fill: f64 to 1e-12, f32 to 1e-5 (f32 rounding of D- and S-long sums of
// O(1) terms, ~1e-6), forward and all three gradients.
TEST(AttentionFused, EqualsComposedReference) {
  struct Cfg {
    Shape q, k, v;
    bool causal;
    std::optional<double> scale;
  };
  const std::vector<Cfg> cfgs = {
      {{2, 4, 33, 16}, {2, 4, 33, 16}, {2, 4, 33, 16}, true, std::nullopt},
      {{2, 4, 33, 16}, {2, 4, 33, 16}, {2, 4, 33, 16}, false, std::nullopt},
      {{3, 20, 8}, {3, 45, 8}, {3, 45, 12}, true, std::nullopt},
      {{3, 45, 8}, {3, 20, 8}, {3, 20, 12}, false, 0.3},
      {{2, 2, 9, 5}, {2, 2, 13, 5}, {2, 2, 13, 7}, true, 1.5},
      // Several 64-row query tiles, D a multiple of 16 and not, more keys than queries: the
      // register tile kernel's full and partial blocks.
      {{1, 2, 130, 64}, {1, 2, 130, 64}, {1, 2, 130, 64}, true, std::nullopt},
      {{1, 3, 70, 20}, {1, 3, 150, 20}, {1, 3, 150, 36}, false, std::nullopt},
  };
  uint64_t seed = 1000;
  for (DType dt : {kFloat64, kFloat32}) {
    const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
    for (const Cfg& c : cfgs) {
      SCOPED_TRACE(fmt::format("{} q{} k{} causal={}", dtype_name(dt), shape_str(c.q), shape_str(c.k), c.causal));
      const Tensor q = leaf(c.q, -2, 2, seed++, dt), k = leaf(c.k, -2, 2, seed++, dt), v = leaf(c.v, -1, 1, seed++, dt);
      const Tensor y = ops::scaled_dot_product_attention(q, k, v, c.causal, c.scale);
      const Tensor r = ops::scaled_dot_product_attention_reference(q, k, v, c.causal, c.scale);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_TRUE(all_close(y, r, tol, tol)) << "output";
      const Tensor gy = randn(y.shape(), dt, nullptr);
      const V gf = autograd::grad({ops::sum(ops::mul(y, gy))}, {q, k, v});
      const V gr = autograd::grad({ops::sum(ops::mul(r, gy))}, {q, k, v});
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_close(gf[i], gr[i], tol, tol)) << "gradient " << i;
    }
  }
  // Causal really masks: with T = S, query row 0 sees only key 0, so its output is v[0].
  const Tensor q = leaf({1, 4, 3}, -1, 1, 1100), k = leaf({1, 4, 3}, -1, 1, 1101), v = leaf({1, 4, 2}, -1, 1, 1102);
  EXPECT_TRUE(all_close(ops::scaled_dot_product_attention(q, k, v, true).select(1, 0), v.detach().select(1, 0), 1e-15, 0));
  EXPECT_FALSE(all_close(ops::scaled_dot_product_attention(q, k, v, false).select(1, 0), v.detach().select(1, 0), 1e-3, 0));
}

// q, k, v as the (B, H, T, D) heads of one fused (B, T, 3*H*D) projection, read in place by the
// kernel, with the gradient of the projection coming back as one buffer (no copy in the split's
// backward) and the output stored (B, T, H, D): f64 gradcheck through the whole chain; f32 and
// f64 equal the composed reference on the same views (tolerances as above); bf16 within the
// rounding bounds of attention_bf16_bounds from f32 on the same bf16 values. Heads viewed from a transposed (strided) buffer, not
// packed, take the same in-place path with their own strides.
TEST(AttentionFused, PackedQkvAndStridedHeads) {
  const int64_t B = 2, T = 19, H = 3, D = 8;
  auto heads = [&](const Tensor& qkv) {
    std::vector<Tensor> p = ops::split(qkv, H * D, 2);
    for (Tensor& t : p) t = t.view({B, T, H, D}).transpose(1, 2);
    return p;
  };
  auto attend = [&](const Tensor& qkv, bool fused) {
    const std::vector<Tensor> p = heads(qkv);
    const Tensor y = fused ? ops::scaled_dot_product_attention(p[0], p[1], p[2], true)
                           : ops::scaled_dot_product_attention_reference(p[0], p[1], p[2], true);
    return y.transpose(1, 2).contiguous().view({B, T, H * D});
  };
  EXPECT_TRUE(tight_gradcheck([&](const V& v) { return attend(v[0], true); },
                              {leaf({B, T, 3 * H * D}, -1, 1, 1150, kFloat64)}));
  for (DType dt : {kFloat64, kFloat32}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
    const Tensor qkv = leaf({B, T, 3 * H * D}, -2, 2, 1151, dt);
    const Tensor y = attend(qkv, true), r = attend(qkv, false);
    EXPECT_TRUE(all_close(y, r, tol, tol)) << "output";
    const std::vector<Tensor> p = heads(qkv.detach());
    EXPECT_EQ(ops::scaled_dot_product_attention(p[0], p[1], p[2], true).transpose(1, 2).strides(),
              contiguous_strides({B, T, H, D}))
        << "output stored (B, T, H, D)";
    const Tensor gy = randn(y.shape(), dt, nullptr);
    const V gf = autograd::grad({ops::sum(ops::mul(y, gy))}, {qkv});
    const V gr = autograd::grad({ops::sum(ops::mul(r, gy))}, {qkv});
    EXPECT_TRUE(all_close(gf[0], gr[0], tol, tol)) << "qkv gradient";
    // Strided, unpacked heads: q, k, v from a (B, 3*H*D, T) buffer viewed transposed.
    const Tensor t_buf = leaf({B, 3 * H * D, T}, -2, 2, 1152, dt);
    const Tensor ys = attend(t_buf.transpose(1, 2), true), rs = attend(t_buf.transpose(1, 2), false);
    EXPECT_TRUE(all_close(ys, rs, tol, tol)) << "strided output";
    const V gs = autograd::grad({ops::sum(ops::mul(ys, gy))}, {t_buf});
    const V grs = autograd::grad({ops::sum(ops::mul(rs, gy))}, {t_buf});
    EXPECT_TRUE(all_close(gs[0], grs[0], tol, tol)) << "strided gradient";
  }
  const Tensor q16 = leaf({B, T, 3 * H * D}, -2, 2, 1153, kBFloat16);
  Tensor q32 = q16.detach().to(kFloat32);
  q32.requires_grad_(true);
  const Tensor y16 = attend(q16, true), y32 = attend(q32, true);
  EXPECT_EQ(y16.dtype(), kBFloat16);
  const Tensor gy = randn(y32.shape(), kBFloat16, nullptr);
  const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy.to(kFloat32)))}, {q16});
  const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy.to(kFloat32)))}, {q32});
  EXPECT_EQ(g16[0].dtype(), kBFloat16);
  // Bounds per head view (attention_bf16_bounds): q, k, v and their gradients as (B, H, T, D).
  const std::vector<Tensor> p32 = heads(q32.detach()), pg16 = heads(g16[0]), pg32 = heads(g32[0]);
  const Tensor gy_heads = gy.view({B, T, H, D}).transpose(1, 2);
  const Tensor y_heads = y32.detach().view({B, T, H, D}).transpose(1, 2);
  const AttentionBounds b = attention_bf16_bounds(p32[0], p32[1], p32[2], gy_heads, true, y_heads, pg32);
  EXPECT_TRUE(within(y16.to(kFloat32).view({B, T, H, D}).transpose(1, 2), y_heads, b.y)) << "bf16 output";
  const Tensor* bounds[3] = {&b.dq, &b.dk, &b.dv};
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(within(pg16[i].to(kFloat32), pg32[i], *bounds[i])) << "bf16 qkv gradient " << i;
}

// ============================================================================ layout and state

TEST(ConvLayout, OutputIsChannelsLastAndReluKeepsIt) {
  for (DType dt : {kFloat32, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = leaf({2, 3, 9, 8}, -1, 1, 1200, dt).detach();  // NCHW-contiguous input
    const Tensor w = leaf({5, 3, 3, 3}, -1, 1, 1201, dt).detach();
    const Tensor y = ops::conv2d(x, w, Tensor(), {.padding = {1, 1}});
    EXPECT_EQ(y.shape(), (Shape{2, 5, 9, 8}));
    EXPECT_EQ(y.strides(), channels_last_strides(y.shape())) << "conv2d output strides";
    EXPECT_FALSE(y.is_contiguous());
    const Tensor r = ops::relu(y);
    EXPECT_EQ(r.strides(), channels_last_strides(r.shape())) << "relu output strides";
    // Same values as relu of the NCHW copy.
    EXPECT_TRUE(all_close(r, ops::relu(y.contiguous()), 0, 0));
    // A channels-last input to the next conv stays channels-last too.
    const Tensor y2 = ops::conv2d(r, leaf({4, 5, 3, 3}, -1, 1, 1202, dt).detach(), Tensor(), {.stride = {2, 2}});
    EXPECT_EQ(y2.strides(), channels_last_strides(y2.shape()));
  }
  // relu of a hand-made channels-last tensor (not from conv) keeps the layout as well.
  const Tensor cl = channels_last(leaf({2, 4, 3, 5}, -1, 1, 1203));
  ASSERT_EQ(cl.strides(), channels_last_strides(cl.shape()));
  EXPECT_EQ(ops::relu(cl).strides(), channels_last_strides(cl.shape()));
}

// Three training steps on different batches from running_mean 0 / running_var 1: each step
// running = (1 - m) running + m stat, with the batch mean and the *unbiased* batch variance
// (sum of squared deviations / (count - 1)), computed here by hand in f64.
TEST(BatchNormState, RunningStatsAfterThreeSteps) {
  for (bool cl : {false, true}) {
    SCOPED_TRACE(cl ? "channels-last" : "NCHW");
    const int64_t N = 3, C = 4, H = 5, W = 2;
    const double m = 0.2;
    Tensor rm = zeros({C}, kFloat32), rv = ones({C}, kFloat32);
    std::vector<double> em(C, 0.0), ev(C, 1.0);
    for (int step = 0; step < 3; ++step) {
      const Tensor x = leaf({N, C, H, W}, -1 + step, 2 + 2 * step, 1300 + step, kFloat32).detach();
      ops::batch_norm(cl ? channels_last(x) : x, rm, rv, Tensor(), Tensor(), true, m);
      const std::vector<double> xv = x.to_vector();
      for (int64_t c = 0; c < C; ++c) {
        double s = 0, ss = 0;
        const int64_t count = N * H * W;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < H * W; ++i) s += xv[(n * C + c) * H * W + i];
        const double mean = s / count;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < H * W; ++i) ss += std::pow(xv[(n * C + c) * H * W + i] - mean, 2);
        em[c] = (1 - m) * em[c] + m * mean;
        ev[c] = (1 - m) * ev[c] + m * ss / (count - 1);
      }
    }
    // f32 buffers: a few f32 roundings of O(1) values.
    EXPECT_TRUE(all_close(rm, tensor(em, {C}, kFloat64), 1e-6, 1e-7)) << rm;
    EXPECT_TRUE(all_close(rv, tensor(ev, {C}, kFloat64), 1e-6, 1e-7)) << rv;
    // Eval mode does not touch them.
    const Tensor before = rv.clone();
    ops::batch_norm(leaf({N, C, H, W}, -1, 1, 1310, kFloat32).detach(), rm, rv, Tensor(), Tensor(), false, m);
    EXPECT_TRUE(all_close(rv, before, 0, 0));
  }
}

// ============================================================================ errors

TEST(ConvNormAttnErrors, BadInputsNameTheValues) {
  const Tensor x = zeros({2, 3, 8, 8});
  // Input has 3 channels, the weight expects 4.
  EXPECT_THROW_WITH(ops::conv2d(x, zeros({6, 4, 3, 3})), ShapeError, {"[6, 4, 3, 3]", "[2, 3, 8, 8]", "4", "3"});
  // groups=2 does not divide 3 input channels.
  EXPECT_THROW_WITH(ops::conv2d(x, zeros({4, 1, 3, 3}), Tensor(), {.groups = 2}), ValueError, {"groups=2", "3"});
  // groups=3 divides the input channels but not 4 output channels.
  EXPECT_THROW_WITH(ops::conv2d(x, zeros({4, 1, 3, 3}), Tensor(), {.groups = 3}), ValueError, {"groups=3", "4"});
  // A 9x9 kernel on an 8x8 input; with padding 1 it fits.
  EXPECT_THROW_WITH(ops::conv2d(x, zeros({4, 3, 9, 9})), ShapeError, {"9x9", "[2, 3, 8, 8]"});
  EXPECT_EQ(ops::conv2d(x, zeros({4, 3, 9, 9}), Tensor(), {.padding = {1, 1}}).shape(), (Shape{2, 4, 2, 2}));
  // Dilation makes a 3x3 kernel span 9.
  EXPECT_THROW_WITH(ops::conv2d(x, zeros({4, 3, 3, 3}), Tensor(), {.dilation = {4, 4}}), ShapeError, {"dilation 4"});
  // Attention: q/k head dims differ, k/v lengths differ, leading dims differ.
  EXPECT_THROW_WITH(ops::scaled_dot_product_attention(zeros({2, 5, 8}), zeros({2, 5, 7}), zeros({2, 5, 8})), ShapeError,
                    {"[2, 5, 8]", "[2, 5, 7]", "8", "7"});
  EXPECT_THROW_WITH(ops::scaled_dot_product_attention(zeros({2, 5, 8}), zeros({2, 6, 8}), zeros({2, 4, 8})), ShapeError,
                    {"[2, 6, 8]", "[2, 4, 8]", "6", "4"});
  EXPECT_THROW_WITH(ops::scaled_dot_product_attention(zeros({2, 5, 8}), zeros({3, 5, 8}), zeros({3, 5, 8})), ShapeError,
                    {"[2, 5, 8]", "[3, 5, 8]"});
  EXPECT_THROW_WITH(ops::scaled_dot_product_attention_reference(zeros({2, 5, 8}), zeros({2, 5, 7}), zeros({2, 5, 8})),
                    ShapeError, {"[2, 5, 7]"});
  // layer_norm: the trailing dims (3, 5) do not match normalized_shape (4) / (5, 3).
  EXPECT_THROW_WITH(ops::layer_norm(zeros({2, 3, 5}), {4}), ShapeError, {"[4]", "[2, 3, 5]"});
  EXPECT_THROW_WITH(ops::layer_norm(zeros({2, 3, 5}), {5, 3}), ShapeError, {"[5, 3]", "[2, 3, 5]"});
  EXPECT_THROW_WITH(ops::layer_norm(zeros({2, 3, 5}), {5}, zeros({4})), ShapeError, {"[4]", "[5]"});
  // group_norm groups must divide channels; batch_norm needs > 1 value per channel to train.
  EXPECT_THROW_WITH(ops::group_norm(zeros({2, 6, 3}), 4), ValueError, {"num_groups=4", "6"});
  EXPECT_THROW_WITH(ops::batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true), ValueError, {"[1, 3]"});
  EXPECT_THROW_WITH(ops::batch_norm(zeros({4, 3, 2}), Tensor(), Tensor(), zeros({4}), Tensor(), true), ShapeError,
                    {"weight", "4", "3"});
  // Pools: a kernel larger than the input.
  EXPECT_THROW_WITH(ops::max_pool2d(zeros({1, 1, 2, 2}), {.kernel_size = {3, 3}}), ShapeError, {"[1, 1, 2, 2]"});
  // where/masked_fill need a bool condition.
  EXPECT_THROW_WITH(ops::masked_fill(zeros({2, 2}), zeros({2, 2}), 1.0), DTypeError, {"float32"});
}

// A NaN output of the fused BatchNorm+ReLU passes its gradient (PyTorch's threshold_backward),
// in both layouts: the channels-last weight/bias sums dropped it, so gradients depended on layout.
TEST(NormGradcheck, BatchNormReluPassesGradientAtNanInBothLayouts) {
  const Tensor x = leaf({2, 3, 4, 5}, -1, 1, 580).detach();
  for (DType dt : {kFloat32, kBFloat16}) {
    std::vector<std::vector<double>> gbs;
    for (bool cl : {false, true}) {
      Tensor w = tensor(std::vector<double>{1, NAN, 0.5}, {3}, dt);
      Tensor b = zeros({3}, dt);
      w.requires_grad_(true);
      b.requires_grad_(true);
      const Tensor xi = x.to(dt);
      ops::sum(ops::batch_norm_relu(cl ? channels_last(xi) : xi, {}, {}, w, b, true)).backward();
      gbs.push_back(b.grad().to_vector());
      EXPECT_EQ(b.grad().to_vector()[1], 40.0) << dtype_name(dt) << (cl ? " channels-last" : " NCHW");
    }
    EXPECT_EQ(gbs[0], gbs[1]) << dtype_name(dt);
  }
}

// A head dimension of 0: every score is 0, so each query averages v (torch 2.x); 1/sqrt(0) = inf
// as the default scale made 0 * inf = NaN.
TEST(AttentionGradcheck, EmptyHeadDimensionAveragesTheValues) {
  const Tensor q = zeros({1, 2, 0}, kFloat64), k = zeros({1, 3, 0}, kFloat64);
  const Tensor v = leaf({1, 3, 2}, -1, 1, 590).detach();
  const Tensor want = ops::mean(v, {1}, true).expand({1, 2, 2});
  EXPECT_TRUE(all_close(ops::scaled_dot_product_attention(q, k, v), want, 1e-15, 1e-15));
  EXPECT_TRUE(all_close(ops::scaled_dot_product_attention_reference(q, k, v), want, 1e-15, 1e-15));
  // Causal: query i averages the first i + 1 values.
  const Tensor want_causal = ops::cat({v.narrow(1, 0, 1), ops::mean(v.narrow(1, 0, 2), {1}, true)}, 1);
  EXPECT_TRUE(all_close(ops::scaled_dot_product_attention(q, k, v, true), want_causal, 1e-15, 1e-15));
}

}  // namespace
}  // namespace tandem
