// This core's peak multiply-add rates, measured: independent chains of vector instructions (more
// chains than the instruction's latency needs), timed on the calling thread. What the bf16
// products choose from (amx_gemm.h: bf16_products) and what benchmarks compare GEMM rates with.
#pragma once

#include <cstdint>

namespace tandem::kernels {

// f32 FMA peak in GFLOP/s (2 flops per lane): 512-bit FMAs with AVX-512F, 256-bit ones with
// AVX2+FMA, 0 without FMA. `iterations` rounds of 12 chains, the best of `repeats` runs.
double measure_f32_fma_gflops(int64_t iterations, int repeats);

// bf16 dot-product peak in GFLOP/s with VDPBF16PS (AVX512-BF16: 16 lanes, each adding two bf16
// products, 4 flops per lane), measured the same way; 0 where the CPU lacks AVX512-BF16.
double measure_bf16_dot_gflops(int64_t iterations, int repeats);

}  // namespace tandem::kernels
