#include "tandem/kernels/cpu/core_peak.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

#include "tandem/core/cpu_features.h"

namespace tandem::kernels {
namespace {

using Clock = std::chrono::steady_clock;

// The timed loop of one instruction: V the accumulator type, SET1 its broadcast, OP(acc, a, b)
// the multiply-add, A the multiplicand type and MAKE_A its broadcast from a float, FLOPS the flops
// per instruction. The chains live in an array whose loops are fully unrolled, so they stay in
// registers; the multiplicands keep every sum a normal number (no subnormal slow path).
#define TANDEM_PEAK_BODY(V, SET1, OP, A, MAKE_A, FLOPS)                                         \
  constexpr int kChains = 12;                                                                   \
  const A a = MAKE_A(0.999f), b = MAKE_A(1e-3f);                                                \
  double best = 0;                                                                              \
  float sink = 0;                                                                               \
  for (int rep = 0; rep < repeats; ++rep) {                                                     \
    V v[kChains];                                                                               \
    _Pragma("GCC unroll 12") for (int c = 0; c < kChains; ++c) v[c] = SET1(1.0f + 1e-3f * c);    \
    const auto t0 = Clock::now();                                                               \
    for (int64_t i = 0; i < iterations; ++i) {                                                  \
      _Pragma("GCC unroll 12") for (int c = 0; c < kChains; ++c) v[c] = OP(v[c], a, b);         \
    }                                                                                           \
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();                  \
    _Pragma("GCC unroll 12") for (int c = 0; c < kChains; ++c) sink += v[c][0];                 \
    if (s > 0) best = std::max(best, (FLOPS) * kChains * static_cast<double>(iterations) / s / 1e9); \
  }                                                                                             \
  return sink == 0.12345f ? 0 : best; /* uses the chains, so they are not optimised away */

__attribute__((target("avx512f"))) inline __m512 fma512(__m512 acc, __m512 a, __m512 b) {
  return _mm512_fmadd_ps(a, b, acc);
}
__attribute__((target("avx2,fma"))) inline __m256 fma256(__m256 acc, __m256 a, __m256 b) {
  return _mm256_fmadd_ps(a, b, acc);
}
__attribute__((target("avx512f"))) double fma_peak_avx512(int64_t iterations, int repeats) {
  TANDEM_PEAK_BODY(__m512, _mm512_set1_ps, fma512, __m512, _mm512_set1_ps, 2 * 16)
}
__attribute__((target("avx2,fma"))) double fma_peak_avx2(int64_t iterations, int repeats) {
  TANDEM_PEAK_BODY(__m256, _mm256_set1_ps, fma256, __m256, _mm256_set1_ps, 2 * 8)
}
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh bf16_pairs(float x) {
  return _mm512_cvtne2ps_pbh(_mm512_set1_ps(x), _mm512_set1_ps(x));
}
__attribute__((target("avx512f,avx512bf16"))) inline __m512 dpbf16(__m512 acc, __m512bh a, __m512bh b) {
  return _mm512_dpbf16_ps(acc, a, b);
}
__attribute__((target("avx512f,avx512bf16"))) double dpbf16_peak_avx512(int64_t iterations, int repeats) {
  TANDEM_PEAK_BODY(__m512, _mm512_set1_ps, dpbf16, __m512bh, bf16_pairs, 4 * 16)
}
#undef TANDEM_PEAK_BODY

}  // namespace

double measure_f32_fma_gflops(int64_t iterations, int repeats) {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f) return fma_peak_avx512(iterations, repeats);
  if (f.avx2 && f.fma) return fma_peak_avx2(iterations, repeats);
  return 0.0;
}

double measure_bf16_dot_gflops(int64_t iterations, int repeats) {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512_bf16 ? dpbf16_peak_avx512(iterations, repeats) : 0.0;
}

}  // namespace tandem::kernels
