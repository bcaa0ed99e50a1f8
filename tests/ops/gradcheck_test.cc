// Finite-difference gradient checks (f64) for every differentiable op in src/tandem/ops and for
// every Tensor view method. Each case compares autograd's gradient with central differences of
// sum(w * fn(inputs)) for fixed random weights w (tests/util gradcheck).
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "ops/ops_test_util.h"

namespace tandem {
namespace {

using ops_test::f64;
using ops_test::i64;
using ops_test::param;
using testing::gradcheck;
using testing::leaf;
using V = std::vector<Tensor>;

// ---------------------------------------------------------------- binary elementwise

TEST(GradcheckBinary, AddSubMulDivSameShape) {
  const Tensor a = leaf({2, 3}, -1, 1, 1), b = leaf({2, 3}, 0.5, 2, 2);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::add(v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::sub(v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[0], v[1]); }, {a, b}));
}

TEST(GradcheckBinary, BroadcastBothDirections) {
  // (3,1,4) with (2,4) -> (3,2,4), in both argument orders: each operand is reduced by sum_to
  // over a different set of dims.
  const Tensor a = leaf({3, 1, 4}, -1, 1, 3), b = leaf({2, 4}, 0.5, 2, 4);
  for (int order = 0; order < 2; ++order) {
    const V in = order == 0 ? V{a, b} : V{b, a};
    EXPECT_TRUE(gradcheck([](const V& v) { return ops::add(v[0], v[1]); }, in)) << "order " << order;
    EXPECT_TRUE(gradcheck([](const V& v) { return ops::sub(v[0], v[1]); }, in)) << "order " << order;
    EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0], v[1]); }, in)) << "order " << order;
  }
  // div needs a positive denominator either way.
  const Tensor ap = leaf({3, 1, 4}, 0.5, 2, 5);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[0], v[1]); }, {ap, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[0], v[1]); }, {b, ap}));
  // A 0-d operand and a trailing-dim vector.
  const Tensor s = param({0.7}, {}), row = leaf({4}, 0.5, 1.5, 6);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::add(v[0], v[1]), v[2]); }, {a, s, row}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[1], v[2]); }, {a, s, row}));
}

TEST(GradcheckBinary, Alpha) {
  const Tensor a = leaf({3, 1, 4}, -1, 1, 7), b = leaf({2, 4}, -1, 1, 8);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::add(v[0], v[1], 0.5); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::add(v[1], v[0], -2.5); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::sub(v[0], v[1], 3.0); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::sub(ops::square(v[1]), v[0], 0.25); }, {a, b}));
}

TEST(GradcheckBinary, TensorScalar) {
  const Tensor a = leaf({2, 3}, 0.5, 2, 9);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::add(v[0], 2.5), v[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::square(v[0]), -1.5); }, {a}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(ops::exp(v[0]), 3.0); }, {a}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::rsub(v[0], 2.0), v[0]); }, {a}));
  // The operator overloads route to the same ops.
  EXPECT_TRUE(
      gradcheck([](const V& v) { return (2.0 - v[0]) * (v[0] + 1.0) / (v[0] * 0.5 - 3.0) + 4.0 * -v[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const V& v) { return (1.0 + v[0]) / v[0] - v[0]; }, {a}));
}

TEST(GradcheckBinary, OneInputWithoutGrad) {
  Tensor a = leaf({3, 1, 4}, -1, 1, 10);
  Tensor c = leaf({2, 4}, 0.5, 2, 11);
  c.requires_grad_(false);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0], v[1]); }, {a, c}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[0], v[1]); }, {a, c}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::div(v[1], ops::add(ops::square(v[0]), 1.0)); }, {a, c}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[1], ops::tanh(v[0].squeeze(1).t())); }, {a, c}));
  // After a real backward, the constant has no grad and the leaf has the right one.
  Tensor y = ops::sum(ops::mul(a, c));
  y.backward();
  EXPECT_FALSE(c.grad().defined());
  ASSERT_TRUE(a.grad().defined());
  EXPECT_ALL_CLOSE(a.grad(), ops::sum(c, {0}).reshape({1, 1, 4}).expand({3, 1, 4}), 1e-12, 1e-12);
}

// ---------------------------------------------------------------- unary elementwise

TEST(GradcheckUnary, Smooth) {
  const Tensor x = leaf({2, 3, 2}, -1.5, 1.5, 12);
  const Tensor pos = leaf({2, 3, 2}, 0.2, 3.0, 13);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::neg(ops::square(v[0])); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::log(v[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::sqrt(v[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::rsqrt(v[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::sigmoid(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::gelu(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::gelu(v[0], "none"); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::gelu(v[0], "tanh"); }, {x}));
  // Wider range for gelu, where the tanh approximation and exact forms differ most.
  const Tensor wide = leaf({12}, -4, 4, 14);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::gelu(v[0], "tanh"); }, {wide}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::gelu(v[0]); }, {wide}));
}

TEST(GradcheckUnary, KinkedAwayFromKinks) {
  // Values at least 0.1 from every kink (0 for abs/relu, the bounds for clamp).
  const Tensor x = param({-1.3, -0.7, -0.2, 0.15, 0.6, 1.4, -0.35, 0.9}, {2, 4});
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::abs(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::relu(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::relu(v[0]), ops::exp(v[0])); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::clamp(v[0], -0.5, 0.75); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(ops::clamp(v[0], -0.5, 0.75)); }, {x}));
}

TEST(GradcheckUnary, PowScalar) {
  const Tensor pos = leaf({3, 4}, 0.3, 2.5, 15);
  const Tensor any = leaf({3, 4}, -2, 2, 16);
  for (double p : {2.0, 3.0, 0.5, 1.5, -1.0, -0.5, -2.5, 1.0}) {
    EXPECT_TRUE(gradcheck([p](const V& v) { return ops::pow(v[0], p); }, {pos})) << "exponent " << p;
  }
  for (double p : {2.0, 3.0}) {  // integer exponents on negative bases
    EXPECT_TRUE(gradcheck([p](const V& v) { return ops::pow(v[0], p); }, {any})) << "exponent " << p;
  }
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::pow(v[0], 0.0), v[0]); }, {pos}));
}

TEST(GradcheckUnary, PowTensor) {
  const Tensor base = leaf({2, 3}, 0.3, 2.5, 17), e = leaf({2, 3}, -2, 2, 18);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::pow(v[0], v[1]); }, {base, e}));
  // Broadcast exponent (3) and broadcast base (2,1).
  const Tensor erow = leaf({3}, -1.5, 1.5, 19), bcol = leaf({2, 1}, 0.5, 2, 20);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::pow(v[0], v[1]); }, {base, erow}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::pow(v[0], v[1]); }, {bcol, e}));
}

// ---------------------------------------------------------------- reductions

TEST(GradcheckReduce, SumMean) {
  const Tensor x = leaf({2, 3, 4}, -1, 1, 21);
  for (bool keep : {false, true}) {
    for (const std::vector<int64_t>& dims :
         std::vector<std::vector<int64_t>>{{}, {0}, {1}, {2}, {0, 2}, {-1}, {-3, -1}, {1, -1}, {0, 1, 2}}) {
      EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::sum(v[0], dims, keep)); }, {x}))
          << "sum dims " << shape_str(dims) << " keepdim " << keep;
      EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::mean(v[0], dims, keep)); }, {x}))
          << "mean dims " << shape_str(dims) << " keepdim " << keep;
    }
  }
  // Reducing a non-contiguous view.
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(ops::sum(v[0].transpose(0, 2), {1})); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(ops::mean(v[0].permute({2, 0, 1}), {0, 2}, true)); }, {x}));
}

TEST(GradcheckReduce, Max) {
  const Tensor x = leaf({3, 4, 2}, -1, 1, 22);
  for (int64_t d : {0, 1, 2, -1, -3}) {
    for (bool keep : {false, true}) {
      EXPECT_TRUE(gradcheck([&](const V& v) { return ops::square(ops::max(v[0], d, keep).first); }, {x}))
          << "dim " << d << " keepdim " << keep;
    }
  }
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::max(v[0])); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::max(ops::mul(v[0].transpose(0, 1), 2.0), 1).first; }, {x}));
}

// ---------------------------------------------------------------- matmul / linear

TEST(GradcheckMatmul, AllRanks) {
  const Tensor v3 = leaf({3}, -1, 1, 30), w3 = leaf({3}, -1, 1, 31);
  const Tensor a23 = leaf({2, 3}, -1, 1, 32), b34 = leaf({3, 4}, -1, 1, 33);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {v3, w3}));    // dot -> 0-d
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {a23, b34}));  // (2,3)(3,4)
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {v3, b34}));   // (3)(3,4) -> (4)
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {a23, v3}));   // (2,3)(3) -> (2)
  const Tensor ba = leaf({2, 2, 3}, -1, 1, 34), bb = leaf({2, 3, 4}, -1, 1, 35);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {ba, bb}));   // batched 3-d
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {v3, bb}));   // (3)(2,3,4)
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {ba, v3}));   // (2,2,3)(3)
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {a23, bb}));  // 2-d x batched
}

TEST(GradcheckMatmul, BroadcastBatch) {
  const Tensor a = leaf({2, 1, 3, 4}, -1, 1, 36), b = leaf({5, 4, 2}, -1, 1, 37);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {a, b}));
  const Tensor c = leaf({1, 3, 4}, -1, 1, 38);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0], v[1]); }, {c, b}));
}

TEST(GradcheckMatmul, TransposedOperands) {
  const Tensor a = leaf({3, 2}, -1, 1, 39), b = leaf({4, 3}, -1, 1, 40);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[0].t(), v[1].t()); }, {a, b}));  // (2,3)(3,4)
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::matmul(v[1], v[0]); }, {a, b}));
  const Tensor ba = leaf({2, 3, 2}, -1, 1, 41), bb = leaf({2, 4, 3}, -1, 1, 42);
  EXPECT_TRUE(
      gradcheck([](const V& v) { return ops::matmul(v[0].transpose(-1, -2), v[1].transpose(1, 2)); }, {ba, bb}));
  // Batch dim not outermost in memory.
  const Tensor pb = leaf({3, 2, 4}, -1, 1, 43);
  EXPECT_TRUE(
      gradcheck([](const V& v) { return ops::matmul(v[0].transpose(-1, -2), v[1].transpose(0, 1)); }, {ba, pb}));
  // A strided (stepped) slice as an operand, and a non-linear function of the product.
  const Tensor s = leaf({2, 6}, -1, 1, 44);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(ops::matmul(v[0].slice(1, 0, 6, 2), v[1].t())); }, {s, b}));
}

TEST(GradcheckLinear, BiasNoBias3d) {
  const Tensor x = leaf({5, 3}, -1, 1, 50), w = leaf({4, 3}, -1, 1, 51), bias = leaf({4}, -1, 1, 52);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0], v[1], v[2]); }, {x, w, bias}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0], v[1]); }, {x, w}));
  const Tensor x3 = leaf({2, 3, 3}, -1, 1, 53);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(ops::linear(v[0], v[1], v[2])); }, {x3, w, bias}));
  const Tensor x1 = leaf({3}, -1, 1, 54);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0], v[1], v[2]); }, {x1, w, bias}));
  // Non-contiguous input, and the weight only (input without grad).
  const Tensor xt = leaf({3, 5}, -1, 1, 55);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0].t(), v[1], v[2]); }, {xt, w, bias}));
  // A transposed (non-contiguous) weight.
  const Tensor wt = leaf({3, 4}, -1, 1, 57);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0], v[1].t(), v[2]); }, {x, wt, bias}));
  Tensor xc = leaf({5, 3}, -1, 1, 56);
  xc.requires_grad_(false);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::linear(v[0], v[1], v[2]); }, {xc, w, bias}));
}

// ---------------------------------------------------------------- softmax and losses

TEST(GradcheckSoftmax, Dims) {
  const Tensor x = leaf({2, 3, 4}, -2, 2, 60);
  for (int64_t d : {0, 1, 2, -1, -2}) {
    EXPECT_TRUE(gradcheck([d](const V& v) { return ops::softmax(v[0], d); }, {x})) << "softmax dim " << d;
    EXPECT_TRUE(gradcheck([d](const V& v) { return ops::log_softmax(v[0], d); }, {x})) << "log_softmax dim " << d;
  }
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::softmax(v[0].transpose(0, 2), 1); }, {x}));
}

struct CeCase {
  const char* name;
  ops::CrossEntropyOptions opt;
};

TEST(GradcheckLoss, CrossEntropy2d) {
  const Tensor x = leaf({4, 5}, -2, 2, 61);
  const Tensor t = i64({1, 0, 4, 2}, {4});
  const Tensor t_ign = i64({1, -100, 4, -100}, {4});
  const Tensor t_ign2 = i64({2, 0, 2, 3}, {4});  // ignore_index = 2
  const std::vector<CeCase> cases{
      {"mean", {}},
      {"sum", {.reduction = "sum"}},
      {"none", {.reduction = "none"}},
      {"smooth mean", {.label_smoothing = 0.1}},
      {"smooth sum", {.label_smoothing = 0.1, .reduction = "sum"}},
      {"smooth none", {.label_smoothing = 0.1, .reduction = "none"}},
  };
  for (const CeCase& c : cases) {
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t, c.opt); }, {x})) << c.name;
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t_ign, c.opt); }, {x}))
        << c.name << " ignored";
    ops::CrossEntropyOptions o = c.opt;
    o.ignore_index = 2;
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t_ign2, o); }, {x}))
        << c.name << " ignore 2";
  }
  // int32 targets.
  EXPECT_TRUE(
      gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t.to(kInt32), {.label_smoothing = 0.1}); }, {x}));
  // Non-contiguous logits from an upstream op.
  const Tensor xt = leaf({5, 4}, -2, 2, 62);
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(ops::tanh(v[0]).t(), t); }, {xt}));
}

TEST(GradcheckLoss, CrossEntropySpatialAndVector) {
  const Tensor x = leaf({2, 3, 2, 2}, -2, 2, 63);
  const Tensor t = i64({0, 2, 1, 1, 2, -100, 0, 1}, {2, 2, 2});
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t, {.reduction = red}); }, {x})) << red;
    EXPECT_TRUE(gradcheck(
        [&](const V& v) { return ops::cross_entropy(v[0], t, {.label_smoothing = 0.1, .reduction = red}); }, {x}))
        << red << " smoothing";
  }
  const Tensor x1 = leaf({5}, -2, 2, 64);
  const Tensor t0 = i64({3}, {});
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::cross_entropy(v[0], t0, {.reduction = red}); }, {x1})) << red;
    EXPECT_TRUE(gradcheck(
        [&](const V& v) { return ops::cross_entropy(v[0], t0, {.label_smoothing = 0.1, .reduction = red}); }, {x1}))
        << red << " smoothing";
  }
}

TEST(GradcheckLoss, NllLoss) {
  const Tensor x = leaf({4, 5}, -2, 2, 65);
  const Tensor t = i64({1, 0, 4, 2}, {4});
  const Tensor t_ign = i64({1, -100, 4, -100}, {4});
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(
        gradcheck([&](const V& v) { return ops::nll_loss(ops::log_softmax(v[0], 1), t, {.reduction = red}); }, {x}))
        << red;
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::nll_loss(v[0], t_ign, {.reduction = red}); }, {x})) << red;
    EXPECT_TRUE(gradcheck(
        [&](const V& v) {
          return ops::nll_loss(ops::log_softmax(v[0], 1), i64({2, 0, 2, 3}, {4}),
                               {.ignore_index = 2, .reduction = red});
        },
        {x}))
        << red << " ignore 2";
  }
  const Tensor x4 = leaf({2, 3, 2, 2}, -2, 2, 66);
  const Tensor t4 = i64({0, 2, 1, 1, 2, -100, 0, 1}, {2, 2, 2});
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(
        gradcheck([&](const V& v) { return ops::nll_loss(ops::log_softmax(v[0], 1), t4, {.reduction = red}); }, {x4}))
        << red;
  }
  const Tensor x1 = leaf({5}, -2, 2, 67);
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(gradcheck(
        [&](const V& v) { return ops::nll_loss(ops::log_softmax(v[0], 0), i64({3}, {}), {.reduction = red}); }, {x1}))
        << red;
  }
}

TEST(GradcheckLoss, MseLoss) {
  const Tensor a = leaf({3, 4}, -1, 1, 68), b = leaf({3, 4}, -1, 1, 69);
  for (const char* red : {"mean", "sum", "none"}) {
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::mse_loss(v[0], v[1], red); }, {a, b})) << red;
    EXPECT_TRUE(gradcheck([&](const V& v) { return ops::mse_loss(ops::tanh(v[0]), v[1], red); }, {a, b})) << red;
  }
}

// ---------------------------------------------------------------- dropout

TEST(GradcheckDropout, FixedGenerator) {
  const Tensor x = leaf({4, 5}, -1, 1, 70);
  // A fresh generator inside the lambda: the same mask on every evaluation.
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        Generator g(1234);
        return ops::dropout(v[0], 0.4, true, &g);
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        Generator g(99);
        return ops::square(ops::dropout(ops::tanh(v[0]), 0.25, true, &g));
      },
      {x}));
  // The gradient is exactly the mask scaling: 0 or 1/(1-p), and out = x * grad.
  const double p = 0.4;
  Generator g(1234);
  Tensor y = ops::dropout(x, p, true, &g);
  ops::sum(y).backward();
  const std::vector<double> gv = x.grad().to_vector(), yv = y.to_vector(), xv = x.to_vector();
  int kept = 0;
  for (size_t i = 0; i < gv.size(); ++i) {
    EXPECT_TRUE(gv[i] == 0.0 || std::abs(gv[i] - 1.0 / (1.0 - p)) < 1e-12) << gv[i];
    EXPECT_NEAR(yv[i], xv[i] * gv[i], 1e-12);
    kept += gv[i] != 0.0;
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, 20);
}

// ---------------------------------------------------------------- Tensor view methods

TEST(GradcheckViews, EachViewMethod) {
  const Tensor x = leaf({2, 3, 4}, -1, 1, 80);
  // Each view feeds a non-linear op, so the gradient depends on which element went where.
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].view({6, 4})); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].view({-1, 2, 2})); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].transpose(0, 1).view({3, 2, 2, 2})); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(v[0].reshape({4, 6})); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(v[0].transpose(1, 2).reshape({8, 3})); }, {x}));  // copies
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(v[0].flatten()); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(v[0].flatten(1)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::tanh(v[0].permute({2, 0, 1}).flatten(0, 1)); }, {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        return ops::mul(v[0].permute({2, 0, 1}), ops::exp(v[0].permute({2, 0, 1})));
      },
      {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].transpose(0, 2)); }, {x}));
  EXPECT_TRUE(
      gradcheck([](const V& v) { return ops::matmul(v[0].select(0, 1).t(), ops::exp(v[0].select(0, 0))); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].slice(2, 0, 4, 2)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].slice(2, 1, 4, 2)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].slice(1, -2, 3, 1)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].narrow(1, 1, 2)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].select(2, -1)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0].select(1, 0), v[0].select(1, 2)); }, {x}));
}

TEST(GradcheckViews, ExpandSqueezeCopies) {
  const Tensor col = leaf({3, 1}, -1, 1, 81);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].expand({3, 4})); }, {col}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].expand({2, -1, 4})); }, {col}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0].expand({3, 3}), v[0].t().expand({3, 3})); }, {col}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].squeeze(1)); }, {col}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].squeeze(0)); }, {col}));  // no-op squeeze
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].squeeze(-1).unsqueeze(0)); }, {col}));
  const Tensor x = leaf({2, 3}, -1, 1, 82);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0].unsqueeze(1), ops::exp(v[0].unsqueeze(-1))); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].t().contiguous()); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].contiguous()); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(v[0].clone(), v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].t().clone()); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(v[0].to(kFloat64)); }, {x}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].t()); }, {x}));
  // 0-d tensors: reshape to and from a scalar, reductions and softmax of a scalar.
  const Tensor one = leaf({1, 1}, -1, 1, 83);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(v[0].reshape({})); }, {one}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::sum(v[0].view({}), {}, false)); }, {one}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::mul(ops::softmax(v[0].view({}), 0), v[0]); }, {one}));
  EXPECT_TRUE(
      gradcheck([](const V& v) { return ops::mul(v[0].reshape({}).unsqueeze(0).expand({3}), v[0].flatten()); }, {one}));
  // A chain of views on a view.
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        return ops::tanh(v[0].t().unsqueeze(0).expand({2, 3, 2}).permute({2, 1, 0}).reshape({4, 3}).slice(0, 1, 4, 2));
      },
      {x}));
}

// ---------------------------------------------------------------- cat, stack, split, gather

TEST(GradcheckShape, CatStack) {
  const Tensor a = leaf({2, 3}, -1, 1, 90), b = leaf({1, 3}, -1, 1, 91), c = leaf({3, 3}, -1, 1, 92);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::cat({v[0], v[1], v[2]}, 0)); }, {a, b, c}));
  const Tensor d = leaf({2, 1}, -1, 1, 93), e = leaf({2, 4}, -1, 1, 94);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::cat({v[0], v[1], v[2]}, 1)); }, {a, d, e}));
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::cat({v[0], v[1], v[2]}, -1)); }, {a, d, e}));
  // Non-contiguous pieces, one used twice.
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::square(ops::cat({v[0].t(), v[1].t(), v[0].t()}, 0)); }, {a, d}));
  const Tensor f = leaf({2, 3}, -1, 1, 95), g = leaf({2, 3}, -1, 1, 96);
  for (int64_t dim : {0, 1, 2, -1}) {
    EXPECT_TRUE(gradcheck(
        [dim](const V& v) {
          return ops::exp(ops::stack({v[0], v[1], v[2]}, dim));
        },
        {a, f, g}))
        << "stack dim " << dim;
  }
  // A piece that does not require grad.
  Tensor k = leaf({1, 3}, -1, 1, 97);
  k.requires_grad_(false);
  EXPECT_TRUE(gradcheck([](const V& v) { return ops::exp(ops::cat({v[0], v[1]}, 0)); }, {a, k}));
}

TEST(GradcheckShape, SplitChunk) {
  const Tensor x = leaf({7, 2}, -1, 1, 98);
  // Several pieces used in different non-linear ways; the middle piece of split is unused, so
  // its gradient (zeros) must still reach the right rows.
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::split(v[0], 3, 0);  // 3, 3, 1
        return ops::add(ops::sum(ops::square(p[0])), ops::mul(ops::sum(ops::exp(p[2])), 2.0));
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::split(v[0], 3, 0);
        return ops::cat({ops::exp(p[2]), ops::tanh(p[1]), ops::square(p[0])}, 0);
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::split_with_sizes(v[0], {2, 4, 1}, 0);
        return ops::cat({ops::square(p[1]), ops::exp(p[0]), ops::mul(p[2], p[2])}, 0);
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::split_with_sizes(v[0], {1, 1}, 1);
        return ops::mul(ops::exp(p[0]), p[1]);
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::chunk(v[0], 3, 0);  // 3, 3, 1
        return ops::add(ops::mul(p[0], ops::tanh(p[1])), ops::sum(ops::exp(p[2])));
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const V& v) {
        const std::vector<Tensor> p = ops::chunk(v[0].t(), 2, 0);  // (1,7), (1,7)
        return ops::mul(ops::exp(p[0]), ops::square(p[1]));
      },
      {x}));
}

TEST(GradcheckShape, IndexSelect) {
  const Tensor x = leaf({4, 3}, -1, 1, 99);
  const Tensor idx = i64({2, 0, 2, 3, 2}, {5});  // duplicates accumulate
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::index_select(v[0], 0, idx)); }, {x}));
  const Tensor idx1 = i64({1, 1, 0}, {3});
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::index_select(v[0], 1, idx1)); }, {x}));
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::index_select(v[0], -1, idx1)); }, {x}));
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::index_select(v[0].t(), 0, idx1)); }, {x}));
  const Tensor idx32 = i64({3, 3, 1}, {3}).to(kInt32);
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::square(ops::index_select(v[0], 0, idx32)); }, {x}));
  const Tensor x3 = leaf({2, 3, 2}, -1, 1, 100);
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::index_select(v[0], 1, i64({2, 0, 2}, {3}))); }, {x3}));
}

TEST(GradcheckShape, Embedding) {
  const Tensor w = leaf({5, 3}, -1, 1, 101);
  const Tensor ix = i64({1, 4, 1, 0, 4, 4}, {2, 3});
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::embedding(v[0], ix)); }, {w}));
  EXPECT_TRUE(gradcheck([&](const V& v) { return ops::exp(ops::embedding(v[0], i64({2}, {}))); }, {w}));
  // padding_idx: the forward still reads the row, but its gradient is zero; other rows get the
  // same gradient as without padding_idx.
  Tensor w1 = leaf({5, 3}, -1, 1, 101), w2 = leaf({5, 3}, -1, 1, 101);
  const Tensor upstream = randn({2, 3, 3}, kFloat64);
  Tensor y1 = ops::embedding(w1, ix, /*padding_idx=*/4);
  EXPECT_ALL_CLOSE(y1.select(0, 0).select(0, 1), w1.select(0, 4), 0, 0);
  ops::sum(ops::mul(ops::exp(y1), upstream)).backward();
  ops::sum(ops::mul(ops::exp(ops::embedding(w2, ix)), upstream)).backward();
  const Tensor g1 = w1.grad(), g2 = w2.grad();
  for (int64_t r = 0; r < 5; ++r) {
    if (r == 4) {
      EXPECT_EQ(g1.select(0, r).to_vector(), std::vector<double>(3, 0.0));
      EXPECT_NE(g2.select(0, r).to_vector(), std::vector<double>(3, 0.0));
    } else {
      EXPECT_ALL_CLOSE(g1.select(0, r), g2.select(0, r), 0, 0);
    }
  }
  EXPECT_EQ(g1.select(0, 2).to_vector(), std::vector<double>(3, 0.0));  // never looked up
  EXPECT_NE(g1.select(0, 1).to_vector(), std::vector<double>(3, 0.0));
}

}  // namespace
}  // namespace tandem
