// Relaxed checks in bf16 and f16. Each op runs on 16-bit inputs and, separately, in f64 on the
// very same (already rounded, hence exactly representable) values; forward outputs and
// gradients through autograd are compared with error bounds derived from the formats:
//
//   unit roundoff u: bf16 2^-8 (8 significand bits), f16 2^-11 (11 bits); f32 2^-24.
//   Rounding a value v to the format changes it by at most u*|v| (round to nearest, normal
//   range; every value here stays far above f16's smallest normal 6.1e-5).
//   16-bit ops compute in f32 and round once, so a result that is a single rounding of an f32
//   computation is within u*|ref| + (f32 error); r chained roundings give about r*u*|ref|.
//   A sum of n terms accumulated in f32 is within n*2^-24*sum|t_i| (gamma_n) before its final
//   rounding; terms that were themselves rounded add u*sum|t_i|.
//
// So each check is |lp - ref| <= r*u*|ref| + a*M, elementwise, where M is the sum of the
// magnitudes of the terms (the same computation run on |inputs| and |upstream gradient| for the
// multilinear ops: add, mul, div, sum, matmul, linear), or an explicit formula (softmax, losses),
// and r, a carry a factor 2 of safety over the first-order bound stated at each check.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/ops_test_util.h"

namespace tandem {
namespace {

using ops_test::i64;
using testing::leaf;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

const double kF32U = std::ldexp(1.0, -24);

double unit_roundoff(DType dt) { return dt == kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11); }

Tensor absd(const Tensor& t) {
  NoGradGuard ng;
  return ops::abs(t.detach().to(kFloat64));
}

// |actual - ref| <= rel * |ref| + abs_term elementwise (abs_term broadcasts; NaNs fail).
::testing::AssertionResult within(const Tensor& actual, const Tensor& ref, double rel, const Tensor& abs_term) {
  if (actual.shape() != ref.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.shape()) << " vs " << shape_str(ref.shape());
  NoGradGuard ng;
  const std::vector<double> a = actual.detach().to(kFloat64).to_vector(), e = ref.detach().to(kFloat64).to_vector();
  const std::vector<double> b = abs_term.to(kFloat64).expand(ref.shape()).contiguous().to_vector();
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    const double bound = rel * std::abs(e[i]) + b[i];
    const double err = std::abs(a[i] - e[i]);
    if (!(err <= bound)) {
      ++bad;
      if (!(err - bound <= worst_excess)) worst_excess = err - bound, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const double bound = rel * std::abs(e[worst]) + b[worst];
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements out of bounds; worst at " << worst
                                       << ": "
                                       << fmt::format("{:.8g} vs ref {:.8g} (error {:.3g}, bound {:.3g})", a[worst],
                                                      e[worst], std::abs(a[worst] - e[worst]), bound);
}
::testing::AssertionResult within(const Tensor& actual, const Tensor& ref, double rel, double abs_term) {
  return within(actual, ref, rel, scalar_tensor(abs_term, kFloat64));
}

// One op run in a 16-bit dtype and in f64 on the same values.
struct LowpRun {
  std::vector<Tensor> x_lp, x_ref;  // floating inputs require grad; integer inputs pass through
  Tensor y_lp, y_ref;
  Tensor g_ref;                       // the upstream gradient, exact in y_lp's dtype
  std::vector<Tensor> gx_lp, gx_ref;  // one per floating input
  std::vector<size_t> floating;       // indices of the floating inputs
};

LowpRun run_lowp(const Fn& fn, const std::vector<Tensor>& values, DType dt, uint64_t seed = 1) {
  LowpRun r;
  for (size_t i = 0; i < values.size(); ++i) {
    const Tensor v = values[i].detach();
    if (!is_floating(v.dtype())) {
      r.x_lp.push_back(v);
      r.x_ref.push_back(v);
      continue;
    }
    Tensor lp = v.to(dt).clone();
    Tensor ref = lp.to(kFloat64);  // exact: every 16-bit value is an f64
    lp.requires_grad_(true);
    ref.requires_grad_(true);
    r.x_lp.push_back(lp);
    r.x_ref.push_back(ref);
    r.floating.push_back(i);
  }
  r.y_lp = fn(r.x_lp);
  r.y_ref = fn(r.x_ref);
  Generator g(seed + 1000);
  Tensor w = rand(r.y_lp.shape(), kFloat64, &g);
  w.mul_(2.0);
  w.add_(full({}, -1.0, kFloat64));  // uniform [-1, 1)
  const Tensor g_lp = w.to(r.y_lp.dtype());
  r.g_ref = g_lp.to(kFloat64);
  std::vector<Tensor> lp_leaves, ref_leaves;
  for (size_t i : r.floating) lp_leaves.push_back(r.x_lp[i]), ref_leaves.push_back(r.x_ref[i]);
  r.gx_lp = autograd::grad({r.y_lp}, lp_leaves, {g_lp});
  r.gx_ref = autograd::grad({r.y_ref}, ref_leaves, {r.g_ref});
  return r;
}

// The magnitudes M of a multilinear op: fn on |inputs| and its gradients for |upstream|.
struct Magnitudes {
  Tensor y;
  std::vector<Tensor> gx;
};
Magnitudes magnitudes(const Fn& fn, const LowpRun& r) {
  std::vector<Tensor> in;
  std::vector<Tensor> leaves;
  for (size_t i = 0; i < r.x_ref.size(); ++i) {
    if (!is_floating(r.x_ref[i].dtype())) {
      in.push_back(r.x_ref[i]);
      continue;
    }
    Tensor a = absd(r.x_ref[i]);
    a.requires_grad_(true);
    in.push_back(a);
    leaves.push_back(a);
  }
  Magnitudes m;
  Tensor y = fn(in);
  m.y = absd(y);
  for (const Tensor& g : autograd::grad({y}, leaves, {absd(r.g_ref)})) m.gx.push_back(absd(g));
  return m;
}

std::string label(const std::string& op, DType dt) { return op + " in " + std::string(dtype_name(dt)); }

// Common expectations: output dtype, gradient dtypes equal the input dtype, nothing NaN.
void expect_dtypes(const LowpRun& r, DType out_dtype, DType dt, const std::string& what) {
  EXPECT_EQ(r.y_lp.dtype(), out_dtype) << what;
  ASSERT_EQ(r.gx_lp.size(), r.floating.size()) << what;
  for (const Tensor& g : r.gx_lp) {
    ASSERT_TRUE(g.defined()) << what;
    EXPECT_EQ(g.dtype(), dt) << what << ": gradient dtype";
  }
}

const DType kLowp[] = {kBFloat16, kFloat16};

// ---------------------------------------------------------------- elementwise

struct UnaryCase {
  const char* name;
  Fn fn;
  double lo, hi;
};

TEST(LowPrecision, UnaryElementwise) {
  const std::vector<UnaryCase> cases{
      {"neg", [](const auto& v) { return ops::neg(v[0]); }, -2, 2},
      {"exp", [](const auto& v) { return ops::exp(v[0]); }, -2, 2},
      {"log", [](const auto& v) { return ops::log(v[0]); }, 0.1, 4},
      {"sqrt", [](const auto& v) { return ops::sqrt(v[0]); }, 0.1, 4},
      {"rsqrt", [](const auto& v) { return ops::rsqrt(v[0]); }, 0.2, 4},
      {"square", [](const auto& v) { return ops::square(v[0]); }, -2, 2},
      {"abs", [](const auto& v) { return ops::abs(v[0]); }, -2, 2},
      {"pow 1.5", [](const auto& v) { return ops::pow(v[0], 1.5); }, 0.1, 3},
      {"pow -0.5", [](const auto& v) { return ops::pow(v[0], -0.5); }, 0.2, 3},
      {"pow 3", [](const auto& v) { return ops::pow(v[0], 3.0); }, -2, 2},
      {"relu", [](const auto& v) { return ops::relu(v[0]); }, -2, 2},
      {"gelu", [](const auto& v) { return ops::gelu(v[0]); }, -3, 3},
      {"gelu tanh", [](const auto& v) { return ops::gelu(v[0], "tanh"); }, -3, 3},
      {"sigmoid", [](const auto& v) { return ops::sigmoid(v[0]); }, -3, 3},
      {"tanh", [](const auto& v) { return ops::tanh(v[0]); }, -2, 2},
      {"clamp", [](const auto& v) { return ops::clamp(v[0], -0.5, 1.0); }, -2, 2},
      {"add scalar", [](const auto& v) { return ops::add(v[0], 0.75); }, -2, 2},
      {"mul scalar", [](const auto& v) { return ops::mul(v[0], -1.3); }, -2, 2},
      {"div scalar", [](const auto& v) { return ops::div(v[0], 3.0); }, -2, 2},
      {"rsub", [](const auto& v) { return ops::rsub(v[0], 1.0); }, -2, 2},
  };
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    for (const UnaryCase& c0 : cases) {
      // Contiguous, transposed (dense, non-contiguous) and stepped (strided) inputs take
      // different loops.
      for (int layout = 0; layout < 3; ++layout) {
        const std::function<Tensor(const Tensor&)> lay = [layout](const Tensor& t) {
          return layout == 0 ? t : layout == 1 ? t.t() : t.slice(1, 1, 16, 3);
        };
        const Fn f0 = c0.fn;
        const UnaryCase c{c0.name, [f0, lay](const auto& v) { return f0({lay(v[0])}); }, c0.lo, c0.hi};
        const std::string what = label(c.name, dt) + (layout == 0 ? "" : layout == 1 ? " transposed" : " stepped");
        const LowpRun r = run_lowp(c.fn, {leaf({4, 16}, c.lo, c.hi, 7)}, dt);
        expect_dtypes(r, dt, dt, what);
        // Forward: one rounding of an f32 result (f32 error < 2^-20 here, mostly relative; the
        // absolute 2^-20 covers gelu's 1 + erf(x) cancellation at negative x): 2u|ref| + 2^-20.
        EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, std::ldexp(1.0, -20))) << what << " forward";
        // Backward: g * f'(x) in f32, rounded once; f' may use the saved (rounded) output y, whose
        // error u|y| moves f' by at most u*|ref| (exp, sqrt, rsqrt: relative) or u*|g| (tanh:
        // 2y^2 u|g| <= 2u|g|, sigmoid: |1-2y| y u|g| <= u|g|): 4u|ref| + 4u|g|.
        // (|g| is the upstream gradient of each input element: scattered back through the layout.)
        Tensor z = zeros({4, 16}, kFloat64);
        z.requires_grad_(true);
        const Tensor ag = ops::mul(absd(autograd::grad({lay(z)}, {z}, {absd(r.g_ref)})[0]), 4 * u);
        EXPECT_TRUE(within(r.gx_lp[0], r.gx_ref[0], 4 * u, ag)) << what << " backward";
      }
    }
  }
}

struct BinaryCase {
  const char* name;
  Fn fn;
  Fn magnitude_fn;  // the same op with every sign made positive (sub -> add)
};

TEST(LowPrecision, BinaryBroadcast) {
  const std::vector<BinaryCase> cases{
      {"add", [](const auto& v) { return ops::add(v[0], v[1]); }, [](const auto& v) { return ops::add(v[0], v[1]); }},
      {"add alpha", [](const auto& v) { return ops::add(v[0], v[1], 0.5); },
       [](const auto& v) { return ops::add(v[0], v[1], 0.5); }},
      {"sub", [](const auto& v) { return ops::sub(v[0], v[1]); }, [](const auto& v) { return ops::add(v[0], v[1]); }},
      {"mul", [](const auto& v) { return ops::mul(v[0], v[1]); }, [](const auto& v) { return ops::mul(v[0], v[1]); }},
      {"div", [](const auto& v) { return ops::div(v[0], v[1]); }, [](const auto& v) { return ops::div(v[0], v[1]); }},
      {"pow", [](const auto& v) { return ops::pow(v[0], v[1]); }, Fn()},
  };
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    for (const BinaryCase& c : cases) {
      for (int order = 0; order < 2; ++order) {
        // (3,1,4) with (2,4), both orders; positive values keep div and pow well-conditioned.
        const Tensor a = leaf({3, 1, 4}, 0.5, 2, 11), b = leaf({2, 4}, 0.5, 2, 12);
        const std::string what = label(c.name, dt) + (order ? " (2,4) op (3,1,4)" : " (3,1,4) op (2,4)");
        const LowpRun r = run_lowp(c.fn, order == 0 ? std::vector<Tensor>{a, b} : std::vector<Tensor>{b, a}, dt);
        expect_dtypes(r, dt, dt, what);
        EXPECT_EQ(r.y_lp.shape(), (Shape{3, 2, 4})) << what;
        // Forward: one rounding: 2u|ref|.
        EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, 0.0)) << what << " forward";
        if (!c.magnitude_fn) {
          // pow: x^e and x^e log x, one rounding each, then the broadcast sum (<= 3 terms,
          // each |term| <= 1.5 * max|ref| bound below by the rounded-terms rule): normwise.
          const double mx = ops::max(absd(r.gx_ref[0])).item() + ops::max(absd(r.gx_ref[1])).item();
          for (size_t k = 0; k < 2; ++k)
            EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 4 * u, 8 * u * mx)) << what << " backward " << k;
          continue;
        }
        // Backward: each partial gradient is rounded (u|t|), then sum_to adds the broadcast
        // copies in f32 and rounds (u|ref|): u*M + u|ref|, M = sum |t_i| -> 2u|ref| + 2u*M.
        const Magnitudes m = magnitudes(c.magnitude_fn, r);
        for (size_t k = 0; k < 2; ++k)
          EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 2 * u, ops::mul(m.gx[k], 2 * u))) << what << " backward " << k;
      }
      // Same-shape operands in the same transposed (dense) layout, and with different layouts.
      for (int layout = 0; layout < 2; ++layout) {
        const Fn f0 = c.fn;
        const Fn f = [f0, layout](const auto& v) {
          return f0({v[0].t(), layout == 0 ? v[1].t() : v[1].t().contiguous()});
        };
        const std::string what = label(c.name, dt) + (layout == 0 ? " both transposed" : " one transposed");
        const LowpRun r = run_lowp(f, {leaf({8, 5}, 0.5, 2, 13), leaf({8, 5}, 0.5, 2, 14)}, dt);
        expect_dtypes(r, dt, dt, what);
        EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, 0.0)) << what << " forward";
        // No broadcasting: each gradient is one f32 computation rounded once (pow's x^e log x
        // has two roundings' worth from the saved rounded output): 4u|ref|.
        for (size_t k = 0; k < 2; ++k)
          EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 4 * u, 0.0)) << what << " backward " << k;
      }
    }
  }
}

// ---------------------------------------------------------------- reductions

TEST(LowPrecision, SumMean) {
  const std::vector<std::vector<int64_t>> dim_lists{{}, {0}, {1}, {2}, {0, 2}, {-1}, {-3, -2}};
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    const Tensor x = leaf({4, 6, 40}, -2, 2, 21);
    for (const auto& dims : dim_lists) {
      for (bool keep : {false, true}) {
        int64_t n = dims.empty() ? x.numel() : 1;  // elements per output
        for (int64_t d : dims) n *= x.size(d);
        const std::string what = label("sum/mean", dt) + " dims " + shape_str(dims) + (keep ? " keepdim" : "");
        // sum: f32 accumulation of n exact terms (gamma_n * sum|x|), one final rounding:
        // 2u|ref| + 2 n 2^-24 sum|x|. Backward is an expand of the upstream gradient: exact.
        const Fn fsum = [&](const auto& v) { return ops::sum(v[0], dims, keep); };
        const LowpRun rs = run_lowp(fsum, {x}, dt);
        expect_dtypes(rs, dt, dt, what);
        const Magnitudes ms = magnitudes(fsum, rs);
        EXPECT_TRUE(within(rs.y_lp, rs.y_ref, 2 * u, ops::mul(ms.y, 2.0 * static_cast<double>(n) * kF32U))) << what;
        EXPECT_TRUE(within(rs.gx_lp[0], rs.gx_ref[0], 0.0, 0.0)) << what << " backward";
        // mean: the same sum scaled by 1/n in f32, rounded once; backward g * (1/n) rounded once.
        const Fn fmean = [&](const auto& v) { return ops::mean(v[0], dims, keep); };
        const LowpRun rm = run_lowp(fmean, {x}, dt);
        expect_dtypes(rm, dt, dt, what);
        const Magnitudes mm = magnitudes(fmean, rm);
        EXPECT_TRUE(within(rm.y_lp, rm.y_ref, 2 * u, ops::mul(mm.y, 2.0 * static_cast<double>(n + 1) * kF32U))) << what;
        EXPECT_TRUE(within(rm.gx_lp[0], rm.gx_ref[0], 2 * u, 0.0)) << what << " backward";
      }
    }
    // A long all-positive sum (16384 terms): accumulating in the 16-bit type itself would stall
    // once the running sum's ulp exceeds the terms (bf16: at 256 for terms below 1), far outside
    // the bound 2u|ref| + 2 n 2^-24 sum|x| (= 2u + 2^-9 relative).
    const Tensor big = leaf({128, 128}, 0.25, 1.0, 22);
    const LowpRun rb = run_lowp([](const auto& v) { return ops::sum(v[0]); }, {big}, dt);
    EXPECT_TRUE(within(rb.y_lp, rb.y_ref, 2 * u + 2.0 * 16384 * kF32U, 0.0)) << label("long sum", dt);
    const LowpRun rbm = run_lowp([](const auto& v) { return ops::mean(v[0], {1}); }, {big}, dt);
    EXPECT_TRUE(within(rbm.y_lp, rbm.y_ref, 2 * u + 2.0 * 129 * kF32U, 0.0)) << label("long mean", dt);
  }
}

// ---------------------------------------------------------------- softmax

TEST(LowPrecision, SoftmaxLogSoftmax) {
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    const Tensor x = leaf({2, 3, 4}, -3, 3, 31);
    for (int64_t d : {0, 1, -1}) {
      const std::string what = label("softmax", dt) + " dim " + std::to_string(d);
      const LowpRun r = run_lowp([d](const auto& v) { return ops::softmax(v[0], d); }, {x}, dt);
      expect_dtypes(r, dt, dt, what);
      // Forward: f32 statistics, one rounding: 2u|ref| + 2^-20 (f32 error, values <= 1).
      EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, std::ldexp(1.0, -20))) << what;
      // Backward in the 16-bit dtype: gy = g*y, s = sum(gy), t = y*s, dx = gy - t, each rounded,
      // with y itself rounded: |err_i| <= u|dx_i| + 2u y_i|g_i| + 4u y_i S, S = sum_j y_j|g_j|,
      // so 2u|ref| + 8u * y_i (|g_i| + S).
      {
        NoGradGuard ng;
        const Tensor y = r.y_ref.detach(), ag = absd(r.g_ref);
        const Tensor mag = ops::mul(y, ops::add(ag, ops::sum(ops::mul(y, ag), {d}, true)));
        EXPECT_TRUE(within(r.gx_lp[0], r.gx_ref[0], 2 * u, ops::mul(mag, 8 * u))) << what << " backward";
      }
      const std::string lwhat = label("log_softmax", dt) + " dim " + std::to_string(d);
      const LowpRun l = run_lowp([d](const auto& v) { return ops::log_softmax(v[0], d); }, {x}, dt);
      expect_dtypes(l, dt, dt, lwhat);
      // Forward: x - lse in f32 (error about C 2^-24 |lse| < 2^-18 here), one rounding.
      EXPECT_TRUE(within(l.y_lp, l.y_ref, 2 * u, std::ldexp(1.0, -18))) << lwhat;
      // Backward: dx = g - exp(y) sum(g): exp of the rounded y is off by p(u|y| + u), the sum,
      // product and difference each round once: |err_i| <= u|dx_i| + u p_i G (3 + |y_i|) with
      // G = sum_j |g_j|, so 2u|ref| + 2u p_i G (4 + |y_i|).
      {
        NoGradGuard ng;
        const Tensor y = l.y_ref.detach(), p = ops::exp(y);
        const Tensor G = ops::sum(absd(l.g_ref), {d}, true);
        const Tensor mag = ops::mul(ops::mul(p, G), ops::add(absd(y), 4.0));
        EXPECT_TRUE(within(l.gx_lp[0], l.gx_ref[0], 2 * u, ops::mul(mag, 2 * u))) << lwhat << " backward";
      }
    }
  }
}

// ---------------------------------------------------------------- matmul / linear

struct MatmulCase {
  const char* name;
  Shape a, b;
  Fn fn;
  int64_t k;  // the inner (accumulated) length
};

TEST(LowPrecision, Matmul) {
  ops_test::for_each_bf16_way([&] {
    const Fn mm = [](const auto& v) { return ops::matmul(v[0], v[1]); };
    const std::vector<MatmulCase> cases{
        {"2-d", {5, 32}, {32, 3}, mm, 32},
        {"1-d x 1-d", {32}, {32}, mm, 32},
        {"1-d x 2-d", {32}, {32, 3}, mm, 32},
        {"2-d x 1-d", {5, 32}, {32}, mm, 32},
        {"batched", {3, 4, 16}, {3, 16, 5}, mm, 16},
        {"broadcast batch", {2, 1, 3, 16}, {4, 16, 2}, mm, 16},
        {"2-d x batched", {3, 16}, {4, 16, 2}, mm, 16},
        {"batched x 2-d", {4, 3, 16}, {16, 2}, mm, 16},
        {"permuted batch",
         {3, 4, 16},
         {4, 16, 2},
         [](const auto& v) { return ops::matmul(v[0].transpose(0, 1), v[1]); },
         16},
        {"stepped slice", {5, 32}, {16, 3}, [](const auto& v) { return ops::matmul(v[0].slice(1, 0, 32, 2), v[1]); }, 16},
        {"transposed", {32, 5}, {3, 32}, [](const auto& v) { return ops::matmul(v[0].t(), v[1].t()); }, 32},
        {"batched transposed",
         {3, 16, 4},
         {3, 5, 16},
         [](const auto& v) { return ops::matmul(v[0].transpose(1, 2), v[1].transpose(-1, -2)); },
         16},
    };
    for (DType dt : kLowp) {
      const double u = unit_roundoff(dt);
      for (const MatmulCase& c : cases) {
        const std::string what = label(std::string("matmul ") + c.name, dt);
        const LowpRun r = run_lowp(c.fn, {leaf(c.a, -1, 1, 41), leaf(c.b, -1, 1, 42)}, dt);
        expect_dtypes(r, dt, dt, what);
        const Magnitudes m = magnitudes(c.fn, r);
        // Forward: products of 16-bit values are exact in f32, accumulated in f32 (gamma_K
        // (|A||B|)), rounded once: 2u|ref| + 2 K 2^-24 (|A||B|).
        EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, ops::mul(m.y, 2.0 * static_cast<double>(c.k) * kF32U))) << what;
        // Backward: G B^T and A^T G are matmuls of the same kind (inner length <= 4*3*2 = 24), then
        // broadcast batches are summed after rounding: 2u|ref| + 2(u + 32 2^-24) M.
        for (size_t k = 0; k < 2; ++k)
          EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 2 * u, ops::mul(m.gx[k], 2 * (u + 32 * kF32U))))
              << what << " backward " << k;
      }
    }
  });
}

TEST(LowPrecision, Linear) {
  ops_test::for_each_bf16_way([&] {
    for (DType dt : kLowp) {
      const double u = unit_roundoff(dt);
      const Tensor w = leaf({6, 24}, -1, 1, 51), b = leaf({6}, -1, 1, 52);
      for (const Shape& xs : {Shape{7, 24}, Shape{2, 3, 24}, Shape{24}}) {
        for (bool bias : {true, false}) {
          const std::string what = label("linear x" + shape_str(xs) + (bias ? " bias" : ""), dt);
          const Fn fn = [bias](const auto& v) { return bias ? ops::linear(v[0], v[1], v[2]) : ops::linear(v[0], v[1]); };
          const LowpRun r = run_lowp(
              fn, bias ? std::vector<Tensor>{leaf(xs, -1, 1, 53), w, b} : std::vector<Tensor>{leaf(xs, -1, 1, 53), w},
              dt);
          expect_dtypes(r, dt, dt, what);
          const Magnitudes m = magnitudes(fn, r);
          // Forward: as matmul, bias added in f32 before the single rounding (K = 24):
          // 2u|ref| + 2 * 25 * 2^-24 (|x||W|^T + |b|).
          EXPECT_TRUE(within(r.y_lp, r.y_ref, 2 * u, ops::mul(m.y, 2.0 * 25 * kF32U))) << what;
          // Backward: dx = G W, dW = G^T x (inner length <= 7 rows), db = sum of G's rows in f32:
          // each one f32-accumulated product rounded once: 2u|ref| + 2 * 8 * 2^-24 M.
          for (size_t k = 0; k < r.gx_lp.size(); ++k)
            EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 2 * u, ops::mul(m.gx[k], 2.0 * 8 * kF32U)))
                << what << " backward " << k;
        }
      }
    }
  });
}

// A bf16 Linear's bias gradient is the column sum of the output gradient, summed in f32 from the
// exact widened values and rounded to bf16 once: bit for bit, for several columns (the vectorised
// channel sum) and for one (the per-row path). A dropped row or a misplaced column fails it; the
// order of the f32 additions is below bf16's resolution here.
TEST(LowPrecision, LinearBiasGradientIsTheF32ColumnSumRoundedOnce) {
  ops_test::for_each_bf16_way([&] {
    for (const int64_t N : {50, 1}) {
      const int64_t M = 37, K = 8;
      const Tensor x = leaf({M, K}, -1, 1, 61).to(kBFloat16);
      const Tensor w = leaf({N, K}, -1, 1, 62).to(kBFloat16);
      const Tensor b = leaf({N}, -1, 1, 63).to(kBFloat16).detach().requires_grad_();
      const Tensor g = leaf({M, N}, -4, 4, 64).to(kBFloat16).detach();
      ops::linear(x, w, b).backward(g);
      std::vector<float> acc(static_cast<size_t>(N), 0.0f);
      const std::vector<double> gv = g.to_vector();
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < N; ++c) acc[c] += static_cast<float>(gv[r * N + c]);
      std::vector<double> want(acc.begin(), acc.end());
      EXPECT_EQ(b.grad().to_vector(), Tensor(tensor(want, {N})).to(kBFloat16).to_vector()) << "N " << N;
    }
  });
}

// ---------------------------------------------------------------- losses

TEST(LowPrecision, CrossEntropyComputesInF32) {
  const Tensor t = i64({3, 0, 9, -100, 5, 5, 1, 2}, {8});
  const Tensor t4 = i64({0, 2, 1, 1, 2, -100, 0, 1}, {2, 2, 2});
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    for (const char* red : {"mean", "sum", "none"}) {
      for (double eps : {0.0, 0.1}) {
        const std::string what = label(std::string("cross_entropy ") + red + " smoothing " + std::to_string(eps), dt);
        const ops::CrossEntropyOptions o{.label_smoothing = eps, .reduction = red};
        const LowpRun r =
            run_lowp([&](const auto& v) { return ops::cross_entropy(v[0], t, o); }, {leaf({8, 10}, -3, 3, 61)}, dt);
        // The loss is f32 whatever the input dtype; the gradient has the input's dtype.
        expect_dtypes(r, kFloat32, dt, what);
        // Forward entirely in f32 from exact inputs: log-sum-exp over C = 10 classes and a sum
        // over 8 rows, error about (C + 8) 2^-24 (|loss| + max|x|) -- far below one 16-bit ulp,
        // which is the point: the loss is not rounded to the input dtype.
        EXPECT_TRUE(within(r.y_lp, r.y_ref, 64 * kF32U, 64 * kF32U * 3)) << what;
        // Backward: scale * (p - eps/C - (1-eps) onehot) in f32, rounded once to the input dtype:
        // 2u|ref| + 2^-20 |g|.
        EXPECT_TRUE(within(r.gx_lp[0], r.gx_ref[0], 2 * u, std::ldexp(1.0, -20))) << what << " backward";
      }
    }
    const LowpRun r4 = run_lowp([&](const auto& v) { return ops::cross_entropy(v[0], t4, {.label_smoothing = 0.1}); },
                                {leaf({2, 3, 2, 2}, -3, 3, 62)}, dt);
    expect_dtypes(r4, kFloat32, dt, label("cross_entropy 4-d", dt));
    EXPECT_TRUE(within(r4.y_lp, r4.y_ref, 64 * kF32U, 64 * kF32U * 3)) << label("cross_entropy 4-d", dt);
    EXPECT_TRUE(within(r4.gx_lp[0], r4.gx_ref[0], 2 * u, std::ldexp(1.0, -20))) << label("cross_entropy 4-d", dt);
    // nll_loss of 16-bit log-probabilities: the loss is an f32 copy of exact elements.
    const LowpRun rn = run_lowp([&](const auto& v) { return ops::nll_loss(v[0], t); }, {leaf({8, 10}, -3, 0, 63)}, dt);
    expect_dtypes(rn, kFloat32, dt, label("nll_loss", dt));
    EXPECT_TRUE(within(rn.y_lp, rn.y_ref, 8 * kF32U, 0.0)) << label("nll_loss", dt);
    EXPECT_TRUE(within(rn.gx_lp[0], rn.gx_ref[0], 2 * u, 0.0)) << label("nll_loss", dt) << " backward";
  }
}

TEST(LowPrecision, MseLoss) {
  for (DType dt : kLowp) {
    const double u = unit_roundoff(dt);
    for (const char* red : {"mean", "sum", "none"}) {
      const std::string what = label(std::string("mse_loss ") + red, dt);
      const LowpRun r = run_lowp([red](const auto& v) { return ops::mse_loss(v[0], v[1], red); },
                                 {leaf({6, 7}, -2, 2, 71), leaf({6, 7}, -2, 2, 72)}, dt);
      expect_dtypes(r, dt, dt, what);
      // Forward: d = a - b and d^2 each rounded (3u|d|^2 after squaring), all terms positive so
      // the f32 sum's M equals |ref|, then one rounding: 5u|ref| -> 8u|ref|.
      EXPECT_TRUE(within(r.y_lp, r.y_ref, 8 * u, 0.0)) << what;
      // Backward: g/n (or g), times 2d, with d rounded: three roundings, no accumulation:
      // 3u|ref| -> 6u|ref|.
      for (size_t k = 0; k < 2; ++k)
        EXPECT_TRUE(within(r.gx_lp[k], r.gx_ref[k], 6 * u, 0.0)) << what << " backward " << k;
    }
  }
}

// ---------------------------------------------------------------- dtypes

TEST(LowPrecision, OutputDtypes) {
  for (DType dt : kLowp) {
    const Tensor a = leaf({2, 3}, -1, 1, 81).detach().to(dt), b = leaf({3, 2}, -1, 1, 82).detach().to(dt);
    const std::string n(dtype_name(dt));
    EXPECT_EQ(ops::add(a, a).dtype(), dt) << n;
    EXPECT_EQ(ops::gelu(a).dtype(), dt) << n;
    EXPECT_EQ(ops::matmul(a, b).dtype(), dt) << n;
    EXPECT_EQ(ops::linear(a, b.t()).dtype(), dt) << n;
    EXPECT_EQ(ops::sum(a).dtype(), dt) << n;
    EXPECT_EQ(ops::mean(a).dtype(), dt) << n;  // f32 statistics, rounded once to the input dtype
    EXPECT_EQ(ops::max(a).dtype(), dt) << n;
    EXPECT_EQ(ops::softmax(a, 1).dtype(), dt) << n;
    EXPECT_EQ(ops::cat({a, a}).dtype(), dt) << n;
    EXPECT_EQ(ops::index_select(a, 0, i64({1}, {1})).dtype(), dt) << n;
    Generator g(1);
    EXPECT_EQ(ops::dropout(a, 0.5, true, &g).dtype(), dt) << n;
    EXPECT_EQ(ops::cross_entropy(a, i64({0, 2}, {2})).dtype(), kFloat32) << n;
    EXPECT_EQ(ops::cross_entropy(a, i64({0, 2}, {2}), {.reduction = "none"}).dtype(), kFloat32) << n;
    // Mixed with f32: promotes to f32 (PyTorch's rule), and the gradient comes back in 16 bits.
    Tensor lp = a.clone();
    lp.requires_grad_(true);
    Tensor y = ops::mul(lp, ones({2, 3}, kFloat32));
    EXPECT_EQ(y.dtype(), kFloat32) << n;
    ops::sum(y).backward();
    EXPECT_EQ(lp.grad().dtype(), dt) << n;
  }
}

// 16-bit sums accumulate in f32, which stops growing by 1 at 2^24: past that PyTorch (cascade
// sums) still counts every value. Every sum here is exact in f32 blocks and f64 totals, and the
// results (5 * 2^23, 5 * 2^22, 1.5 * 2^24) are exact in bf16, so they are compared exactly.
TEST(LowPrecision, SumsOfMoreThanTwoTo24ValuesKeepCounting) {
  const int64_t n = (int64_t{1} << 25) + (int64_t{1} << 23);
  const Tensor flat = ones({n}, kBFloat16);
  EXPECT_EQ(ops::sum(flat).item(), static_cast<double>(n));
  EXPECT_EQ(ops::mean(flat).item(), 1.0);
  EXPECT_EQ(ops::mean(ones({n}, kFloat16)).item(), 1.0);
  // Leading dims reduced (rows added into an accumulator) and the last dim reduced (row sums).
  EXPECT_EQ(ops::sum(flat.view({n / 2, 2}), {0}).to_vector(), (std::vector<double>{n / 2.0, n / 2.0}));
  EXPECT_EQ(ops::sum(flat.view({2, n / 2}), {1}).to_vector(), (std::vector<double>{n / 2.0, n / 2.0}));
  // linear's bias gradient (its own column sums) counts every row too.
  const int64_t m = (int64_t{1} << 24) + (int64_t{1} << 23);
  Tensor b = zeros({2}, kBFloat16);
  b.requires_grad_(true);
  ops::linear(zeros({m, 1}, kBFloat16), zeros({2, 1}, kBFloat16), b).backward(ones({m, 2}, kBFloat16));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{static_cast<double>(m), static_cast<double>(m)}));
}

}  // namespace
}  // namespace tandem
