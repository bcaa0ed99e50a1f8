#include "tandem/kernels/cpu/tile_gemm.h"

#include <immintrin.h>

#include <cmath>

#include "tandem/core/cpu_features.h"
#include "tandem/kernels/cpu/acc_block.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/kernel_timing.h"
#include "tandem/kernels/cpu/transpose16.h"

// GCC 12's avx512fintrin.h seeds masked intrinsics with an "undefined" register and then warns
// about it in every caller (see row_math.cc).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tandem::kernels {
namespace {

#define TANDEM_AVX512 __attribute__((target("avx512f")))

// MR rows x NV vectors of 16 columns of c, accumulated in registers over all of K: per k, NV
// loads of B's row and MR broadcasts of A's column, MR * NV FMAs. `last` masks the final vector
// (N not a multiple of 16).
template <int MR, int NV>
TANDEM_AVX512 inline void micro(int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                                bool accumulate, float* c, int64_t ldc, __mmask16 last) {
  // Fully unrolled (the pragmas), so GCC keeps acc in registers instead of on the stack.
  __m512 acc[MR][NV];
  load_acc_block<MR, NV>(acc, accumulate, c, ldc, last);
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 m = j == NV - 1 ? last : static_cast<__mmask16>(0xffff);
      bv[j] = _mm512_maskz_loadu_ps(m, b + k * ldb + 16 * j);
    }
    const float* ak = a + k * a_cs;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(ak[i * a_rs]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  store_acc_block<MR, NV>(acc, c, ldc, last);
}

// All rows of one column block of NV vectors: blocks of 6 rows, then the remainder.
template <int NV>
TANDEM_AVX512 void column_block(int64_t M, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                                int64_t ldb, bool accumulate, float* c, int64_t ldc, __mmask16 last) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) micro<6, NV>(K, a + i * a_rs, a_rs, a_cs, b, ldb, accumulate, c + i * ldc, ldc, last);
  const float* ai = a + i * a_rs;
  float* ci = c + i * ldc;
  switch (M - i) {
    case 5: micro<5, NV>(K, ai, a_rs, a_cs, b, ldb, accumulate, ci, ldc, last); break;
    case 4: micro<4, NV>(K, ai, a_rs, a_cs, b, ldb, accumulate, ci, ldc, last); break;
    case 3: micro<3, NV>(K, ai, a_rs, a_cs, b, ldb, accumulate, ci, ldc, last); break;
    case 2: micro<2, NV>(K, ai, a_rs, a_cs, b, ldb, accumulate, ci, ldc, last); break;
    case 1: micro<1, NV>(K, ai, a_rs, a_cs, b, ldb, accumulate, ci, ldc, last); break;
    default: break;
  }
}

TANDEM_AVX512 void tile_sgemm_avx512(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs,
                                     const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j = 0; j < N; j += 64) {
    const int64_t w = N - j < 64 ? N - j : 64;
    const int nv = static_cast<int>((w + 15) / 16);
    const int64_t tail = w - 16 * (nv - 1);
    const __mmask16 last = tail >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << tail) - 1u);
    switch (nv) {
      case 4: column_block<4>(M, K, a, a_rs, a_cs, b + j, ldb, accumulate, c + j, ldc, last); break;
      case 3: column_block<3>(M, K, a, a_rs, a_cs, b + j, ldb, accumulate, c + j, ldc, last); break;
      case 2: column_block<2>(M, K, a, a_rs, a_cs, b + j, ldb, accumulate, c + j, ldc, last); break;
      default: column_block<1>(M, K, a, a_rs, a_cs, b + j, ldb, accumulate, c + j, ldc, last); break;
    }
  }
}

// One 16 x 16 block: src rows (stride lds) to dst rows (stride ldd), transposed.
TANDEM_AVX512 void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_loadu_ps(src + i * lds));
  transpose16x16_epi32(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, _mm512_castsi512_ps(r[i]));
}

TANDEM_AVX512 void transpose_avx512(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  const int64_t rb = rows / 16 * 16, cb = cols / 16 * 16;
  for (int64_t r = 0; r < rb; r += 16) {
    for (int64_t c = 0; c < cb; c += 16) transpose16(src + r * ld + c, ld, dst + c * rows + r, rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c0 = r < rb ? cb : 0;
    for (int64_t c = c0; c < cols; ++c) dst[c * rows + r] = src[r * ld + c];
  }
}

}  // namespace

void transpose_f32(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  static const bool avx512 = cpu_features().avx512f;
  if (avx512) return transpose_avx512(src, rows, cols, ld, dst);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * ld + c];
  }
}

void tile_sgemm_reference(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                          int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      float s = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(a[i * a_rs + k * a_cs], b[k * ldb + j], s);
      c[i * ldc + j] = s;
    }
  }
}

namespace {

// Without AVX-512: oneDNN's sgemm when A has a unit-stride dimension, else the plain loops.
void tile_sgemm_fallback(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                         int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (a_cs == 1 && a_rs >= K) return sgemm('N', 'N', M, N, K, a, a_rs, b, ldb, beta, c, ldc);
  if (a_rs == 1 && a_cs >= M) return sgemm('T', 'N', M, N, K, a, a_cs, b, ldb, beta, c, ldc);
  tile_sgemm_reference(M, N, K, a, a_rs, a_cs, b, ldb, accumulate, c, ldc);
}

}  // namespace

void tile_sgemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                bool accumulate, float* c, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  static const bool avx512 = cpu_features().avx512f;
  if (!avx512) return tile_sgemm_fallback(M, N, K, a, a_rs, a_cs, b, ldb, accumulate, c, ldc);
  const KernelTimer timer(KernelKind::gemm, 2.0 * static_cast<double>(M * N) * static_cast<double>(K));
  tile_sgemm_avx512(M, N, K, a, a_rs, a_cs, b, ldb, accumulate, c, ldc);
}

}  // namespace tandem::kernels
