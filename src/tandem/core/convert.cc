#include "tandem/core/convert.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "tandem/core/cpu_features.h"
#include "tandem/core/error.h"

namespace tandem {
namespace {

// ---- f32 -> bf16 ------------------------------------------------------------------------------
// vcvtneps2bf16 rounds to nearest even but flushes f32 subnormal inputs to (signed) zero. The
// scalar rule keeps them (a subnormal f32 rounds to a subnormal bf16), so lanes holding a
// subnormal are recomputed with the integer rounding rule and blended in.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void f32_to_bf16_avx512bf16(const float* src, bfloat16* dst, int64_t n) {
  int64_t i = 0;
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512i xi = _mm512_castps_si512(x);
    const __mmask16 subnormal =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(xi, exp_mask), _mm512_setzero_si512()) &
        _mm512_cmpneq_epi32_mask(_mm512_and_si512(xi, abs_mask), _mm512_setzero_si512());
    if (subnormal) [[unlikely]] {
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(xi, 16), one);
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(xi, bias), lsb), 16);
      r = _mm256_mask_blend_epi16(subnormal, r, _mm512_cvtepi32_epi16(rounded));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), r);
  }
  convert_f32_to_bf16_scalar(src + i, dst + i, n - i);
}

// Same rounding without the BF16 instruction: integer RNE, NaN made quiet.
__attribute__((target("avx512f,avx512bw")))
void f32_to_bf16_avx512f(const float* src, bfloat16* dst, int64_t n) {
  int64_t i = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  for (; i + 16 <= n; i += 16) {
    const __m512i xi = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(xi, abs_mask), inf);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(xi, 16), one);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(xi, bias), lsb);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(xi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  convert_f32_to_bf16_scalar(src + i, dst + i, n - i);
}

// kStream: dst is written in whole 64-byte lines with streaming stores that bypass the caches, so
// the lines are not read first (no read-for-ownership) and do not evict what the caller still
// works on; the elements before dst's first 64-byte boundary and the tail are plain stores.
template <bool kStream>
__attribute__((target("avx512f")))
void bf16_to_f32_avx512f(const bfloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (kStream) {
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; ++i) dst[i] = static_cast<float>(src[i]);
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    if constexpr (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), w);
    else _mm512_storeu_si512(dst + i, w);
  }
  // Streamed lines are globally visible before anyone is told the result is ready.
  if constexpr (kStream) _mm_sfence();
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---- f32 <-> f16 (F16C: IEEE conversion with subnormals, RNE by the immediate) ----------------
__attribute__((target("avx,f16c")))
void f32_to_f16_f16c(const float* src, half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  convert_f32_to_f16_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx,f16c")))
void f16_to_f32_f16c(const half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <class S, class D>
void convert_loop(const S* src, D* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<D, bool>) {
      dst[i] = static_cast<compute_t<S>>(src[i]) != compute_t<S>(0);
    } else if constexpr (std::is_same_v<D, half> || std::is_same_v<D, bfloat16>) {
      dst[i] = D(static_cast<float>(src[i]));
    } else {
      dst[i] = static_cast<D>(static_cast<compute_t<S>>(src[i]));
    }
  }
}

}  // namespace

void convert_for_later(const void* src, DType sdt, void* dst, DType ddt, int64_t n) {
  if (sdt == DType::bf16 && ddt == DType::f32 && n >= kStreamingMinElements && cpu_features().avx512f) {
    return bf16_to_f32_avx512f<true>(static_cast<const bfloat16*>(src), static_cast<float*>(dst), n);
  }
  convert(src, sdt, dst, ddt, n);
}

void convert_f32_to_bf16_scalar(const float* src, bfloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16(src[i]);
}

void convert_f32_to_f16_scalar(const float* src, half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half(src[i]);
}

void convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n) {
  if (n <= 0) return;
  if (sdt == ddt) {
    if (src != dst) std::memmove(dst, src, static_cast<size_t>(n) * element_size(sdt));
    return;
  }
  const CpuFeatures& cpu = cpu_features();
  if (sdt == DType::f32 && ddt == DType::bf16) {
    auto* s = static_cast<const float*>(src);
    auto* d = static_cast<bfloat16*>(dst);
    if (cpu.avx512_bf16 && cpu.avx512bw && cpu.avx512vl) return f32_to_bf16_avx512bf16(s, d, n);
    if (cpu.avx512f && cpu.avx512bw) return f32_to_bf16_avx512f(s, d, n);
    return convert_f32_to_bf16_scalar(s, d, n);
  }
  if (sdt == DType::bf16 && ddt == DType::f32) {
    if (cpu.avx512f) return bf16_to_f32_avx512f<false>(static_cast<const bfloat16*>(src), static_cast<float*>(dst), n);
  }
  if (sdt == DType::f32 && ddt == DType::f16 && cpu.f16c) {
    return f32_to_f16_f16c(static_cast<const float*>(src), static_cast<half*>(dst), n);
  }
  if (sdt == DType::f16 && ddt == DType::f32 && cpu.f16c) {
    return f16_to_f32_f16c(static_cast<const half*>(src), static_cast<float*>(dst), n);
  }
  TANDEM_DISPATCH_ALL(sdt, "convert", [&] {
    using S = scalar_t;
    TANDEM_DISPATCH_ALL(ddt, "convert", [&] {
      convert_loop(static_cast<const S*>(src), static_cast<scalar_t*>(dst), n);
    });
  });
}

}  // namespace tandem
