// Element-wise reductions over N arrays, in blocks that stay in L1: widen the first input into an
// accumulator block, combine the others into it, narrow once into the output. Each dtype has one
// entry point compiled three times (target_clones); the loops are plain so the vectoriser does
// the rest.
#include "tandem/dist/shm_kernels.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include <immintrin.h>

namespace tandem::dist::shm {
namespace {

constexpr int kBlock = 512;

template <class X>
constexpr bool is_pow2(X d) {
  const auto n = static_cast<int64_t>(d);
  return n >= 1 && static_cast<X>(n) == d && (n & (n - 1)) == 0;
}

// Storage type -> (bits type in memory, accumulator type).
template <class T> struct Traits { using Mem = T; using Acc = T; };
template <> struct Traits<bfloat16> { using Mem = uint16_t; using Acc = float; };
template <> struct Traits<half> { using Mem = uint16_t; using Acc = float; };

// Widening load and narrowing store of one element (the accumulator is f32 for f16/bf16).
template <class T>
[[gnu::always_inline]] inline typename Traits<T>::Acc ld(typename Traits<T>::Mem x) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
  } else if constexpr (std::is_same_v<T, half>) {
    return ::tandem::detail::half_bits_to_float(x);
  } else {
    return x;
  }
}

template <class T>
[[gnu::always_inline]] inline typename Traits<T>::Mem st(typename Traits<T>::Acc a) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    // Round to nearest even, NaN kept quiet, f32 subnormals flushed to a signed zero: what
    // AVX-512 BF16's vcvtne2ps2bf16 does, so that every path gives the same bits.
    uint32_t x = std::bit_cast<uint32_t>(a);
    x = (x & 0x7f800000u) == 0 ? x & 0x80000000u : x;
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const uint32_t nan = (x >> 16) | 0x40u;
    return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  } else if constexpr (std::is_same_v<T, half>) {
    return ::tandem::detail::float_to_half_bits(a);
  } else {
    return a;
  }
}

template <class A>
[[gnu::always_inline]] inline A add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <class A>
[[gnu::always_inline]] inline A mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <ReduceOp OP, class A>
[[gnu::always_inline]] inline A combine(A a, A b) {
  if constexpr (OP == ReduceOp::SUM || OP == ReduceOp::AVG) return add(a, b);
  else if constexpr (OP == ReduceOp::PRODUCT) return mul(a, b);
  else if constexpr (OP == ReduceOp::MAX) return b > a ? b : a;
  else return b < a ? b : a;
}

// out = op over the inputs, one block at a time: the first two inputs are combined straight
// into the accumulator, middle ones added to it, the last one combined while narrowing into out;
// with two inputs that is a single pass with no accumulator at all.
template <class T, ReduceOp OP>
[[gnu::always_inline]] inline void reduce_op(void* out_v, const void* const* in_v, int nin, int64_t count,
                                             int avg_divisor) {
  using M = typename Traits<T>::Mem;
  using A = typename Traits<T>::Acc;
  // `out` may be one of the inputs, element for element: no loop-carried dependence, so the
  // loops are marked ivdep (otherwise GCC versions them and runs in-place calls scalar).
  M* out = static_cast<M*>(out_v);
  const A d = static_cast<A>(avg_divisor);
  // A power-of-two divisor as a multiplication by its exact reciprocal (same bits, see Div512).
  const A inv = std::is_floating_point_v<A> ? static_cast<A>(1) / d : A{};
  const bool pow2 = std::is_floating_point_v<A> && is_pow2(avg_divisor);
  auto fin = [&](A v) -> A {
    if constexpr (OP == ReduceOp::AVG) return pow2 ? v * inv : v / d;
    else return v;
  };
  const M* in0 = static_cast<const M*>(in_v[0]);
  if (nin == 1) {
#pragma GCC ivdep
    for (int64_t i = 0; i < count; ++i) out[i] = st<T>(fin(ld<T>(in0[i])));
    return;
  }
  const M* in1 = static_cast<const M*>(in_v[1]);
  if (nin == 2) {
#pragma GCC ivdep
    for (int64_t i = 0; i < count; ++i) out[i] = st<T>(fin(combine<OP>(ld<T>(in0[i]), ld<T>(in1[i]))));
    return;
  }
  const M* last = static_cast<const M*>(in_v[nin - 1]);
  for (int64_t b = 0; b < count; b += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, count - b));
    A acc[kBlock];
#pragma GCC ivdep
    for (int i = 0; i < n; ++i) acc[i] = combine<OP>(ld<T>(in0[b + i]), ld<T>(in1[b + i]));
    for (int k = 2; k < nin - 1; ++k) {
      const M* src = static_cast<const M*>(in_v[k]) + b;
#pragma GCC ivdep
      for (int i = 0; i < n; ++i) acc[i] = combine<OP>(acc[i], ld<T>(src[i]));
    }
#pragma GCC ivdep
    for (int i = 0; i < n; ++i) out[b + i] = st<T>(fin(combine<OP>(acc[i], ld<T>(last[b + i]))));
  }
}

template <class T>
[[gnu::always_inline]] inline void reduce_impl(void* out, const void* const* in, int nin, int64_t count, ReduceOp op,
                                               int avg_divisor) {
  switch (op) {
    case ReduceOp::SUM: return reduce_op<T, ReduceOp::SUM>(out, in, nin, count, avg_divisor);
    case ReduceOp::AVG: return reduce_op<T, ReduceOp::AVG>(out, in, nin, count, avg_divisor);
    case ReduceOp::PRODUCT: return reduce_op<T, ReduceOp::PRODUCT>(out, in, nin, count, avg_divisor);
    case ReduceOp::MAX: return reduce_op<T, ReduceOp::MAX>(out, in, nin, count, avg_divisor);
    case ReduceOp::MIN: return reduce_op<T, ReduceOp::MIN>(out, in, nin, count, avg_divisor);
  }
}

// ---- hand-written 16-bit paths (runtime dispatch; the compiler does not vectorise the
// conversions well): AVX-512 BF16 for bf16 (vcvtne2ps2bf16 narrows 32 lanes in one
// instruction), AVX-512F or AVX2 + F16C for f16 (vcvtph2ps / vcvtps2ph). Same numerics as the
// generic loops: widen, combine in f32 in input order, divide for AVG, round once. Tails use
// masked loads/stores (AVX-512) or a padded copy (AVX2), so every element takes the same
// instructions.
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512bf16")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512_cvtps_ph / _mm512_undefined_*
#define TANDEM_TGT_BF16 [[gnu::always_inline]] inline
#define TANDEM_TGT_512 [[gnu::always_inline]] inline
// Software prefetch distance (elements, 16 KiB of 16-bit data): with two or more streams from
// L3 or another core's cache the hardware prefetchers alone leave the 16-bit loops ~25% short
// of the f32 loop's bandwidth (measured on 4M-element arrays; 8-32 KiB all help, 16 KiB best).
constexpr int64_t kPrefetch = 8192;
// AVG's division. By a power of two (2, 4, 8 ranks) it is a multiplication by the exact
// reciprocal: the same bits (both round v * 2^-k once), without vdivps, whose throughput of
// about one per 16 cycles would otherwise bound a two-input f32 loop below L3 bandwidth.
struct Div512 {
  __m512 d, inv;
  bool pow2;
  TANDEM_TGT_512 explicit Div512(float divisor)
      : d(_mm512_set1_ps(divisor)), inv(_mm512_set1_ps(1.0f / divisor)), pow2(is_pow2(divisor)) {}
  TANDEM_TGT_512 __m512 operator()(__m512 v) const { return pow2 ? _mm512_mul_ps(v, inv) : _mm512_div_ps(v, d); }
};
// N > 0: N pointers copied into locals (registers once the loops over them unroll); 0: read
// through the caller's array.
template <class P, int N>
struct Ptrs {
  P p[N];
  TANDEM_TGT_512 explicit Ptrs(const P* src) { for (int i = 0; i < N; ++i) p[i] = src[i]; }
  TANDEM_TGT_512 P operator[](int i) const { return p[i]; }
};
template <class P>
struct Ptrs<P, 0> {
  const P* p;
  TANDEM_TGT_512 explicit Ptrs(const P* src) : p(src) {}
  TANDEM_TGT_512 P operator[](int i) const { return p[i]; }
};
// What every AVX-512 kernel below starts from: its inputs and outputs (element bits M; NIN,
// NOUT > 0: that many, known at compile time) and AVG's divisor.
template <class M, int NIN, int NOUT>
struct Streams {
  int nin, nout;
  Ptrs<const M*, NIN> in;
  Ptrs<M*, NOUT> outs;
  Div512 div;
  TANDEM_TGT_512 Streams(M* const* outs_p, int nout_dyn, const M* const* in_p, int nin_dyn, float d)
      : nin(NIN > 0 ? NIN : nin_dyn), nout(NOUT > 0 ? NOUT : nout_dyn), in(in_p), outs(outs_p), div(d) {}
};
// Runs f(NIN, NOUT) as compile-time constants: (2, 1) and (2, 2), the 2-rank shapes, get their
// own instantiation; everything else (0, 0), read through the arrays.
template <class F>
TANDEM_TGT_512 void by_arity(int nin, int nout, F&& f) {
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  if (nin == 2 && nout == 1) f(I2{}, I1{});
  else if (nin == 2 && nout == 2) f(I2{}, I2{});
  else f(I0{}, I0{});
}
template <ReduceOp OP>
TANDEM_TGT_512 __m512 vcomb512(__m512 a, __m512 b) {
  if constexpr (OP == ReduceOp::SUM || OP == ReduceOp::AVG) return _mm512_add_ps(a, b);
  else if constexpr (OP == ReduceOp::PRODUCT) return _mm512_mul_ps(a, b);
  else if constexpr (OP == ReduceOp::MAX) return _mm512_max_ps(b, a);  // b > a ? b : a, NaN in b -> a
  else return _mm512_min_ps(b, a);
}
struct F16x512 {
  TANDEM_TGT_512 static __m512 ld(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TANDEM_TGT_512 static __m512 ld_masked(const uint16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  // 32 narrowed elements, in order, for one 64-byte store per output.
  TANDEM_TGT_512 static __m512i narrow(__m512 lo, __m512 hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                              _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 1);
  }
};

// 32 elements per step, stored into each of the nout outputs. NIN, NOUT > 0: that many inputs
// and outputs, known at compile time (the 2-rank case).
template <class C, ReduceOp OP, int NIN, int NOUT>
[[gnu::always_inline]] inline void reduce16_512(const Streams<uint16_t, NIN, NOUT>& st, int64_t count) {
  const auto& [nin, nout, in, outs, div] = st;
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    if (i + kPrefetch < count) {
      for (int k = 0; k < nin; ++k) _mm_prefetch(reinterpret_cast<const char*>(in[k] + i + kPrefetch), _MM_HINT_T0);
    }
    __m512 lo = C::ld(in[0] + i), hi = C::ld(in[0] + i + 16);
    for (int k = 1; k < nin; ++k) {
      lo = vcomb512<OP>(lo, C::ld(in[k] + i));
      hi = vcomb512<OP>(hi, C::ld(in[k] + i + 16));
    }
    if constexpr (OP == ReduceOp::AVG) { lo = div(lo); hi = div(hi); }
    const __m512i r = C::narrow(lo, hi);
    for (int j = 0; j < nout; ++j) _mm512_storeu_si512(outs[j] + i, r);
  }
  if (i < count) {
    const int r = static_cast<int>(count - i);  // 1..31
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << r) - 1);
    const __mmask16 mlo = static_cast<__mmask16>(m), mhi = static_cast<__mmask16>(m >> 16);
    __m512 lo = C::ld_masked(in[0] + i, mlo), hi = C::ld_masked(in[0] + i + 16, mhi);
    for (int k = 1; k < nin; ++k) {
      lo = vcomb512<OP>(lo, C::ld_masked(in[k] + i, mlo));
      hi = vcomb512<OP>(hi, C::ld_masked(in[k] + i + 16, mhi));
    }
    if constexpr (OP == ReduceOp::AVG) { lo = div(lo); hi = div(hi); }
    const __m512i v = C::narrow(lo, hi);
    for (int j = 0; j < nout; ++j) _mm512_mask_storeu_epi16(outs[j] + i, m, v);
  }
}

template <class C, ReduceOp OP>
[[gnu::always_inline]] inline void reduce16_512_op(void* const* outs, int nout, const void* const* in, int nin,
                                                   int64_t count, int d) {
  by_arity(nin, nout, [&](auto ni, auto no) {
    reduce16_512<C, OP>(Streams<uint16_t, ni(), no()>(reinterpret_cast<uint16_t* const*>(outs), nout,
                                                      reinterpret_cast<const uint16_t* const*>(in), nin, static_cast<float>(d)),
                        count);
  });
}

// f32, 16 elements per step, stored into each of the nout outputs; the same operations in the
// same order as the generic loops (combine left to right, then divide for AVG).
template <ReduceOp OP, int NIN, int NOUT>
TANDEM_TGT_512 void reduce_f32_512(const Streams<float, NIN, NOUT>& st, int64_t count) {
  const auto& [nin, nout, in, outs, div] = st;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m512 v = _mm512_loadu_ps(in[0] + i);
    for (int k = 1; k < nin; ++k) v = vcomb512<OP>(v, _mm512_loadu_ps(in[k] + i));
    if constexpr (OP == ReduceOp::AVG) v = div(v);
    for (int j = 0; j < nout; ++j) _mm512_storeu_ps(outs[j] + i, v);
  }
  if (i < count) {
    const __mmask16 m = static_cast<__mmask16>((1u << (count - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, in[0] + i);
    for (int k = 1; k < nin; ++k) v = vcomb512<OP>(v, _mm512_maskz_loadu_ps(m, in[k] + i));
    if constexpr (OP == ReduceOp::AVG) v = div(v);
    for (int j = 0; j < nout; ++j) _mm512_mask_storeu_ps(outs[j] + i, m, v);
  }
}
template <class /*unused*/, ReduceOp OP>
TANDEM_TGT_512 void reduce_f32_512_op(void* const* outs, int nout, const void* const* in, int nin, int64_t count, int d) {
  by_arity(nin, nout, [&](auto ni, auto no) {
    reduce_f32_512<OP>(Streams<float, ni(), no()>(reinterpret_cast<float* const*>(outs), nout,
                                                  reinterpret_cast<const float* const*>(in), nin, static_cast<float>(d)),
                       count);
  });
}

#define TANDEM_DISPATCH_OPS(fn, C)                                                             \
  switch (op) {                                                                                \
    case ReduceOp::SUM: return fn<C, ReduceOp::SUM>(outs, nout, in, nin, count, d);             \
    case ReduceOp::AVG: return fn<C, ReduceOp::AVG>(outs, nout, in, nin, count, d);             \
    case ReduceOp::PRODUCT: return fn<C, ReduceOp::PRODUCT>(outs, nout, in, nin, count, d);     \
    case ReduceOp::MAX: return fn<C, ReduceOp::MAX>(outs, nout, in, nin, count, d);             \
    case ReduceOp::MIN: return fn<C, ReduceOp::MIN>(outs, nout, in, nin, count, d);             \
  }

// bf16, 32 elements per 64-byte load: a bf16 is the top half of an f32, so the even elements
// widen with one shift and the odd ones with one mask (no cross-lane widening shuffles);
// vcvtne2ps2bf16 narrows both halves at once and one vpermw puts the elements back in order.
struct Bf16Pair {
  __m512 ev, od;
};
TANDEM_TGT_BF16 Bf16Pair bf16_widen(__m512i x) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
template <ReduceOp OP, int NIN, int NOUT>
TANDEM_TGT_BF16 void reduce_bf16_512(const Streams<uint16_t, NIN, NOUT>& st, int64_t count) {
  const auto& [nin, nout, in, outs, div] = st;
  // out[2j] = r[j] (even, low half of r), out[2j+1] = r[16 + j] (odd, high half)
  alignas(64) static constexpr uint16_t kIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  auto finish = [&](Bf16Pair a) {
    if constexpr (OP == ReduceOp::AVG) { a.ev = div(a.ev); a.od = div(a.od); }
    return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(a.od, a.ev)));
  };
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    if (i + kPrefetch < count) {
      for (int k = 0; k < nin; ++k) _mm_prefetch(reinterpret_cast<const char*>(in[k] + i + kPrefetch), _MM_HINT_T0);
    }
    Bf16Pair a = bf16_widen(_mm512_loadu_si512(in[0] + i));
    for (int k = 1; k < nin; ++k) {
      const Bf16Pair b = bf16_widen(_mm512_loadu_si512(in[k] + i));
      a.ev = vcomb512<OP>(a.ev, b.ev);
      a.od = vcomb512<OP>(a.od, b.od);
    }
    const __m512i r = finish(a);
    for (int j = 0; j < nout; ++j) _mm512_storeu_si512(outs[j] + i, r);
  }
  if (i < count) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (count - i)) - 1);
    Bf16Pair a = bf16_widen(_mm512_maskz_loadu_epi16(m, in[0] + i));
    for (int k = 1; k < nin; ++k) {
      const Bf16Pair b = bf16_widen(_mm512_maskz_loadu_epi16(m, in[k] + i));
      a.ev = vcomb512<OP>(a.ev, b.ev);
      a.od = vcomb512<OP>(a.od, b.od);
    }
    const __m512i r = finish(a);
    for (int j = 0; j < nout; ++j) _mm512_mask_storeu_epi16(outs[j] + i, m, r);
  }
}
template <class /*unused*/, ReduceOp OP>
TANDEM_TGT_BF16 void reduce_bf16_512_op(void* const* outs, int nout, const void* const* in, int nin, int64_t count,
                                        int d) {
  by_arity(nin, nout, [&](auto ni, auto no) {
    reduce_bf16_512<OP>(Streams<uint16_t, ni(), no()>(reinterpret_cast<uint16_t* const*>(outs), nout,
                                                      reinterpret_cast<const uint16_t* const*>(in), nin, static_cast<float>(d)),
                        count);
  });
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void reduce_bf16_avx512(
    void* const* outs, int nout, const void* const* in, int nin, int64_t count, ReduceOp op, int d) {
  TANDEM_DISPATCH_OPS(reduce_bf16_512_op, void)
}
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void reduce_f16_avx512(
    void* const* outs, int nout, const void* const* in, int nin, int64_t count, ReduceOp op, int d) {
  TANDEM_DISPATCH_OPS(reduce16_512_op, F16x512)
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) void reduce_f32_avx512(
    void* const* outs, int nout, const void* const* in, int nin, int64_t count, ReduceOp op, int d) {
  TANDEM_DISPATCH_OPS(reduce_f32_512_op, void)
}

#undef TANDEM_TGT_BF16
#undef TANDEM_TGT_512
#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define TANDEM_TGT_AVX2 [[gnu::always_inline]] inline
template <ReduceOp OP>
TANDEM_TGT_AVX2 __m256 vcomb256(__m256 a, __m256 b) {
  if constexpr (OP == ReduceOp::SUM || OP == ReduceOp::AVG) return _mm256_add_ps(a, b);
  else if constexpr (OP == ReduceOp::PRODUCT) return _mm256_mul_ps(a, b);
  else if constexpr (OP == ReduceOp::MAX) return _mm256_max_ps(b, a);
  else return _mm256_min_ps(b, a);
}

// AVX2 + F16C f16: 8 lanes per step; the tail goes through zero-padded copies.
template <ReduceOp OP>
TANDEM_TGT_AVX2 __m128i f16_step_avx2(const uint16_t* const* in, int nin, int64_t i, __m256 dv) {
  __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[0] + i)));
  for (int k = 1; k < nin; ++k) {
    acc = vcomb256<OP>(acc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[k] + i))));
  }
  if constexpr (OP == ReduceOp::AVG) acc = _mm256_div_ps(acc, dv);
  return _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
template <ReduceOp OP>
TANDEM_TGT_AVX2 void reduce_f16_avx2_op(void* out_v, const void* const* in_v, int nin, int64_t count, int d) {
  auto* out = static_cast<uint16_t*>(out_v);
  auto* in = reinterpret_cast<const uint16_t* const*>(in_v);
  const __m256 dv = _mm256_set1_ps(static_cast<float>(d));
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), f16_step_avx2<OP>(in, nin, i, dv));
  if (i < count) {
    const size_t r = static_cast<size_t>(count - i);
    uint16_t tmp[256][8] = {};  // nin <= 256 (the group size limit)
    const uint16_t* ptrs[256] = {};
    for (int k = 0; k < nin && k < 256; ++k) {
      std::memcpy(tmp[k], in[k] + i, r * 2);
      ptrs[k] = tmp[k];
    }
    uint16_t res[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(res), f16_step_avx2<OP>(ptrs, std::min(nin, 256), 0, dv));
    std::memcpy(out + i, res, r * 2);
  }
}
__attribute__((target("avx2,f16c"))) void reduce_f16_avx2(void* out, const void* const* in, int nin, int64_t count,
                                                           ReduceOp op, int d) {
  switch (op) {
    case ReduceOp::SUM: return reduce_f16_avx2_op<ReduceOp::SUM>(out, in, nin, count, d);
    case ReduceOp::AVG: return reduce_f16_avx2_op<ReduceOp::AVG>(out, in, nin, count, d);
    case ReduceOp::PRODUCT: return reduce_f16_avx2_op<ReduceOp::PRODUCT>(out, in, nin, count, d);
    case ReduceOp::MAX: return reduce_f16_avx2_op<ReduceOp::MAX>(out, in, nin, count, d);
    case ReduceOp::MIN: return reduce_f16_avx2_op<ReduceOp::MIN>(out, in, nin, count, d);
  }
}

#undef TANDEM_TGT_AVX2
#pragma GCC pop_options

using ReduceFn = void (*)(void*, const void* const*, int, int64_t, ReduceOp, int);
using ReduceToFn = void (*)(void* const*, int, const void* const*, int, int64_t, ReduceOp, int);

// A several-output kernel called with one output.
template <ReduceToFn F>
void one_output(void* out, const void* const* in, int nin, int64_t count, ReduceOp op, int d) {
  F(&out, 1, in, nin, count, op, d);
}

#define TANDEM_SHM_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))

TANDEM_SHM_CLONES void reduce_f32(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<float>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_f64(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<double>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_bf16(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<bfloat16>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_f16(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<half>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_i32(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<int32_t>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_i64(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<int64_t>(o, in, nin, c, op, d);
}
TANDEM_SHM_CLONES void reduce_u8(void* o, const void* const* in, int nin, int64_t c, ReduceOp op, int d) {
  reduce_impl<uint8_t>(o, in, nin, c, op, d);
}

struct Kernels {
  ReduceFn bf16, f16;
  // Several outputs in one pass (AVX-512 only); null: one output, then copies (reduce_arrays_to).
  ReduceToFn f32_to, bf16_to, f16_to;
  const char* bf16_name;
  const char* f16_name;
};

const Kernels& kernels() {
  static const Kernels k = [] {
    Kernels r{reduce_bf16, reduce_f16, nullptr, nullptr, nullptr, "generic", "generic"};
    if (const char* e = std::getenv("TANDEM_SHM_KERNELS"); e != nullptr && std::string_view(e) == "generic") return r;
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    if (avx512) r.f32_to = reduce_f32_avx512;
    if (avx512 && __builtin_cpu_supports("avx512bf16")) {
      r.bf16 = one_output<reduce_bf16_avx512>, r.bf16_to = reduce_bf16_avx512, r.bf16_name = "avx512bf16";
    }
    if (avx512 && __builtin_cpu_supports("f16c")) {
      r.f16 = one_output<reduce_f16_avx512>, r.f16_to = reduce_f16_avx512, r.f16_name = "avx512f+f16c";
    }
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      r.f16 = reduce_f16_avx2, r.f16_name = "avx2+f16c";
    }
    return r;
  }();
  return k;
}

}  // namespace

void reduce_arrays_generic(void* out, const void* const* in, int nin, int64_t count, DType dtype, ReduceOp op,
                           int avg_divisor) {
  if (count <= 0) return;
  if (dtype == DType::bf16) return reduce_bf16(out, in, nin, count, op, avg_divisor);
  if (dtype == DType::f16) return reduce_f16(out, in, nin, count, op, avg_divisor);
  reduce_arrays(out, in, nin, count, dtype, op, avg_divisor);
}

bool reduce_f16_avx2_for_tests(void* out, const void* const* in, int nin, int64_t count, ReduceOp op, int avg_divisor) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return false;
  if (count > 0) reduce_f16_avx2(out, in, nin, count, op, avg_divisor);
  return true;
}

const char* kernel_name(DType dtype) {
  if (dtype == DType::bf16) return kernels().bf16_name;
  if (dtype == DType::f16) return kernels().f16_name;
  return "generic";
}

void reduce_arrays(void* out, const void* const* in, int nin, int64_t count, DType dtype, ReduceOp op,
                   int avg_divisor) {
  if (count <= 0) return;
  TANDEM_CHECK(nin >= 1, ValueError, "reduce_arrays: need at least one input, got {}", nin);
  switch (dtype) {
    case DType::f32: return reduce_f32(out, in, nin, count, op, avg_divisor);
    case DType::f64: return reduce_f64(out, in, nin, count, op, avg_divisor);
    case DType::bf16: return kernels().bf16(out, in, nin, count, op, avg_divisor);
    case DType::f16: return kernels().f16(out, in, nin, count, op, avg_divisor);
    case DType::i32: return reduce_i32(out, in, nin, count, op, avg_divisor);
    case DType::i64: return reduce_i64(out, in, nin, count, op, avg_divisor);
    case DType::u8: return reduce_u8(out, in, nin, count, op, avg_divisor);
    case DType::b8: break;
  }
  throw ValueError(fmt::format("{} reduction on a bool buffer: reductions need a numeric dtype "
                               "(f32, f64, f16, bf16, i32, i64, u8); cast to u8 first",
                               reduce_op_name(op)));
}

void reduce_arrays_to(void* const* outs, int nout, const void* const* in, int nin, int64_t count, DType dtype,
                      ReduceOp op, int avg_divisor) {
  TANDEM_CHECK(nout >= 1, ValueError, "reduce_arrays_to: need at least one output, got {}", nout);
  if (count <= 0) return;
  if (nout == 1) return reduce_arrays(outs[0], in, nin, count, dtype, op, avg_divisor);
  TANDEM_CHECK(nin >= 1, ValueError, "reduce_arrays_to: need at least one input, got {}", nin);
  const Kernels& k = kernels();
  const ReduceToFn to = dtype == DType::f32 ? k.f32_to : dtype == DType::bf16 ? k.bf16_to : dtype == DType::f16 ? k.f16_to : nullptr;
  if (to != nullptr) return to(outs, nout, in, nin, count, op, avg_divisor);
  // 16 KiB pieces: reduced into outs[0], then copied from L1 into the others. A piece of an
  // output that is also an input is written only after that piece was read.
  const size_t es = element_size(dtype);
  const int64_t piece = static_cast<int64_t>(16384 / es);
  // The inputs advanced to the piece: on the stack for up to 16 (this runs once per chunk of an
  // all_reduce on CPUs without AVX-512).
  const void* at_small[16];
  std::vector<const void*> at_heap(nin > 16 ? static_cast<size_t>(nin) : 0);
  const void** at = nin > 16 ? at_heap.data() : at_small;
  for (int64_t b = 0; b < count; b += piece) {
    const int64_t m = std::min(piece, count - b);
    const size_t off = static_cast<size_t>(b) * es;
    for (int q = 0; q < nin; ++q) at[q] = static_cast<const uint8_t*>(in[q]) + off;
    void* first = static_cast<uint8_t*>(outs[0]) + off;
    reduce_arrays(first, at, nin, m, dtype, op, avg_divisor);
    for (int j = 1; j < nout; ++j) std::memcpy(static_cast<uint8_t*>(outs[j]) + off, first, static_cast<size_t>(m) * es);
  }
}

const char* short_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::b8: return "bool";
  }
  return "?";
}

}  // namespace tandem::dist::shm
