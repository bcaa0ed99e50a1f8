// The f32 accumulator block of a register-blocked product: R rows x NV vectors of 16 columns of
// C held in registers, loaded from C (or zeroed) before the k loop and stored after it, the last
// vector of each row masked by `last` (N not a multiple of 16). Shared by the AVX-512 f32 tile
// product (tile_gemm.cc) and the AVX512-BF16 one (dpbf16_gemm.cc); always inlined, with the loops
// fully unrolled, so the block stays in registers. Callers compile for AVX-512 and run only where
// the CPU has it.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tandem::kernels {

template <int R, int NV>
__attribute__((target("avx512f"), always_inline)) inline void load_acc_block(__m512 (&acc)[R][NV], bool load,
                                                                              const float* c, int64_t ldc,
                                                                              __mmask16 last) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 m = j == NV - 1 ? last : static_cast<__mmask16>(0xffff);
      acc[i][j] = load ? _mm512_maskz_loadu_ps(m, c + i * ldc + 16 * j) : _mm512_setzero_ps();
    }
  }
}

template <int R, int NV>
__attribute__((target("avx512f"), always_inline)) inline void store_acc_block(const __m512 (&acc)[R][NV], float* c,
                                                                               int64_t ldc, __mmask16 last) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 m = j == NV - 1 ? last : static_cast<__mmask16>(0xffff);
      _mm512_mask_storeu_ps(c + i * ldc + 16 * j, m, acc[i][j]);
    }
  }
}

}  // namespace tandem::kernels
