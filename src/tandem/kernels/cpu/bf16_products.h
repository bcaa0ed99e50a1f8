// How bf16 matrix products (GEMM, convolution, the tile products of bf16 attention) run on this
// CPU, chosen once per process. Every way keeps bf16's meaning: operands rounded to bf16, exact
// products summed in f32, one rounding of the result.
//   amx      Tandem's AMX kernels (amx_gemm.h) for GEMM, attention tiles and the weight gradient
//            of convolution; oneDNN's bf16 convolution for the rest. Where the CPU has AMX-BF16.
//   native   oneDNN's bf16 matmul and convolution (its AVX512-BF16 kernels), attention tiles on
//            VDPBF16PS (dpbf16_gemm.h). Where VDPBF16PS multiplies at least 0.8x as fast as f32
//            FMAs (flops per second): each does two products per lane, so on AMD Zen 4 it runs at
//            twice the f32 rate, and at equal rates half the bytes and no widening pass still win.
//   widened  operands widened to f32 (exact) and multiplied by the f32 kernels (dnnl_sgemm, oneDNN's
//            f32 convolution, the f32 attention tiles), the result rounded once. Where the CPU has
//            no AVX512-BF16, or where VDPBF16PS is slower than f32 FMAs: some Intel Xeons without
//            AMX run it at half the f32 rate (86 vs 177 GFLOP/s on one core measured), so oneDNN's
//            bf16 matmul (84 GFLOP/s there) loses to widening + sgemm (124-158).
// The ways differ beyond the order of the f32 sums in one respect: widening is exact for
// subnormal bf16 inputs, which VDPBF16PS and the AMX tiles read as zero.
// TANDEM_BF16_GEMM picks instead of the measurement: "amx" or "auto" (the default choice),
// "onednn" (native, with attention tiles widened to f32: oneDNN's kernels only), "f32" (widened).
#pragma once

#include <functional>
#include <string>
#include <utility>

namespace tandem::kernels {

enum class Bf16Products { amx, native, widened };

// How bf16 products run now: the choice made on first call (thread-safe) unless
// set_bf16_products changed it since. The choice: TANDEM_BF16_GEMM if set, else amx where
// amx_bf16_usable(), else native where the CPU has AVX512-BF16 (with BW and VL) and its
// measured VDPBF16PS rate is at least 0.8x its f32 FMA rate (core_peak.h, ~2 ms once), else
// widened. An unknown TANDEM_BF16_GEMM is a ValueError naming it.
Bf16Products bf16_products();

// Overrides the choice for the products that start after the call (tests; users comparing the
// ways). amx where amx_bf16_usable() is false is a ValueError saying so.
void set_bf16_products(Bf16Products p);

// "amx", "native" or "widened".
const char* bf16_products_name(Bf16Products p);
// Why the first choice was made: the environment variable, the CPU feature, or the measured rates.
std::string bf16_products_reason();

// TANDEM_BF16_GEMM=onednn: Tandem's own bf16 kernels (the AMX ones and the AVX512-BF16 tile
// products of dpbf16_gemm.h) are off and bf16 goes to oneDNN (attention to f32).
bool bf16_kernels_switched_off();

// The decision itself, from its inputs: the value of TANDEM_BF16_GEMM ("" when unset), whether
// AMX-BF16 is usable, whether the CPU has AVX512-BF16 with BW and VL, and a measurement returning
// (f32 FMA GFLOP/s, VDPBF16PS GFLOP/s), called only when the rest does not decide.
struct Bf16Decision {
  Bf16Products products = Bf16Products::widened;
  bool own_kernels_off = false;
  std::string reason;
};
Bf16Decision decide_bf16_products(const std::string& env, bool amx_usable, bool avx512_bf16,
                                  const std::function<std::pair<double, double>()>& measure);

}  // namespace tandem::kernels
