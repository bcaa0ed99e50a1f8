// How bf16 products run (kernels/cpu/bf16_products.h): the decision from its inputs (the
// variable, the CPU, the measured rates), and the widened way computing exactly its definition:
// the f32 product of the same bf16 values, rounded once. (That every way this CPU offers stays
// within bf16's rounding of the f64 result is checked by the matmul, linear, conv and attention
// precision tests, which run once per way: ops_test::for_each_bf16_way.)
#include "tandem/kernels/cpu/bf16_products.h"

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ops/ops_test_util.h"
#include "tandem/kernels/cpu/core_peak.h"
#include "util/test_util.h"

namespace tandem {
namespace {

using kernels::Bf16Products;
using kernels::decide_bf16_products;
using testing::leaf;
using V = std::vector<Tensor>;

TEST(Bf16Products, TheDecisionFollowsTheVariableTheCpuAndTheMeasuredRates) {
  int measured = 0;
  // A core measured at (f32 FMA, VDPBF16PS) GFLOP/s.
  auto core = [&measured](double fma, double dot) {
    return [&measured, fma, dot] {
      ++measured;
      return std::make_pair(fma, dot);
    };
  };
  // AMD Zen 4: VDPBF16PS at twice the FMA rate -> oneDNN's bf16 kernels and the dpbf16 tiles.
  EXPECT_EQ(decide_bf16_products("", false, true, core(100, 200)).products, Bf16Products::native);
  // The Intel Xeon without AMX measured for this: half the FMA rate -> widened to f32, and the
  // reason names both rates.
  const kernels::Bf16Decision xeon = decide_bf16_products("", false, true, core(177, 86));
  EXPECT_EQ(xeon.products, Bf16Products::widened);
  EXPECT_NE(xeon.reason.find("VDPBF16PS 86 GFLOP/s vs f32 FMA 177 GFLOP/s"), std::string::npos) << xeon.reason;
  EXPECT_FALSE(xeon.own_kernels_off);
  // The line is at 0.8 of the FMA rate.
  EXPECT_EQ(decide_bf16_products("", false, true, core(100, 80)).products, Bf16Products::native);
  EXPECT_EQ(decide_bf16_products("", false, true, core(100, 79)).products, Bf16Products::widened);
  EXPECT_EQ(measured, 4);
  // AMX and the lack of AVX512-BF16 decide without measuring; "amx" and "auto" are the default.
  for (const char* env : {"", "amx", "auto"}) {
    EXPECT_EQ(decide_bf16_products(env, true, true, core(100, 50)).products, Bf16Products::amx) << env;
    const kernels::Bf16Decision none = decide_bf16_products(env, false, false, core(100, 200));
    EXPECT_EQ(none.products, Bf16Products::widened) << env;
    EXPECT_EQ(none.reason, "no AVX512-BF16");
  }
  EXPECT_EQ(measured, 4);
  // The variable decides before the CPU: "onednn" turns Tandem's own bf16 kernels off even on an
  // AMX core, "f32" widens even where VDPBF16PS is fast.
  const kernels::Bf16Decision onednn = decide_bf16_products("onednn", true, true, core(100, 200));
  EXPECT_EQ(onednn.products, Bf16Products::native);
  EXPECT_TRUE(onednn.own_kernels_off);
  EXPECT_EQ(onednn.reason, "TANDEM_BF16_GEMM=onednn");
  EXPECT_EQ(decide_bf16_products("f32", true, true, core(100, 200)).products, Bf16Products::widened);
  EXPECT_EQ(measured, 4);
  EXPECT_TANDEM_THROW(decide_bf16_products("bf16", false, true, core(100, 200)), ValueError,
                      {"TANDEM_BF16_GEMM=\"bf16\"", "\"auto\"", "\"onednn\"", "\"f32\""});
}

TEST(Bf16Products, AmxCannotBeSetWithoutTiles) {
  if (kernels::amx_bf16_usable()) GTEST_SKIP() << "this CPU has AMX-BF16 tiles";
  const Bf16Products before = kernels::bf16_products();
  EXPECT_TANDEM_THROW(kernels::set_bf16_products(Bf16Products::amx), ValueError, {"AMX-BF16", "native or widened"});
  EXPECT_EQ(kernels::bf16_products(), before);
}

// The measured rates are real numbers of the right size: the f32 FMA rate of a current x86 core
// lies between 5 and 1000 GFLOP/s, and VDPBF16PS (4 flops per lane) where present too. The best of
// 20 short runs (~45 us each for the FMAs): a run cut by another process's time slice (the suite
// runs two tests at once on two cores) does not decide.
TEST(Bf16Products, CorePeaksAreMeasured) {
  const double fma = kernels::measure_f32_fma_gflops(20'000, 20);
  EXPECT_GT(fma, 5.0);
  EXPECT_LT(fma, 1000.0);
  if (cpu_features().avx512_bf16) {
    const double dot = kernels::measure_bf16_dot_gflops(20'000, 20);
    EXPECT_GT(dot, 5.0);
    EXPECT_LT(dot, 2000.0);
  } else {
    EXPECT_EQ(kernels::measure_bf16_dot_gflops(20'000, 3), 0.0);
  }
}

// Widened is its definition, bit for bit: matmul, linear (a transposed weight, an f32-added
// bias) and conv2d with their gradients equal the f32 op on the bf16 values, rounded once to bf16.
TEST(Bf16Products, WidenedIsTheF32OpOnTheSameValuesRoundedOnce) {
  const ops_test::Bf16WayRestorer restore;
  kernels::set_bf16_products(Bf16Products::widened);
  auto pair = [](const Shape& s, uint64_t seed) {
    Tensor b16 = leaf(s, -1, 1, seed, kBFloat16);
    Tensor f32 = b16.detach().to(kFloat32);
    f32.requires_grad_(true);
    return std::pair<Tensor, Tensor>{b16, f32};
  };
  auto expect_rounded = [](const Tensor& got16, const Tensor& want32, const char* what) {
    ASSERT_EQ(got16.dtype(), kBFloat16) << what;
    EXPECT_EQ(got16.to(kFloat32).to_vector(), want32.to(kBFloat16).to(kFloat32).to_vector()) << what;
  };
  using Op = std::function<Tensor(const V&)>;
  struct Case {
    const char* name;
    std::vector<Shape> shapes;
    Op op;
  };
  const std::vector<Case> cases = {
      {"matmul", {{37, 300}, {300, 45}}, [](const V& v) { return ops::matmul(v[0], v[1]); }},
      {"batched matmul", {{3, 20, 64}, {3, 64, 17}}, [](const V& v) { return ops::matmul(v[0], v[1]); }},
      {"linear", {{33, 200}, {70, 200}, {70}}, [](const V& v) { return ops::linear(v[0], v[1], v[2]); }},
      {"conv2d", {{2, 16, 11, 9}, {24, 16, 3, 3}, {24}},
       [](const V& v) { return ops::conv2d(v[0], v[1], v[2], {.stride = {1, 2}, .padding = {1, 1}}); }},
  };
  uint64_t seed = 300;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    V in16, in32;
    for (const Shape& s : c.shapes) {
      auto [b, f] = pair(s, seed++);
      in16.push_back(b);
      in32.push_back(f);
    }
    const Tensor y16 = c.op(in16), y32 = c.op(in32);
    expect_rounded(y16, y32, "output");
    const Tensor gy16 = leaf(y32.shape(), -1, 1, seed++, kBFloat16);
    const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy16.to(kFloat32)))}, in16);
    const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy16.to(kFloat32)))}, in32);
    for (size_t i = 0; i < g16.size(); ++i) expect_rounded(g16[i], g32[i], ("gradient " + std::to_string(i)).c_str());
  }
  // Where the ways differ: widening is exact for subnormal bf16 too, while VDPBF16PS and the AMX
  // tiles read subnormal inputs as zero. 2^-130 (a subnormal) times 2^100, summed over 8 terms:
  // 2^-27 widened, 0 on the bf16 instructions.
  const Tensor tiny = full({4, 8}, 0x1p-130, kBFloat16), big = full({8, 3}, 0x1p100, kBFloat16);
  ASSERT_EQ(tiny.to(kFloat64).to_vector()[0], 0x1p-130);
  for (const double v : ops::matmul(tiny, big).to(kFloat64).to_vector()) ASSERT_EQ(v, 0x1p-27) << "matmul";
  const Tensor ctiny = full({1, 8, 3, 3}, 0x1p-130, kBFloat16), cbig = full({2, 8, 1, 1}, 0x1p100, kBFloat16);
  for (const double v : ops::conv2d(ctiny, cbig).to(kFloat64).to_vector()) ASSERT_EQ(v, 0x1p-27) << "conv2d";
}

}  // namespace
}  // namespace tandem
