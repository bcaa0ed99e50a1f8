#include "tandem/kernels/cpu/dpbf16_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tandem/core/convert.h"
#include "tandem/core/cpu_features.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/kernels/cpu/acc_block.h"
#include "tandem/kernels/cpu/transpose16.h"

// GCC 12's avx512fintrin.h seeds masked intrinsics with an "undefined" register and then warns
// about it in every caller (see row_math.cc).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tandem::kernels {
namespace {

#define TANDEM_DPBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kMr = 6;   // rows of C per block
constexpr int64_t kNr = 64;  // columns of C per block (4 vectors of 16)

// Scratch that grows and stays per thread: B and A pairs, the f32 block of a bf16 C.
struct Scratch {
  std::vector<uint32_t> b, a;
  alignas(64) float block[kMr * kNr];
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

inline __mmask16 low_mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u);
}
inline __mmask32 low_mask32(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : n <= 0 ? static_cast<__mmask32>(0) : static_cast<__mmask32>((1ull << n) - 1ull);
}

// Pairs of two rows of a row-major bf16 matrix: dst[p * ldd + j] = (x(2p, j), x(2p + 1, j)) for
// p < pairs, j < cols (the pair's high half: row 2p + 1; rows at or past `rows` read as zero),
// zero up to `cols_padded`.
TANDEM_DPBF16 void pair_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t cols, int64_t pairs,
                             int64_t cols_padded, uint32_t* dst, int64_t ldd) {
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* r0 = x + 2 * p * ldx;
    const bool has1 = 2 * p + 1 < rows;
    for (int64_t j = 0; j < cols_padded; j += 16) {
      const __mmask16 m = low_mask16(cols - j);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + j));
      const __m512i hi = has1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + ldx + j)) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * ldd + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Pairs along the rows of a row-major bf16 matrix, transposed: dst[p * ldd + j] = (x(j, 2p),
// x(j, 2p + 1)) for j < count (rows of x), p < pairs, where x(j, k) = x[j * ldx + k] for k < len
// (zero beyond); j up to count_padded zero. A pair is one 32-bit word of x's row, so this is a
// 16 x 16 transpose of 32-bit words per block (elements past len masked to zero).
TANDEM_DPBF16 void pair_cols(const uint16_t* x, int64_t ldx, int64_t count, int64_t len, int64_t pairs,
                             int64_t count_padded, uint32_t* dst, int64_t ldd) {
  for (int64_t j = 0; j < count_padded; j += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask32 km = low_mask32(len - 2 * p0);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = j + i < count ? _mm512_maskz_loadu_epi16(km, x + (j + i) * ldx + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(r);
      const int64_t pp = std::min<int64_t>(16, pairs - p0);
      for (int64_t i = 0; i < pp; ++i) _mm512_storeu_si512(dst + (p0 + i) * ldd + j, r[i]);
    }
  }
}

// R rows x NV vectors of C over all pairs: A's pair for row i, pair p at a[i * a_rs + p * a_cs]
// (32-bit words), B's pair row p at b + p * ldb. c: f32, row stride ldc, `last` masks the final
// vector; `load` starts from c's values.
template <int R, int NV>
TANDEM_DPBF16 inline void micro(int64_t pairs, const uint32_t* a, int64_t a_rs, int64_t a_cs, const uint32_t* b,
                                int64_t ldb, bool load, float* c, int64_t ldc, __mmask16 last) {
  __m512 acc[R][NV];
  load_acc_block<R, NV>(acc, load, c, ldc, last);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * ldb + 16 * j));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[i * a_rs + p * a_cs])));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  store_acc_block<R, NV>(acc, c, ldc, last);
}

template <int NV>
TANDEM_DPBF16 void rows_block(int64_t r, int64_t pairs, const uint32_t* a, int64_t a_rs, int64_t a_cs, const uint32_t* b,
                              int64_t ldb, bool load, float* c, int64_t ldc, __mmask16 last) {
  switch (r) {
    case 6: return micro<6, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 5: return micro<5, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 4: return micro<4, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 3: return micro<3, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 2: return micro<2, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    default: return micro<1, NV>(pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
  }
}

TANDEM_DPBF16 void block(int nv, int64_t r, int64_t pairs, const uint32_t* a, int64_t a_rs, int64_t a_cs,
                         const uint32_t* b, int64_t ldb, bool load, float* c, int64_t ldc, __mmask16 last) {
  switch (nv) {
    case 4: return rows_block<4>(r, pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 3: return rows_block<3>(r, pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    case 2: return rows_block<2>(r, pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
    default: return rows_block<1>(r, pairs, a, a_rs, a_cs, b, ldb, load, c, ldc, last);
  }
}

TANDEM_DPBF16 void gemm_avx512bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a,
                                   int64_t lda, const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16,
                                   int64_t ldc) {
  Scratch& s = scratch();
  const int64_t pairs = (K + 1) / 2;
  const int64_t np = (N + 15) / 16 * 16;
  // B as pair rows of np words.
  s.b.resize(static_cast<size_t>(std::max<int64_t>(pairs, 1) * np));
  if (transb == 'N') pair_rows(b, ldb, K, N, pairs, np, s.b.data(), np);
  else pair_cols(b, ldb, N, K, pairs, np, s.b.data(), np);
  // A: a row-major A with even K and even lda is read in place (a pair is one aligned-enough
  // 32-bit word of its row); otherwise pairs go to scratch, row-pair-major for 'N' and
  // pair-row-major for 'T'.
  const uint32_t* pa;
  int64_t a_rs, a_cs;
  if (transa == 'N' && K % 2 == 0 && lda % 2 == 0) {
    pa = reinterpret_cast<const uint32_t*>(a);
    a_rs = lda / 2;
    a_cs = 1;
  } else if (transa == 'N') {
    const int64_t pp = (pairs + 15) / 16 * 16;
    s.a.resize(static_cast<size_t>(M * pp));
    // Row i's pairs: (a(i, 2p), a(i, 2p + 1)), the odd K padded with zero: a copy of the row.
    for (int64_t i = 0; i < M; ++i) {
      auto* row = reinterpret_cast<uint16_t*>(s.a.data() + i * pp);
      if (K > 0) std::memcpy(row, a + i * lda, static_cast<size_t>(K) * sizeof(uint16_t));  // K = 0: a may be null
      std::fill(row + K, row + 2 * pp, uint16_t{0});
    }
    pa = s.a.data();
    a_rs = pp;
    a_cs = 1;
  } else {
    const int64_t mp = (M + 15) / 16 * 16;
    s.a.resize(static_cast<size_t>(std::max<int64_t>(pairs, 1) * mp));
    pair_rows(a, lda, K, M, pairs, mp, s.a.data(), mp);  // A(i, k) = a[k * lda + i]: rows k of a
    pa = s.a.data();
    a_rs = 1;
    a_cs = mp;
  }
  for (int64_t j0 = 0; j0 < N; j0 += kNr) {
    const int64_t w = std::min(kNr, N - j0);
    const int nv = static_cast<int>((w + 15) / 16);
    const __mmask16 last = low_mask16(w - 16 * (nv - 1));
    const uint32_t* bj = s.b.data() + j0;
    for (int64_t i0 = 0; i0 < M; i0 += kMr) {
      const int64_t r = std::min(kMr, M - i0);
      const uint32_t* ai = pa + i0 * a_rs;
      if (!c_bf16) {
        float* cb = static_cast<float*>(c) + i0 * ldc + j0;
        block(nv, r, pairs, ai, a_rs, a_cs, bj, np, accumulate, cb, ldc, last);
        continue;
      }
      uint16_t* cb = static_cast<uint16_t*>(c) + i0 * ldc + j0;
      if (accumulate) {
        for (int64_t i = 0; i < r; ++i) convert(cb + i * ldc, kBFloat16, s.block + i * kNr, kFloat32, w);
      }
      block(nv, r, pairs, ai, a_rs, a_cs, bj, np, accumulate, s.block, kNr, last);
      for (int64_t i = 0; i < r; ++i) convert(s.block + i * kNr, kFloat32, cb + i * ldc, kBFloat16, w);
    }
  }
}

float bf16_daz(uint16_t h) {
  if ((h & 0x7f80u) == 0) h = static_cast<uint16_t>(h & 0x8000u);  // subnormal (or zero) -> signed zero
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

}  // namespace

bool dpbf16_usable() {
  static const bool on = [] {
    const CpuFeatures& f = cpu_features();
    return !bf16_kernels_switched_off() && f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16;
  }();
  return on;
}

bool dpbf16_enabled() { return bf16_products() == Bf16Products::native && dpbf16_usable(); }

void dpbf16_tile_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                           const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  gemm_avx512bf16(transa, transb, M, N, K, a, lda, b, ldb, accumulate, c, c_bf16, ldc);
}

void dpbf16_tile_gemm_reference(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a,
                                int64_t lda, const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16,
                                int64_t ldc) {
  auto A = [&](int64_t i, int64_t k) -> uint16_t {
    if (k >= K) return 0;
    return transa == 'N' ? a[i * lda + k] : a[k * lda + i];
  };
  auto B = [&](int64_t k, int64_t j) -> uint16_t {
    if (k >= K) return 0;
    return transb == 'N' ? b[k * ldb + j] : b[j * ldb + k];
  };
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      float s = 0.0f;
      if (accumulate) {
        if (c_bf16) convert(static_cast<const uint16_t*>(c) + i * ldc + j, kBFloat16, &s, kFloat32, 1);
        else s = static_cast<const float*>(c)[i * ldc + j];
        s = ftz(s);  // the instruction reads its accumulator with subnormals as zero too
      }
      for (int64_t k = 0; k + 1 <= (K + 1) / 2 * 2 - 1; k += 2) {
        // Odd element of the pair first, then the even one; the product of two bf16 is exact in
        // f32 (16 significant bits), so fma is one rounding of the sum.
        s = ftz(std::fma(bf16_daz(A(i, k + 1)), bf16_daz(B(k + 1, j)), s));
        s = ftz(std::fma(bf16_daz(A(i, k)), bf16_daz(B(k, j)), s));
      }
      if (c_bf16) convert(&s, kFloat32, static_cast<uint16_t*>(c) + i * ldc + j, kBFloat16, 1);
      else static_cast<float*>(c)[i * ldc + j] = s;
    }
  }
}

}  // namespace tandem::kernels
