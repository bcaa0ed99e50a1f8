// Forward values of the ops on small hand-picked tensors, checked against values computed in
// double with std:: functions or by hand.
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ops/ops_test_util.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/kernel_timing.h"

namespace tandem {
namespace {

using ops_test::f64;
using ops_test::i64;
using ops_test::param;

const std::vector<double> kVals{-2.5, -1.0, -0.3, 0.0, 0.4, 1.0, 2.2, 3.7};
const std::vector<double> kPos{0.05, 0.3, 1.0, 2.0, 4.5, 9.0};

// Applies `op` to a tensor of `vals` (in `dtype`) and compares with `ref` applied per element.
void expect_unary(const std::function<Tensor(const Tensor&)>& op, double (*ref)(double),
                  const std::vector<double>& vals, DType dtype, double rtol, double atol, const char* what) {
  const Tensor x = tensor(vals, {2, static_cast<int64_t>(vals.size()) / 2}, dtype);
  const Tensor y = op(x);
  EXPECT_EQ(y.dtype(), dtype) << what;
  std::vector<double> e;
  // The reference runs on the values as stored (f32 rounding of the inputs).
  for (double v : x.to_vector()) e.push_back(ref(v));
  EXPECT_TRUE(testing::all_close(y, tensor(e, x.shape(), kFloat64), rtol, atol)) << what << " " << dtype_name(dtype);
}

double gelu_exact(double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }
double gelu_tanh(double v) {
  return 0.5 * v * (1 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
}

TEST(ForwardUnary, MatchesStdFunctions) {
  for (DType dt : {kFloat64, kFloat32}) {
    // f32: a few f32 ulps, plus an absolute term for gelu's 1 + erf cancellation at negative x.
    const double rt = dt == kFloat64 ? 1e-14 : 2e-6, at = dt == kFloat64 ? 1e-15 : 3e-7;
    expect_unary([](const Tensor& x) { return ops::neg(x); }, [](double v) { return -v; }, kVals, dt, 0, 0, "neg");
    expect_unary([](const Tensor& x) { return ops::exp(x); }, [](double v) { return std::exp(v); }, kVals, dt, rt, at,
                 "exp");
    expect_unary([](const Tensor& x) { return ops::log(x); }, [](double v) { return std::log(v); }, kPos, dt, rt, at,
                 "log");
    expect_unary([](const Tensor& x) { return ops::sqrt(x); }, [](double v) { return std::sqrt(v); }, kPos, dt, rt, at,
                 "sqrt");
    expect_unary([](const Tensor& x) { return ops::rsqrt(x); }, [](double v) { return 1 / std::sqrt(v); }, kPos, dt, rt,
                 at, "rsqrt");
    expect_unary([](const Tensor& x) { return ops::square(x); }, [](double v) { return v * v; }, kVals, dt, rt, at,
                 "square");
    expect_unary([](const Tensor& x) { return ops::abs(x); }, [](double v) { return std::abs(v); }, kVals, dt, 0, 0,
                 "abs");
    expect_unary([](const Tensor& x) { return ops::relu(x); }, [](double v) { return v > 0 ? v : 0.0; }, kVals, dt, 0,
                 0, "relu");
    expect_unary([](const Tensor& x) { return ops::gelu(x); }, gelu_exact, kVals, dt, rt, at, "gelu");
    expect_unary([](const Tensor& x) { return ops::gelu(x, "tanh"); }, gelu_tanh, kVals, dt, rt, at, "gelu tanh");
    expect_unary([](const Tensor& x) { return ops::sigmoid(x); }, [](double v) { return 1 / (1 + std::exp(-v)); },
                 kVals, dt, rt, at, "sigmoid");
    expect_unary([](const Tensor& x) { return ops::tanh(x); }, [](double v) { return std::tanh(v); }, kVals, dt, rt, at,
                 "tanh");
    expect_unary([](const Tensor& x) { return ops::clamp(x, -1.0, 2.0); },
                 [](double v) { return std::min(std::max(v, -1.0), 2.0); }, kVals, dt, 0, 0, "clamp");
    expect_unary([](const Tensor& x) { return ops::pow(x, 2.5); }, [](double v) { return std::pow(v, 2.5); }, kPos, dt,
                 rt, at, "pow 2.5");
    expect_unary([](const Tensor& x) { return ops::pow(x, -0.5); }, [](double v) { return std::pow(v, -0.5); }, kPos,
                 dt, rt, at, "pow -0.5");
    expect_unary([](const Tensor& x) { return ops::pow(x, 3.0); }, [](double v) { return v * v * v; }, kVals, dt, rt,
                 at, "pow 3");
    expect_unary([](const Tensor& x) { return ops::add(x, 1.25); }, [](double v) { return v + 1.25; }, kVals, dt, rt,
                 at, "add scalar");
    expect_unary([](const Tensor& x) { return ops::mul(x, -3.0); }, [](double v) { return v * -3.0; }, kVals, dt, rt,
                 at, "mul scalar");
    expect_unary([](const Tensor& x) { return ops::div(x, 4.0); }, [](double v) { return v / 4.0; }, kVals, dt, rt, at,
                 "div scalar");
    expect_unary([](const Tensor& x) { return ops::rsub(x, 1.5); }, [](double v) { return 1.5 - v; }, kVals, dt, rt, at,
                 "rsub");
  }
}

TEST(ForwardUnary, GeluKnownValues) {
  const Tensor one = f64({1.0, -1.0, 0.0}, {3});
  const std::vector<double> exact = ops::gelu(one).to_vector();
  const std::vector<double> approx = ops::gelu(one, "tanh").to_vector();
  EXPECT_NEAR(exact[0], 0.8413447460685429, 1e-15);
  EXPECT_NEAR(approx[0], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(exact[1], -0.15865525393145707, 1e-15);  // gelu(-1) = -Phi(-1)
  EXPECT_NEAR(approx[1], -0.15880800939172324, 1e-15);
  EXPECT_EQ(exact[2], 0.0);
  EXPECT_NEAR(ops::gelu(one.to(kFloat32)).to_vector()[0], 0.8413447460685429, 1e-7);
  EXPECT_NEAR(ops::gelu(one.to(kFloat32), "tanh").to_vector()[0], 0.8411919906082768, 1e-7);
}

TEST(ForwardUnary, GeluF32MatchesF64OverWideRange) {
  // f32 gelu against the f64 formula on the same f32 values, from deep in the negative tail to
  // large positive x. Dense f32 (contiguous, or transposed with a gradient of the same strides)
  // takes the fused tanh kernel, which uses the cancellation-free form x * sigmoid(2u): a few
  // f32 ulps relative. A strided (non-dense) view takes the plain f32 form 0.5 x (1 + tanh u),
  // as PyTorch does: 1 + tanh(u) (or 1 + erf) loses what lies below 2^-24, an absolute error up
  // to |x| 2^-24 < 1e-6 forward and |g x u'| 2^-23 < 1e-5 backward for |x| <= 9, |g| <= 1.
  std::vector<double> xs, gs;
  Generator gen(3);
  const std::vector<double> gv = rand({1001}, kFloat64, &gen).to_vector();
  for (int i = 0; i <= 1000; ++i) {
    xs.push_back(-9.0 + 18.0 * i / 1000.0);
    gs.push_back(2 * gv[static_cast<size_t>(i)] - 1);
  }
  const Tensor x32 = tensor(xs, {7, 143}, kFloat32), g32 = tensor(gs, {7, 143}, kFloat32);
  struct Case {
    const char* name;
    Tensor x, g;
    double atol_fwd, atol_bwd;
  };
  const std::vector<Case> cases{
      {"contiguous", x32, g32, 1e-7, 1e-7},
      {"transposed", x32.t(), g32.t(), 1e-7, 1e-7},
      {"stepped", x32.slice(1, 0, 143, 2), g32.slice(1, 0, 143, 2), 1e-6, 1e-5},
  };
  for (const Case& c : cases) {
    const Tensor x64 = c.x.to(kFloat64), g64 = c.g.to(kFloat64);
    for (const char* approx : {"tanh", "none"}) {
      const double af = std::string(approx) == "tanh" ? c.atol_fwd : 1e-6,
                   ab = std::string(approx) == "tanh" ? c.atol_bwd : 1e-5;
      const Tensor y = ops::gelu(c.x, approx);
      EXPECT_EQ(y.dtype(), kFloat32);
      EXPECT_TRUE(testing::all_close(y, ops::gelu(x64, approx), 4e-6, af)) << c.name << " " << approx;
      const Tensor d32 = ops::gelu_backward(c.g, c.x, approx);
      EXPECT_EQ(d32.dtype(), kFloat32);
      const Tensor d64 = ops::gelu_backward(g64, x64, approx);
      EXPECT_TRUE(testing::all_close(d32, d64, 4e-6, ab)) << c.name << " " << approx << " backward";
      // Through autograd (the leaf is a contiguous copy, so its gradient may take the other path).
      Tensor leaf32 = c.x.detach().clone();
      leaf32.requires_grad_(true);
      ops::sum(ops::mul(ops::gelu(leaf32, approx), c.g)).backward();
      EXPECT_TRUE(testing::all_close(leaf32.grad(), d64, 4e-6, 1e-5)) << c.name << " " << approx << " autograd";
    }
  }
}

TEST(ForwardUnary, BackwardHelpersMatchDerivatives) {
  const Tensor x = f64({-2.0, -0.5, 0.3, 1.7}, {4});
  const Tensor g = f64({1.0, 2.0, -1.0, 0.5}, {4});
  const std::vector<double> xe = x.to_vector(), ge = g.to_vector();
  const std::vector<double> de = ops::gelu_backward(g, x, "none").to_vector();
  const std::vector<double> dt = ops::gelu_backward(g, x, "tanh").to_vector();
  for (size_t i = 0; i < xe.size(); ++i) {
    const double v = xe[i], h = 1e-6;
    EXPECT_NEAR(de[i], ge[i] * (gelu_exact(v + h) - gelu_exact(v - h)) / (2 * h), 1e-8);
    EXPECT_NEAR(dt[i], ge[i] * (gelu_tanh(v + h) - gelu_tanh(v - h)) / (2 * h), 1e-8);
  }
  const Tensor y = ops::relu(x);
  EXPECT_EQ(ops::relu_backward(g, y).to_vector(), (std::vector<double>{0, 0, -1.0, 0.5}));
}

TEST(ForwardBinary, BroadcastValues) {
  const Tensor a = f64({1, 2, 3, 4, 5, 6}, {3, 1, 2});
  const Tensor b = f64({10, 20, 30, 40}, {2, 2});
  const std::vector<double> av = a.to_vector(), bv = b.to_vector();
  auto expect = [&](const Tensor& y, const std::function<double(double, double)>& f, bool swapped, const char* what) {
    ASSERT_EQ(y.shape(), (Shape{3, 2, 2})) << what;
    std::vector<double> e;
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j)
        for (int k = 0; k < 2; ++k) {
          const double x = av[i * 2 + k], z = bv[j * 2 + k];
          e.push_back(swapped ? f(z, x) : f(x, z));
        }
    EXPECT_TRUE(testing::all_close(y, tensor(e, y.shape(), kFloat64), 1e-15, 0)) << what;
  };
  expect(
      ops::add(a, b), [](double x, double z) { return x + z; }, false, "add");
  expect(
      ops::add(b, a), [](double z, double x) { return z + x; }, true, "add swapped");
  expect(
      ops::sub(a, b), [](double x, double z) { return x - z; }, false, "sub");
  expect(
      ops::sub(b, a), [](double z, double x) { return z - x; }, true, "sub swapped");
  expect(
      ops::mul(a, b), [](double x, double z) { return x * z; }, false, "mul");
  expect(
      ops::div(a, b), [](double x, double z) { return x / z; }, false, "div");
  expect(
      ops::div(b, a), [](double z, double x) { return z / x; }, true, "div swapped");
  expect(
      ops::add(a, b, 0.5), [](double x, double z) { return x + 0.5 * z; }, false, "add alpha");
  expect(
      ops::sub(a, b, 2.0), [](double x, double z) { return x - 2.0 * z; }, false, "sub alpha");
  expect(
      ops::add(a.to(kFloat32), b.to(kFloat32), -0.25).to(kFloat64), [](double x, double z) { return x - 0.25 * z; },
      false, "add alpha f32");
  expect(
      ops::pow(a, ops::mul(b, 0.05)), [](double x, double z) { return std::pow(x, 0.05 * z); }, false, "pow tensor");
  expect(
      ops::pow(ops::mul(b, 0.05), a), [](double z, double x) { return std::pow(0.05 * z, x); }, true,
      "pow tensor swapped");
  // Mixed dtypes promote like PyTorch: f32 with f64 -> f64, bf16 with f32 -> f32.
  EXPECT_EQ(ops::add(a.to(kFloat32), b).dtype(), kFloat64);
  EXPECT_EQ(ops::mul(a.to(kBFloat16), b.to(kFloat32)).dtype(), kFloat32);
  EXPECT_EQ(ops::mul(a.to(kBFloat16), b.to(kFloat16)).dtype(), kFloat32);
}

TEST(ForwardBinary, StridedOperands) {
  // Non-contiguous operands are read through their strides.
  const Tensor a = f64({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = f64({1, 10, 100, 1000, 10000, 100000}, {3, 2});
  EXPECT_EQ(ops::add(a, b.t()).to_vector(), (std::vector<double>{2, 102, 10003, 14, 1005, 100006}));
  EXPECT_EQ(ops::mul(a.slice(1, 0, 3, 2), f64({2, 3}, {2})).to_vector(), (std::vector<double>{2, 9, 8, 18}));
  EXPECT_EQ(ops::exp(a.t()).to_vector(), ops::exp(a).t().contiguous().to_vector());
  EXPECT_EQ(ops::eq(a, a.t().t()).to_vector(), std::vector<double>(6, 1.0));
  EXPECT_EQ(ops::gt(a, 3.5).to_vector(), (std::vector<double>{0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(ops::count_equal(a, f64({1, 0, 3, 0, 5, 7}, {2, 3})), 3);
}

TEST(ForwardReduce, SumMeanValues) {
  const Tensor x = f64({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 3, 2});
  EXPECT_EQ(ops::sum(x).item(), 78.0);
  EXPECT_EQ(ops::sum(x).dim(), 0);
  EXPECT_EQ(ops::mean(x).item(), 6.5);
  EXPECT_EQ(ops::sum(x, {0}).to_vector(), (std::vector<double>{8, 10, 12, 14, 16, 18}));
  EXPECT_EQ(ops::sum(x, {1}).to_vector(), (std::vector<double>{9, 12, 27, 30}));
  EXPECT_EQ(ops::sum(x, {-1}).to_vector(), (std::vector<double>{3, 7, 11, 15, 19, 23}));
  EXPECT_EQ(ops::sum(x, {0, 2}).to_vector(), (std::vector<double>{18, 26, 34}));
  EXPECT_EQ(ops::sum(x, {0, 2}, true).shape(), (Shape{1, 3, 1}));
  EXPECT_EQ(ops::sum(x, {}, true).shape(), (Shape{1, 1, 1}));
  EXPECT_EQ(ops::sum(x, {-3, -1}).to_vector(), (std::vector<double>{18, 26, 34}));
  EXPECT_EQ(ops::mean(x, {1}).to_vector(), (std::vector<double>{3, 4, 9, 10}));
  EXPECT_EQ(ops::mean(x, {0, 1}, true).to_vector(), (std::vector<double>{6, 7}));
  EXPECT_EQ(ops::mean(x, {0, 1}, true).shape(), (Shape{1, 1, 2}));
  EXPECT_EQ(ops::sum(x.transpose(0, 2), {0}).to_vector(), (std::vector<double>{3, 15, 7, 19, 11, 23}));
  // f32 sums accumulate in f64: 1 + 1e-8 * many does not get lost.
  Tensor big = full({1 << 16}, 1e-4, kFloat32);
  EXPECT_NEAR(ops::sum(big).item(), 6.5536, 1e-5);
  EXPECT_EQ(ops::sum(big).dtype(), kFloat32);
}

TEST(ForwardReduce, MaxArgmax) {
  const Tensor x = f64({3, 7, 7, 1, 9, 9, 2, 5, -1, 4, 4, 0}, {3, 4});
  auto [v, i] = ops::max(x, 1);
  EXPECT_EQ(v.to_vector(), (std::vector<double>{7, 9, 4}));
  EXPECT_EQ(i.to_vector(), (std::vector<double>{1, 0, 1}));  // first index on ties
  EXPECT_EQ(i.dtype(), kInt64);
  auto [v0, i0] = ops::max(x, 0, true);
  EXPECT_EQ(v0.shape(), (Shape{1, 4}));
  EXPECT_EQ(v0.to_vector(), (std::vector<double>{9, 9, 7, 5}));
  EXPECT_EQ(i0.to_vector(), (std::vector<double>{1, 1, 0, 1}));
  EXPECT_EQ(ops::argmax(x, 1).to_vector(), (std::vector<double>{1, 0, 1}));
  EXPECT_EQ(ops::argmax(x, -2, true).to_vector(), (std::vector<double>{1, 1, 0, 1}));
  EXPECT_EQ(ops::argmax(x, -2, true).shape(), (Shape{1, 4}));
  EXPECT_EQ(ops::max(x).item(), 9.0);
  EXPECT_EQ(ops::max(x).dim(), 0);
  // Ties: the gradient goes to the first maximum only.
  Tensor p = param({2, 5, 5, 1}, {4});
  ops::max(p, 0).first.backward();
  EXPECT_EQ(p.grad().to_vector(), (std::vector<double>{0, 1, 0, 0}));
  // NaN propagates (and is the argmax), in any position.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor n = f64({1, nan, 3, 5, 2, 4, nan, 0, nan}, {3, 3});
  auto [nv, ni] = ops::max(n, 1);
  EXPECT_TRUE(std::isnan(nv.to_vector()[0]));
  EXPECT_EQ(nv.to_vector()[1], 5);
  EXPECT_TRUE(std::isnan(nv.to_vector()[2]));
  EXPECT_EQ(ni.to_vector(), (std::vector<double>{1, 0, 0}));
  EXPECT_TRUE(std::isnan(ops::max(n).item()));
  EXPECT_TRUE(std::isnan(ops::max(n.to(kFloat32)).item()));
  EXPECT_EQ(ops::argmax(n.to(kBFloat16), 1).to_vector(), (std::vector<double>{1, 0, 0}));
  // Integer inputs work for max/argmax (no gradient).
  EXPECT_EQ(ops::max(i64({4, -2, 9, 9}, {2, 2}), 1).first.to_vector(), (std::vector<double>{4, 9}));
  EXPECT_EQ(ops::argmax(i64({4, -2, 9, 9}, {2, 2}), 0).to_vector(), (std::vector<double>{1, 1}));
}

TEST(ForwardReduce, MinArgminMirrorMax) {
  const Tensor x = f64({3, 7, 7, 1, 9, 9, 2, 5, -1, 4, -1, 0}, {3, 4});
  auto [v, i] = ops::min(x, 1);
  EXPECT_EQ(v.to_vector(), (std::vector<double>{1, 2, -1}));
  EXPECT_EQ(i.to_vector(), (std::vector<double>{3, 2, 0}));  // first index on ties
  EXPECT_EQ(ops::argmin(x, 0, true).to_vector(), (std::vector<double>{2, 2, 2, 2}));
  EXPECT_EQ(ops::argmin(x, 0, true).shape(), (Shape{1, 4}));
  EXPECT_EQ(ops::min(x).item(), -1.0);
  // Ties: min(x, dim) gives the gradient to the first minimum, min(x) shares it among all.
  Tensor p = param({2, 1, 5, 1}, {4});
  ops::min(p, 0).first.backward();
  EXPECT_EQ(p.grad().to_vector(), (std::vector<double>{0, 1, 0, 0}));
  Tensor q = param({2, 1, 5, 1}, {4});
  ops::min(q).backward();
  EXPECT_EQ(q.grad().to_vector(), (std::vector<double>{0, 0.5, 0, 0.5}));
  // NaN is the minimum too (PyTorch propagates it); integers work without a gradient.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(ops::min(f64({1, nan, -3}, {3})).item()));
  EXPECT_EQ(ops::argmin(f64({1, nan, -3}, {3}), 0).item(), 1.0);
  EXPECT_EQ(ops::min(i64({4, -2, 9, 9}, {2, 2}), 1).first.to_vector(), (std::vector<double>{-2, 9}));
  EXPECT_THROW(ops::min(zeros({2, 0}), 1), ShapeError);
}

TEST(ForwardReduce, VarStdAsPyTorch) {
  const Tensor x = f64({1, 2, 3, 4, 10, 20, 30, 40}, {2, 4});
  EXPECT_DOUBLE_EQ(ops::var(x, {1}).to_vector()[0], 5.0 / 3.0);      // Bessel: / (n - 1)
  EXPECT_DOUBLE_EQ(ops::var(x, {1}, 0.0).to_vector()[1], 125.0);      // / n
  EXPECT_DOUBLE_EQ(ops::std(x, {1}, 0.0).to_vector()[1], std::sqrt(125.0));
  EXPECT_EQ(ops::var(x, {0}, 1.0, true).shape(), (Shape{1, 4}));
  EXPECT_EQ(ops::var(x).dim(), 0);
  // One value with correction 1: 0 / 0, NaN (PyTorch warns and returns NaN too).
  EXPECT_TRUE(std::isnan(ops::var(f64({3}, {1})).item()));
  // bf16: computed in f32 and rounded once (a bf16 pass would round every deviation).
  const Tensor xb = x.to(kBFloat16);
  EXPECT_EQ(ops::var(xb, {1}).dtype(), kBFloat16);
  EXPECT_EQ(ops::var(xb, {1}).to_vector(), ops::var(x, {1}).to(kBFloat16).to_vector());
  // The gradient: 2 (x - mean) / (n - correction).
  Tensor p = param({1, 2, 3, 6}, {4});
  ops::var(p).backward();
  const double m = 3.0;
  std::vector<double> want;
  for (double e : {1.0, 2.0, 3.0, 6.0}) want.push_back(2 * (e - m) / 3.0);
  const std::vector<double> got = p.grad().to_vector();
  for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(got[k], want[k], 1e-15);
  EXPECT_THROW(ops::var(i64({1, 2}, {2})), DTypeError);
  EXPECT_THROW(ops::var(x, {}, -1.0), ValueError);
  // std's gradient: (x - mean) / (std * (n - correction)), and 0 for a constant slice (PyTorch's
  // std_backward masks it; sqrt's backward alone gave NaN over the whole slice).
  Tensor c = param({1, 1, 1, 1, 2, 3}, {2, 3});
  ops::sum(ops::std(c, {1})).backward();
  const std::vector<double> gc = c.grad().to_vector();
  EXPECT_EQ(std::vector<double>(gc.begin(), gc.begin() + 3), (std::vector<double>{0, 0, 0}));
  EXPECT_NEAR(gc[3], -0.5, 1e-15);
  EXPECT_NEAR(gc[4], 0.0, 1e-15);
  EXPECT_NEAR(gc[5], 0.5, 1e-15);
  Tensor ones_p = param({1, 1, 1, 1}, {4});
  ops::std(ones_p).backward();
  EXPECT_EQ(ones_p.grad().to_vector(), (std::vector<double>{0, 0, 0, 0}));
}

TEST(ForwardLinalg, MatmulValues) {
  const Tensor a = f64({1, 2, 3, 4}, {2, 2}), b = f64({5, 6, 7, 8}, {2, 2});
  for (DType dt : {kFloat64, kFloat32, kBFloat16, kFloat16}) {  // small integers: exact in every dtype
    const Tensor y = ops::matmul(a.to(dt), b.to(dt));
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_EQ(y.to_vector(), (std::vector<double>{19, 22, 43, 50})) << dtype_name(dt);
    EXPECT_EQ(ops::matmul(a.to(dt).t(), b.to(dt)).to_vector(), (std::vector<double>{26, 30, 38, 44})) << dtype_name(dt);
    EXPECT_EQ(ops::matmul(a.to(dt), b.to(dt).t()).to_vector(), (std::vector<double>{17, 23, 39, 53})) << dtype_name(dt);
  }
  const Tensor v = f64({1, -1}, {2});
  EXPECT_EQ(ops::matmul(v, v).item(), 2.0);
  EXPECT_EQ(ops::matmul(v, v).dim(), 0);
  EXPECT_EQ(ops::matmul(v, b).to_vector(), (std::vector<double>{-2, -2}));
  EXPECT_EQ(ops::matmul(a, v).to_vector(), (std::vector<double>{-1, -1}));
  // A 2-d operand broadcast against a batch: (2,2) x (3,2,2) and (3,2,2) x (2,2).
  for (DType dt : {kFloat64, kFloat32, kBFloat16, kFloat16}) {
    const Tensor bb3 = ops::stack({b, ops::neg(b), ops::add(b, 1.0)}).to(dt);
    EXPECT_EQ(ops::matmul(a.to(dt), bb3).to_vector(),
              (std::vector<double>{19, 22, 43, 50, -19, -22, -43, -50, 22, 25, 50, 57}))
        << dtype_name(dt);
    EXPECT_EQ(ops::matmul(bb3, a.to(dt)).to_vector(),
              (std::vector<double>{23, 34, 31, 46, -23, -34, -31, -46, 27, 40, 35, 52}))
        << dtype_name(dt);
  }
  // Batched with a broadcast batch: (2,1,2,2) x (3,2,2) -> (2,3,2,2).
  const Tensor ba = ops::stack({a, ops::mul(a, 2.0)}).unsqueeze(1);
  const Tensor bb = ops::stack({b, ops::neg(b), ops::add(b, 1.0)});
  for (DType dt : {kFloat64, kFloat32}) {
    const Tensor y = ops::matmul(ba.to(dt), bb.to(dt));
    ASSERT_EQ(y.shape(), (Shape{2, 3, 2, 2}));
    const std::vector<double> yv = y.to_vector();
    const std::vector<double> want{19, 22, 43, 50,  -19, -22, -43, -50,  22, 25, 50,  57,
                                   38, 44, 86, 100, -38, -44, -86, -100, 44, 50, 100, 114};
    EXPECT_EQ(yv, want) << dtype_name(dt);
  }
}

TEST(ForwardLinalg, BackwardValues) {
  // Small integers: every product and sum is exact in each dtype, so the gradients must be too.
  // y = x W^T + b with x (2,3), W (2,3); upstream G (2,2): dx = G W, dW = G^T x, db = sum_rows G.
  const Tensor xv = f64({1, 2, 3, 4, 5, 6}, {2, 3}), wv = f64({1, 0, -1, 2, 1, 0}, {2, 3});
  const Tensor bv = f64({0.5, -0.5}, {2}), gv = f64({1, -2, 3, 1}, {2, 2});
  for (DType dt : {kFloat64, kFloat32, kBFloat16, kFloat16}) {
    // Fresh leaves (to() of the same dtype would return the constant itself).
    auto fresh = [dt](const Tensor& v) {
      Tensor t = v.to(dt).clone();
      t.requires_grad_(true);
      return t;
    };
    Tensor x = fresh(xv), w = fresh(wv), b = fresh(bv);
    ops::linear(x, w, b).backward(gv.to(dt));
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{-3, -2, -1, 5, 1, -3})) << dtype_name(dt);
    EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{13, 17, 21, 2, 1, 0})) << dtype_name(dt);
    EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{4, -1})) << dtype_name(dt);
    for (Tensor* t : {&x, &w, &b}) EXPECT_EQ(t->grad().dtype(), dt);
    // matmul: y = x W^T through matmul of a transposed view gives the same gradients.
    Tensor x2 = fresh(xv), w2 = fresh(wv);
    ops::matmul(x2, w2.t()).backward(gv.to(dt));
    EXPECT_EQ(x2.grad().to_vector(), (std::vector<double>{-3, -2, -1, 5, 1, -3})) << dtype_name(dt);
    EXPECT_EQ(w2.grad().to_vector(), (std::vector<double>{13, 17, 21, 2, 1, 0})) << dtype_name(dt);
  }
}

TEST(ForwardLinalg, LinearValues) {
  const Tensor x = f64({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor w = f64({1, 0, -1, 2, 1, 0}, {2, 3});
  const Tensor b = f64({0.5, -0.5}, {2});
  for (DType dt : {kFloat64, kFloat32, kBFloat16, kFloat16}) {
    EXPECT_EQ(ops::linear(x.to(dt), w.to(dt), b.to(dt)).to_vector(), (std::vector<double>{-1.5, 3.5, -1.5, 12.5}))
        << dtype_name(dt);
    EXPECT_EQ(ops::linear(x.to(dt), w.to(dt)).to_vector(), (std::vector<double>{-2, 4, -2, 13})) << dtype_name(dt);
    EXPECT_EQ(ops::linear(x.to(dt), w.to(dt), b.to(dt)).dtype(), dt);
  }
  const Tensor y3 = ops::linear(x.reshape({2, 1, 3}), w, b);
  EXPECT_EQ(y3.shape(), (Shape{2, 1, 2}));
  EXPECT_EQ(ops::linear(f64({1, 2, 3}, {3}), w, b).to_vector(), (std::vector<double>{-1.5, 3.5}));
  EXPECT_EQ(ops::linear(f64({1, 2, 3}, {3}), w, b).shape(), (Shape{2}));
}

// An f32 product against its f64 value `want` on the same f32-rounded inputs: f32 accumulation over
// K terms, |err| <= K * 2^-24 * sum_k |a_ik b_kj| (`mag`) + one rounding of the result (or bias).
void expect_within_f32_gemm_bound(const Tensor& got, const Tensor& want, const Tensor& mag, int64_t K,
                                  const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> g = got.to_vector(), w = want.to_vector(), m = mag.to_vector();
  for (size_t i = 0; i < g.size(); ++i) {
    const double bound = K * std::ldexp(1.0, -24) * m[i] + std::ldexp(1.0, -24) * std::abs(w[i]) + 1e-30;
    ASSERT_LE(std::abs(g[i] - w[i]), bound) << what << " element " << i;
  }
}

// kernels::gemm(a, b, bias) in f32 against the f64 loop, within the bound above.
void expect_f32_gemm_matches_f64(const Tensor& a, const Tensor& b, const Tensor& bias, const std::string& what) {
  const int64_t K = a.size(2);
  const Tensor got = kernels::gemm(a, b, bias, kFloat32);
  const Tensor want =
      kernels::gemm(a.to(kFloat64), b.to(kFloat64), bias.defined() ? bias.to(kFloat64) : bias, kFloat64);
  const Tensor mag = kernels::gemm(ops::abs(a.to(kFloat64)), ops::abs(b.to(kFloat64)), Tensor(), kFloat64);
  ASSERT_NO_FATAL_FAILURE(expect_within_f32_gemm_bound(got, want, mag, K, what));
}

// kernels::sgemm(transa, transb, ...) with beta = 1 onto an existing C whose rows are ldc >= N
// apart, against C + op(A) op(B) in f64 with the bound above; C's columns past N stay as they were.
// `a` holds A in BLAS storage (M x lda for 'N', K x lda for 'T'), `b` holds B (K x ldb for 'N',
// N x ldb for 'T').
void expect_sgemm_beta_one_matches_f64(char transa, char transb, int64_t M, int64_t N, int64_t K, const Tensor& a,
                                       const Tensor& b, int64_t ldc, Generator& gen, const std::string& what) {
  const int64_t lda = a.size(1), ldb = b.size(1);
  const Tensor c0 = randn({M, ldc}, kFloat32, &gen);
  Tensor c = c0.clone();
  kernels::sgemm(transa, transb, M, N, K, a.data_ptr<float>(), lda, b.data_ptr<float>(), ldb, 1.0f,
                 c.data_ptr<float>(), ldc);
  const Tensor op_a = (transa == 'N' ? a.slice(1, 0, K) : a.slice(1, 0, M).t()).to(kFloat64).unsqueeze(0);
  const Tensor op_b = (transb == 'N' ? b.slice(1, 0, N) : b.slice(1, 0, K).t()).to(kFloat64).unsqueeze(0);
  const Tensor want =
      ops::add(kernels::gemm(op_a, op_b, Tensor(), kFloat64).squeeze(0), c0.slice(1, 0, N).to(kFloat64));
  const Tensor mag = kernels::gemm(ops::abs(op_a), ops::abs(op_b), Tensor(), kFloat64).squeeze(0);
  ASSERT_NO_FATAL_FAILURE(expect_within_f32_gemm_bound(c.slice(1, 0, N), want, mag, K, what));
  if (ldc > N) {
    ASSERT_EQ(c.slice(1, N, ldc).to_vector(), c0.slice(1, N, ldc).to_vector()) << what;
  }
}

// kernels::gemm in f32 (dnnl_sgemm for operands with a unit-stride dim, the matmul primitive
// otherwise) against the f64 loop with the bound above, over every layout the ops and the
// attention kernel hand it: plain, transposed, row-strided views, no unit stride at all, broadcast
// batches, a bias (contiguous and strided), and 1-sized dims.
TEST(ForwardLinalg, F32GemmLayoutsMatchF64) {
  Generator gen(7);
  struct Case {
    int64_t ba, bb, M, K, N;
  };
  for (const Case cs : {Case{1, 1, 37, 53, 29}, Case{1, 1, 64, 64, 64}, Case{3, 3, 5, 17, 70}, Case{1, 4, 9, 8, 130},
                        Case{4, 1, 1, 33, 5}, Case{2, 2, 6, 1, 7}, Case{1, 1, 19, 40, 1}}) {
    // layout 0: contiguous; 1: the transpose of a contiguous tensor; 2: every other column of a
    // wider tensor (row stride 2 * cols, unit column stride); 3: no unit stride (every other
    // element of a transposed wider tensor).
    auto make = [&](int64_t batch, int64_t rows, int64_t cols, int layout) {
      switch (layout) {
        case 0: return randn({batch, rows, cols}, kFloat32, &gen);
        case 1: return randn({batch, cols, rows}, kFloat32, &gen).transpose(1, 2);
        case 2: return randn({batch, rows, 2 * cols}, kFloat32, &gen).slice(2, 0, cols);
        default: return randn({batch, 2 * cols, rows}, kFloat32, &gen).slice(1, 0, 2 * cols, 2).transpose(1, 2);
      }
    };
    for (int la = 0; la < 4; ++la) {
      for (int lb = 0; lb < 4; ++lb) {
        for (int with_bias = 0; with_bias < 3; ++with_bias) {
          const Tensor a = make(cs.ba, cs.M, cs.K, la), b = make(cs.bb, cs.K, cs.N, lb);
          const Tensor bias = with_bias == 0   ? Tensor()
                              : with_bias == 1 ? randn({cs.N}, kFloat32, &gen)
                                               : randn({2 * cs.N}, kFloat32, &gen).slice(0, 0, 2 * cs.N, 2);
          ASSERT_NO_FATAL_FAILURE(expect_f32_gemm_matches_f64(
              a, b, bias,
              fmt::format("layouts {},{} bias {} case {}x{}x{} @ {}x{}x{}", la, lb, with_bias, cs.ba, cs.M, cs.K, cs.bb,
                          cs.K, cs.N)));
        }
      }
    }
  }
}

// sgemm computes C = A B^T with a transposed B whose rows lie a multiple of 4 KiB apart and 2..128
// rows of A (8..64 on Intel, or up to 128 against fewer than 128 columns) as C^T = B A^T into
// scratch, transposed back (gemm.cc). Checked against the f64 loop with the bound above, on both
// sides of every switch on either vendor: 1, 2, 8, 64, 128 and 129 rows; B rows 1024
// and 2048 floats apart (K = 1024 and 2048, and K = 1000 in rows of a 1024-wide tensor, as a
// narrowed weight) and 1000 apart (never swapped); 2, 10 and 300 columns; no bias, a bias, a
// strided bias, a broadcast batch of B; and sgemm itself with beta = 1 onto an existing C, with
// C's rows wider than N (never swapped). A transpose with the wrong extent or stride fails it.
TEST(ForwardLinalg, F32GemmWithTransposedBRowsFourKiBApartMatchesF64) {
  Generator gen(11);
  for (const int64_t M : {1, 2, 8, 64, 128, 129}) {
    for (const auto& [K, ld] : {std::pair<int64_t, int64_t>{1024, 1024}, {2048, 2048}, {1000, 1024}, {1000, 1000}}) {
      for (const int64_t N : {2, 10, 300}) {
        for (int variant = 0; variant < 4; ++variant) {
          const std::string what = fmt::format("M {} K {} ld {} N {} variant {}", M, K, ld, N, variant);
          const int64_t batch = variant == 3 ? 2 : 1;
          const Tensor a = randn({batch, M, K}, kFloat32, &gen);
          // B = W^T for a weight W (N x ld), of which the first K columns are used.
          const Tensor w = randn({1, N, ld}, kFloat32, &gen).slice(2, 0, K);
          const Tensor b = w.transpose(1, 2);
          const Tensor bias = variant == 1   ? randn({N}, kFloat32, &gen)
                              : variant == 2 ? randn({2 * N}, kFloat32, &gen).slice(0, 0, 2 * N, 2)
                                             : Tensor();
          ASSERT_NO_FATAL_FAILURE(expect_f32_gemm_matches_f64(a, b, bias, what));
        }
        // sgemm with beta = 1 onto an existing C of row stride ldc (N: may swap; N + 3: never).
        for (const int64_t ldc : {N, N + 3}) {
          ASSERT_NO_FATAL_FAILURE(expect_sgemm_beta_one_matches_f64(
              'N', 'T', M, N, K, randn({M, K}, kFloat32, &gen), randn({N, ld}, kFloat32, &gen), ldc, gen,
              fmt::format("sgemm beta 1 M {} K {} ld {} N {} ldc {}", M, K, ld, N, ldc)));
        }
      }
    }
  }
}

// sgemm computes C = A^T B (a weight gradient dY^T X) whose A has rows a multiple of 4 KiB apart,
// at least 256 rows of C, twice as many as columns, and K >= 768 as C^T = B^T A into scratch,
// transposed back (gemm.cc). Checked against the f64 loop on both sides of every switch (M 255/256,
// N M/2 and M/2 + 1, K 767/768, A's rows 4 KiB apart or not; 1024 x 10 x 1024 and a narrowed
// 600-column gradient in rows 1024 apart also swap), through gemm() (beta 0, a bias, a broadcast
// batch of B) and sgemm itself with beta = 1 onto an existing C whose rows are N (may swap) or
// N + 3 (never) apart, whose columns past N must stay as they were.
TEST(ForwardLinalg, F32GemmWithTransposedARowsFourKiBApartMatchesF64) {
  Generator gen(12);
  struct Case {
    int64_t M, ld, N, K;
  };
  for (const Case cs : {Case{256, 1024, 128, 768}, Case{256, 1024, 129, 768}, Case{255, 1024, 2, 768},
                        Case{256, 1024, 2, 767}, Case{256, 1024, 2, 768}, Case{256, 320, 2, 768},
                        Case{1024, 1024, 10, 1024}, Case{600, 1024, 100, 768}, Case{8, 1024, 4, 1}}) {
    const auto [M, ld, N, K] = cs;
    for (int variant = 0; variant < 3; ++variant) {
      const std::string what = fmt::format("M {} ld {} N {} K {} variant {}", M, ld, N, K, variant);
      const int64_t batch = variant == 2 ? 2 : 1;
      // A = G^T for a gradient G (K x ld) of which the first M columns are used.
      const Tensor g = randn({batch, K, ld}, kFloat32, &gen).slice(2, 0, M);
      const Tensor a = g.transpose(1, 2);
      const Tensor b = randn({1, K, N}, kFloat32, &gen);
      const Tensor bias = variant == 1 ? randn({N}, kFloat32, &gen) : Tensor();
      ASSERT_NO_FATAL_FAILURE(expect_f32_gemm_matches_f64(a, b, bias, what));
    }
    for (const int64_t ldc : {N, N + 3}) {
      ASSERT_NO_FATAL_FAILURE(expect_sgemm_beta_one_matches_f64(
          'T', 'N', M, N, K, randn({K, ld}, kFloat32, &gen), randn({K, N}, kFloat32, &gen), ldc, gen,
          fmt::format("sgemm beta 1 M {} ld {} N {} K {} ldc {}", M, ld, N, K, ldc)));
    }
  }
}

TEST(ForwardSoftmax, ValuesAndNormalisation) {
  const Tensor x = f64({1, 2, 3}, {3});
  const std::vector<double> s = ops::softmax(x, 0).to_vector();
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(s[i], std::exp(i + 1.0) / z, 1e-15);
  const std::vector<double> ls = ops::log_softmax(x, 0).to_vector();
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(ls[i], i + 1.0 - std::log(z), 1e-14);
  // Large logits do not overflow (max subtracted).
  const std::vector<double> big = ops::softmax(f64({1000, 1000}, {2}), 0).to_vector();
  EXPECT_EQ(big, (std::vector<double>{0.5, 0.5}));
  EXPECT_NEAR(ops::log_softmax(f64({1000, 0}, {2}), 0).to_vector()[1], -1000.0, 1e-9);
  // Every slice along the softmax dim sums to 1, for each dim of a 3-d tensor.
  Generator g(5);
  const Tensor t = randn({2, 3, 4}, kFloat64, &g);
  for (int64_t d : {0, 1, 2, -1}) {
    const Tensor sm = ops::softmax(t, d);
    EXPECT_TRUE(testing::all_close(ops::sum(sm, {d}), ones(ops::sum(sm, {d}).shape(), kFloat64), 0, 1e-14)) << d;
    EXPECT_TRUE(testing::all_close(ops::exp(ops::log_softmax(t, d)), sm, 1e-13, 1e-15)) << d;
    for (DType dt : {kFloat32, kBFloat16}) {
      const Tensor s2 = ops::softmax(t.to(dt), d);
      EXPECT_EQ(s2.dtype(), dt);
      EXPECT_TRUE(testing::all_close(ops::sum(s2.to(kFloat64), {d}), ones(ops::sum(sm, {d}).shape(), kFloat64), 0,
                                     dt == kFloat32 ? 1e-6 : 2 * std::ldexp(1.0, -8)))
          << d << " " << dtype_name(dt);
    }
  }
  // Element (i, j, k) of softmax over dim 1 by hand.
  const std::vector<double> tv = t.to_vector(), s1 = ops::softmax(t, 1).to_vector();
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      double zz = 0;
      for (int j = 0; j < 3; ++j) zz += std::exp(tv[i * 12 + j * 4 + k]);
      for (int j = 0; j < 3; ++j) EXPECT_NEAR(s1[i * 12 + j * 4 + k], std::exp(tv[i * 12 + j * 4 + k]) / zz, 1e-15);
    }
}

// Cross entropy of one row by hand: -(1-eps) log p_t - eps/C sum_c log p_c.
double ce_row(const std::vector<double>& x, int64_t t, double eps) {
  double m = x[0];
  for (double v : x) m = std::max(m, v);
  double z = 0;
  for (double v : x) z += std::exp(v - m);
  const double lse = m + std::log(z);
  double sum_logp = 0;
  for (double v : x) sum_logp += v - lse;
  return -(1 - eps) * (x[static_cast<size_t>(t)] - lse) - eps / static_cast<double>(x.size()) * sum_logp;
}

TEST(ForwardLoss, CrossEntropyByHand) {
  const std::vector<std::vector<double>> rows{{0.5, -1.0, 2.0, 0.0}, {1.5, 1.5, -0.5, 3.0}, {-2.0, 0.1, 0.2, 0.3}};
  std::vector<double> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  const Tensor x = f64(flat, {3, 4});
  const Tensor t = i64({2, 0, 3}, {3});
  for (double eps : {0.0, 0.1}) {
    std::vector<double> per;
    for (int r = 0; r < 3; ++r) per.push_back(ce_row(rows[r], t.to_vector()[r], eps));
    const double total = per[0] + per[1] + per[2];
    EXPECT_NEAR(ops::cross_entropy(x, t, {.label_smoothing = eps}).item(), total / 3, 1e-14) << eps;
    EXPECT_NEAR(ops::cross_entropy(x, t, {.label_smoothing = eps, .reduction = "sum"}).item(), total, 1e-14) << eps;
    const Tensor none = ops::cross_entropy(x, t, {.label_smoothing = eps, .reduction = "none"});
    EXPECT_EQ(none.shape(), (Shape{3}));
    EXPECT_TRUE(testing::all_close(none, f64(per, {3}), 1e-14, 1e-15)) << eps;
    // Ignored targets contribute 0 and are not counted in the mean.
    const Tensor ti = i64({2, -100, 3}, {3});
    EXPECT_NEAR(ops::cross_entropy(x, ti, {.label_smoothing = eps}).item(), (per[0] + per[2]) / 2, 1e-14) << eps;
    EXPECT_EQ(ops::cross_entropy(x, ti, {.label_smoothing = eps, .reduction = "none"}).to_vector()[1], 0.0);
    const Tensor t0 = i64({0, 0, 3}, {3});
    const double p0 = ce_row(rows[0], 0, eps), p1 = ce_row(rows[1], 0, eps);
    EXPECT_NEAR(ops::cross_entropy(x, t0, {.ignore_index = 3, .label_smoothing = eps}).item(), (p0 + p1) / 2, 1e-14);
    // f32 input: f32 loss, same value to f32 accuracy.
    const Tensor l32 = ops::cross_entropy(x.to(kFloat32), t, {.label_smoothing = eps});
    EXPECT_EQ(l32.dtype(), kFloat32);
    EXPECT_NEAR(l32.item(), total / 3, 1e-6);
  }
  // Label smoothing by hand on a 2-class row: x = (0, ln 3) -> p = (1/4, 3/4), target 1, eps 0.1:
  // loss = -0.95 ln(3/4) - 0.05 ln(1/4).
  const double hand = -0.95 * std::log(0.75) - 0.05 * std::log(0.25);
  EXPECT_NEAR(ops::cross_entropy(f64({0, std::log(3.0)}, {1, 2}), i64({1}, {1}), {.label_smoothing = 0.1}).item(), hand,
              1e-15);
  // 1-d input with a 0-d target, and a 4-d input.
  EXPECT_NEAR(ops::cross_entropy(f64(rows[1], {4}), i64({3}, {})).item(), ce_row(rows[1], 3, 0.0), 1e-14);
  EXPECT_EQ(ops::cross_entropy(f64(rows[1], {4}), i64({3}, {}), {.reduction = "none"}).dim(), 0);
  // (N=1, C=4, H=1, W=3) whose spatial positions are the rows above.
  const Tensor x4 = f64(flat, {3, 4}).t().reshape({1, 4, 1, 3});
  const Tensor t4 = i64({2, 0, 3}, {1, 1, 3});
  const Tensor n4 = ops::cross_entropy(x4, t4, {.reduction = "none"});
  EXPECT_EQ(n4.shape(), (Shape{1, 1, 3}));
  EXPECT_TRUE(testing::all_close(n4.reshape({3}), ops::cross_entropy(x, t, {.reduction = "none"}), 1e-14, 0));
}

// A class at -inf (a masked vocabulary entry) leaves the loss finite, as in PyTorch: without
// smoothing the sum of all log-probabilities is not used (0 * -inf was NaN), and with class
// weights the target is selected, not multiplied by a one-hot. torch 2.x values.
TEST(ForwardLoss, CrossEntropyWithAClassAtMinusInfinityIsFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor x = f64({0, -inf, 1, 2, 0, -inf}, {2, 3});
  x.requires_grad_(true);
  const Tensor t = i64({0, 1}, {2});
  EXPECT_NEAR(ops::cross_entropy(x, t).item(), 1.7200948492, 1e-9);
  ops::CrossEntropyOptions o;
  o.weight = f64({1, 2, 3}, {3});
  const Tensor lw = ops::cross_entropy(x, t, o);
  EXPECT_NEAR(lw.item(), 1.8557059032, 1e-9);
  lw.backward();
  const std::vector<double> g = x.grad().to_vector();
  const std::vector<double> want = {-0.2437, 0, 0.2437, 0.5872, -0.5872, 0};
  for (size_t k = 0; k < g.size(); ++k) EXPECT_NEAR(g[k], want[k], 1e-4) << k;
  // Smoothing with an ignored row holding -inf: that row is 0, not NaN (torch 2.x values).
  const Tensor x2 = f64({0, 0.5, 1, 2, 0, -inf}, {2, 3});
  o.label_smoothing = 0.1;
  o.ignore_index = 1;
  EXPECT_NEAR(ops::cross_entropy(x2, t, o).item(), 1.7149633044, 1e-9);
  EXPECT_NEAR(ops::cross_entropy(x2, t, {.ignore_index = 1, .label_smoothing = 0.1}).item(), 1.6302696706, 1e-9);
  // The weight gets no gradient: one that requires it is refused (PyTorch refuses it too).
  Tensor w = f64({1, 2, 3}, {3});
  w.requires_grad_(true);
  o.weight = w;
  EXPECT_THROW(ops::cross_entropy(x, t, o), AutogradError);
}

TEST(ForwardLoss, NllAndMse) {
  const Tensor lp = f64({-0.1, -2.0, -3.0, -1.2, -0.4, -2.5}, {2, 3});
  EXPECT_NEAR(ops::nll_loss(lp, i64({0, 2}, {2})).item(), (0.1 + 2.5) / 2, 1e-15);
  EXPECT_NEAR(ops::nll_loss(lp, i64({0, 2}, {2}), {.reduction = "sum"}).item(), 2.6, 1e-15);
  EXPECT_EQ(ops::nll_loss(lp, i64({1, 1}, {2}), {.reduction = "none"}).to_vector(), (std::vector<double>{2.0, 0.4}));
  EXPECT_NEAR(ops::nll_loss(lp, i64({1, -100}, {2})).item(), 2.0, 1e-15);
  EXPECT_NEAR(ops::nll_loss(lp, i64({1, 0}, {2}), {.ignore_index = 0}).item(), 2.0, 1e-15);
  EXPECT_NEAR(ops::nll_loss(f64({-0.1, -2.0, -3.0}, {3}), i64({1}, {})).item(), 2.0, 1e-15);
  // nll(log_softmax) == cross_entropy.
  EXPECT_NEAR(ops::nll_loss(ops::log_softmax(lp, 1), i64({0, 2}, {2})).item(),
              ops::cross_entropy(lp, i64({0, 2}, {2})).item(), 1e-15);
  const Tensor a = f64({1, 2, 3, 4}, {2, 2}), b = f64({0, 2, 5, 3}, {2, 2});
  EXPECT_EQ(ops::mse_loss(a, b).item(), 1.5);
  EXPECT_EQ(ops::mse_loss(a, b, "sum").item(), 6.0);
  EXPECT_EQ(ops::mse_loss(a, b, "none").to_vector(), (std::vector<double>{1, 0, 4, 1}));
}

TEST(ForwardDropout, MaskAndScaling) {
  const Tensor x = full({100, 100}, 2.0, kFloat64);
  for (double p : {0.1, 0.5, 0.9}) {
    Generator g(7);
    const std::vector<double> y = ops::dropout(x, p, true, &g).to_vector();
    int64_t zeros_n = 0;
    for (double v : y) {
      if (v == 0)
        ++zeros_n;
      else
        EXPECT_NEAR(v, 2.0 / (1.0 - p), 1e-12);
    }
    // 10000 Bernoulli(p): the dropped fraction is within 5 standard deviations of p.
    const double sd = std::sqrt(p * (1 - p) / 10000.0);
    EXPECT_NEAR(static_cast<double>(zeros_n) / 10000.0, p, 5 * sd) << p;
    // Same seed, same mask; different seed, different mask.
    Generator g2(7), g3(8);
    EXPECT_EQ(ops::dropout(x, p, true, &g2).to_vector(), y);
    EXPECT_NE(ops::dropout(x, p, true, &g3).to_vector(), y);
  }
  Generator g(1);
  EXPECT_TRUE(ops::dropout(x, 0.5, false, &g).is_same(x));  // eval: identity
  EXPECT_TRUE(ops::dropout(x, 0.0, true, &g).is_same(x));
  EXPECT_EQ(ops::dropout(x, 1.0, true, &g).to_vector(), std::vector<double>(10000, 0.0));
  // The generator advances: two calls give different masks.
  Generator g4(3);
  EXPECT_NE(ops::dropout(x, 0.5, true, &g4).to_vector(), ops::dropout(x, 0.5, true, &g4).to_vector());
  // bf16 keeps its dtype; survivors are exactly 2 * 2 = 4.
  Generator g5(3);
  const Tensor yb = ops::dropout(x.to(kBFloat16), 0.5, true, &g5);
  EXPECT_EQ(yb.dtype(), kBFloat16);
  for (double v : yb.to_vector()) EXPECT_TRUE(v == 0.0 || v == 4.0) << v;
}

TEST(ForwardShape, ViewsAndCopies) {
  const Tensor x = f64({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {2, 3, 2});
  EXPECT_EQ(x.permute({2, 0, 1}).contiguous().to_vector(), (std::vector<double>{0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(x.transpose(0, 1).contiguous().to_vector(), (std::vector<double>{0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11}));
  EXPECT_EQ(x.slice(1, 0, 3, 2).to_vector(), (std::vector<double>{0, 1, 4, 5, 6, 7, 10, 11}));
  EXPECT_EQ(x.slice(1, -2, 100).to_vector(), (std::vector<double>{2, 3, 4, 5, 8, 9, 10, 11}));
  EXPECT_EQ(x.narrow(2, 1, 1).to_vector(), (std::vector<double>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(x.select(1, -1).to_vector(), (std::vector<double>{4, 5, 10, 11}));
  EXPECT_EQ(x.select(1, -1).shape(), (Shape{2, 2}));
  EXPECT_EQ(x.flatten(1).shape(), (Shape{2, 6}));
  EXPECT_EQ(x.flatten(0, 1).shape(), (Shape{6, 2}));
  EXPECT_EQ(x.view({-1, 4}).shape(), (Shape{3, 4}));
  EXPECT_EQ(x.transpose(1, 2).reshape({2, 6}).to_vector(), (std::vector<double>{0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11}));
  EXPECT_EQ(x.narrow(1, 0, 1).expand({2, 4, 2}).to_vector(),
            (std::vector<double>{0, 1, 0, 1, 0, 1, 0, 1, 6, 7, 6, 7, 6, 7, 6, 7}));
  EXPECT_EQ(x.unsqueeze(1).shape(), (Shape{2, 1, 3, 2}));
  EXPECT_EQ(x.unsqueeze(-1).shape(), (Shape{2, 3, 2, 1}));
  EXPECT_EQ(x.unsqueeze(1).squeeze(1).shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(x.squeeze(0).shape(), (Shape{2, 3, 2}));
  // Views share storage; clone does not.
  Tensor y = x.clone();
  Tensor v = y.view({12});
  v.fill_(1.0);
  EXPECT_EQ(y.to_vector(), std::vector<double>(12, 1.0));
  EXPECT_EQ(x.to_vector()[5], 5.0);  // the original is untouched
  EXPECT_TRUE(x.to(kFloat64).is_same(x));
  // to() of strided views converts element by element in view order, and its gradient comes
  // back in the source dtype.
  for (DType dt : {kFloat32, kBFloat16, kFloat16}) {
    const Tensor c = x.permute({2, 0, 1}).slice(2, 0, 3, 2).to(dt);
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_EQ(c.to_vector(), (std::vector<double>{0, 4, 6, 10, 1, 5, 7, 11})) << dtype_name(dt);
  }
  Tensor p = param({0.5, 1.5, -2.0, 3.0}, {2, 2});
  Tensor q = p.t().to(kFloat32);
  ops::sum(ops::mul(q, tensor(std::vector<double>{1, 2, 3, 4}, {2, 2}, kFloat32))).backward();
  EXPECT_EQ(p.grad().dtype(), kFloat64);
  EXPECT_EQ(p.grad().to_vector(), (std::vector<double>{1, 3, 2, 4}));
}

TEST(ForwardShape, CatStackSplitGather) {
  const Tensor a = f64({1, 2, 3, 4}, {2, 2}), b = f64({5, 6}, {1, 2}), c = f64({7, 8, 9, 10, 11, 12}, {3, 2});
  EXPECT_EQ(ops::cat({a, b, c}, 0).to_vector(), (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(ops::cat({a, a.t(), f64({0, 0}, {2, 1})}, 1).to_vector(),
            (std::vector<double>{1, 2, 1, 3, 0, 3, 4, 2, 4, 0}));
  EXPECT_EQ(ops::cat({a, b.to(kFloat32)}, 0).dtype(), kFloat64);
  EXPECT_EQ(ops::stack({a, a}, 1).to_vector(), (std::vector<double>{1, 2, 1, 2, 3, 4, 3, 4}));
  EXPECT_EQ(ops::stack({a, a}, -1).to_vector(), (std::vector<double>{1, 1, 2, 2, 3, 3, 4, 4}));
  EXPECT_EQ(ops::stack({a, a}, 2).shape(), (Shape{2, 2, 2}));
  const Tensor r = f64({0, 1, 2, 3, 4, 5, 6}, {7});
  std::vector<Tensor> s = ops::split(r, 3);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[2].to_vector(), (std::vector<double>{6}));
  std::vector<Tensor> sw = ops::split_with_sizes(r, {2, 0, 5});
  ASSERT_EQ(sw.size(), 3u);
  EXPECT_EQ(sw[1].numel(), 0);
  EXPECT_EQ(sw[2].to_vector(), (std::vector<double>{2, 3, 4, 5, 6}));
  auto sizes = [](const std::vector<Tensor>& v) {
    std::vector<int64_t> out;
    for (const Tensor& t : v) out.push_back(t.numel());
    return out;
  };
  EXPECT_EQ(sizes(ops::chunk(r, 3)), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(sizes(ops::chunk(r, 7)), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(sizes(ops::chunk(r, 10)), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(sizes(ops::chunk(f64({0, 1, 2, 3, 4, 5}, {6}), 4)), (std::vector<int64_t>{2, 2, 2}));  // PyTorch: 3 chunks
  EXPECT_EQ(ops::index_select(c, 0, i64({2, 0, 2}, {3})).to_vector(), (std::vector<double>{11, 12, 7, 8, 11, 12}));
  EXPECT_EQ(ops::index_select(c, 1, i64({1, 1, 0}, {3})).to_vector(),
            (std::vector<double>{8, 8, 7, 10, 10, 9, 12, 12, 11}));
  EXPECT_EQ(ops::index_select(c.t(), 0, i64({1}, {1})).to_vector(), (std::vector<double>{8, 10, 12}));
  EXPECT_EQ(ops::index_select(c, 0, i64({1, 0}, {2}).to(kInt32)).to_vector(), (std::vector<double>{9, 10, 7, 8}));
  const Tensor e = ops::embedding(c, i64({2, 2, 0, 1}, {2, 2}));
  EXPECT_EQ(e.shape(), (Shape{2, 2, 2}));
  EXPECT_EQ(e.to_vector(), (std::vector<double>{11, 12, 11, 12, 7, 8, 9, 10}));
  // Gradients of duplicate indices add up.
  Tensor w = param({1, 2, 3, 4, 5, 6}, {3, 2});
  ops::sum(ops::index_select(w, 0, i64({2, 0, 2}, {3}))).backward();
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{1, 1, 0, 0, 2, 2}));
  Tensor w2 = param({1, 2, 3, 4, 5, 6}, {3, 2});
  ops::sum(ops::embedding(w2, i64({2, 2, 0, 2}, {4}), 0)).backward();
  EXPECT_EQ(w2.grad().to_vector(), (std::vector<double>{0, 0, 0, 0, 3, 3}));
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// Sets the intra-op thread count for a scope.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : prev_(get_num_threads()) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(prev_); }

 private:
  int prev_;
};

// Tensors large enough that the kernels split their loops into several parallel chunks (the
// elementwise grain is 32768 elements); results must not depend on the thread count.
TEST(ForwardLarge, ParallelChunksMatchReference) {
  Generator g(11);
  const int64_t R = 3, N = 50000;
  const Tensor a = randn({R, N}, kFloat64, &g), b = randn({N}, kFloat64, &g);
  const std::vector<double> av = a.to_vector(), bv = b.to_vector();
  for (int threads : {1, 4}) {
    ThreadCount tc(threads);
    // Broadcast binary op and a unary op on a transposed view.
    const std::vector<double> s = ops::mul(a, b).to_vector();
    const std::vector<double> e = ops::exp(a.t()).to_vector();
    const std::vector<double> srow = ops::sum(a, {1}).to_vector(), scol = ops::sum(a, {0}).to_vector();
    size_t bad = 0;
    for (int64_t r = 0; r < R; ++r) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) {
        const double x = av[r * N + n];
        bad += s[r * N + n] != x * bv[n];
        bad += e[n * R + r] != std::exp(x);
        acc += x;
      }
      EXPECT_NEAR(srow[r], acc, 1e-9) << threads;
    }
    for (int64_t n = 0; n < N; n += 997) EXPECT_NEAR(scol[n], av[n] + av[N + n] + av[2 * N + n], 1e-12);
    // One long strided row (every other element): split across threads by element offset.
    const std::vector<double> st = ops::mul(a.reshape({-1}).slice(0, 1, R * N, 2), 2.0).to_vector();
    for (size_t k = 0; k < st.size(); ++k) bad += st[k] != 2.0 * av[2 * k + 1];
    EXPECT_EQ(bad, 0u) << threads;
    // Softmax and cross entropy over many rows.
    const Tensor logits = a.reshape({-1, 10});
    const Tensor sm = ops::softmax(logits, 1);
    EXPECT_TRUE(testing::all_close(ops::sum(sm, {1}), ones({R * N / 10}, kFloat64), 0, 1e-12)) << threads;
    const Tensor tgt = randint(0, 10, {R * N / 10}, &g);
    const std::vector<double> lv = logits.to_vector(), tv = tgt.to_vector();
    const std::vector<double> ce = ops::cross_entropy(logits, tgt, {.reduction = "none"}).to_vector();
    for (size_t r = 0; r < ce.size(); r += 1499) {
      std::vector<double> row(lv.begin() + static_cast<long>(r * 10), lv.begin() + static_cast<long>(r * 10 + 10));
      EXPECT_NEAR(ce[r], ce_row(row, static_cast<int64_t>(tv[r]), 0.0), 1e-12) << r;
    }
  }
  // The dropout mask depends only on the generator, not on the thread count.
  std::vector<double> masks[2];
  for (int k = 0; k < 2; ++k) {
    ThreadCount tc(k == 0 ? 1 : 4);
    Generator gd(5);
    masks[k] = ops::dropout(a, 0.3, true, &gd).to_vector();
  }
  EXPECT_EQ(masks[0], masks[1]);
}

// The benches' GEMM / convolution timers: off, nothing is counted; on, each oneDNN call is
// counted once with its 2 x multiply-adds (a conv counts the padded taps, as oneDNN computes them).
TEST(KernelTiming, CountsCallsAndFlopsOnlyWhenOn) {
  using kernels::KernelKind;
  Generator gen(3);
  const Tensor a = randn({2, 37, 53}, kFloat32, &gen), b = randn({2, 53, 29}, kFloat32, &gen);
  const Tensor x = randn({2, 3, 9, 9}, kFloat32, &gen), w = randn({4, 3, 3, 3}, kFloat32, &gen);
  kernels::reset_kernel_timing();
  (void)ops::matmul(a, b);
  (void)ops::conv2d(x, w, Tensor(), {.stride = {2, 2}, .padding = {1, 1}});
  EXPECT_EQ(kernels::kernel_time(KernelKind::gemm).calls, 0);
  EXPECT_EQ(kernels::kernel_time(KernelKind::conv).calls, 0);

  kernels::set_kernel_timing(true);
  (void)ops::matmul(a, b);
  (void)ops::conv2d(x, w, Tensor(), {.stride = {2, 2}, .padding = {1, 1}});
  kernels::set_kernel_timing(false);
  const kernels::KernelTime g = kernels::kernel_time(KernelKind::gemm), c = kernels::kernel_time(KernelKind::conv);
  // f32: one dnnl_sgemm per batch entry.
  EXPECT_EQ(g.calls, 2);
  EXPECT_EQ(g.flops, 2.0 * 2 * 37 * 53 * 29);
  EXPECT_GT(g.seconds, 0.0);
  EXPECT_EQ(c.calls, 1);
  EXPECT_EQ(c.flops, 2.0 * (2 * 4 * 5 * 5) * (3 * 3 * 3));  // output 2x4x5x5, 27 taps each
  EXPECT_GT(c.seconds, 0.0);
  (void)ops::matmul(a, b);
  EXPECT_EQ(kernels::kernel_time(KernelKind::gemm).calls, 2);
  kernels::reset_kernel_timing();
  EXPECT_EQ(kernels::kernel_time(KernelKind::gemm).calls, 0);
  EXPECT_EQ(kernels::kernel_time(KernelKind::gemm).flops, 0.0);
}

// nn.Linear(0, out) works in PyTorch: the output is the bias, the gradients are empty for x and
// w and the row count for b. (reshape({-1, 0}) could not infer the rows and threw.)
TEST(ForwardLinalg, LinearWithNoInputFeaturesIsTheBias) {
  Tensor x = zeros({3, 0}, kFloat64);
  Tensor w = zeros({5, 0}, kFloat64);
  Tensor b = f64({1, 2, 3, 4, 5}, {5});
  x.requires_grad_(true);
  w.requires_grad_(true);
  b.requires_grad_(true);
  const Tensor y = ops::linear(x, w, b);
  EXPECT_EQ(y.shape(), (Shape{3, 5}));
  EXPECT_EQ(y.to_vector(), ops::add(zeros({3, 5}, kFloat64), b.detach()).to_vector());
  ops::sum(y).backward();
  EXPECT_EQ(x.grad().shape(), (Shape{3, 0}));
  EXPECT_EQ(w.grad().shape(), (Shape{5, 0}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<double>(5, 3.0)));
  EXPECT_EQ(ops::linear(zeros({2, 4, 0}, kFloat64), w, b).shape(), (Shape{2, 4, 5}));
}

}  // namespace
}  // namespace tandem
