// Element-wise reductions over N arrays, in blocks that stay in L1: widen the first input into an
// accumulator block, combine the others into it, narrow once into the output. Each dtype has one
// entry point compiled three times (target_clones); the loops are plain so the vectoriser does
// the rest.
#include "tandem/dist/shm_kernels.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace tandem::dist::shm {
namespace {

constexpr int kBlock = 512;

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
    // Round to nearest even, NaN kept quiet: detail::float_to_bf16_bits in a vectorisable form.
    const uint32_t x = std::bit_cast<uint32_t>(a);
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
  auto fin = [&](A v) -> A {
    if constexpr (OP == ReduceOp::AVG) return v / d;
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

}  // namespace

void reduce_arrays(void* out, const void* const* in, int nin, int64_t count, DType dtype, ReduceOp op,
                   int avg_divisor) {
  if (count <= 0) return;
  TANDEM_CHECK(nin >= 1, ValueError, "reduce_arrays: need at least one input, got {}", nin);
  switch (dtype) {
    case DType::f32: return reduce_f32(out, in, nin, count, op, avg_divisor);
    case DType::f64: return reduce_f64(out, in, nin, count, op, avg_divisor);
    case DType::bf16: return reduce_bf16(out, in, nin, count, op, avg_divisor);
    case DType::f16: return reduce_f16(out, in, nin, count, op, avg_divisor);
    case DType::i32: return reduce_i32(out, in, nin, count, op, avg_divisor);
    case DType::i64: return reduce_i64(out, in, nin, count, op, avg_divisor);
    case DType::u8: return reduce_u8(out, in, nin, count, op, avg_divisor);
    case DType::b8: break;
  }
  throw ValueError(fmt::format("{} reduction on a bool buffer: reductions need a numeric dtype "
                               "(f32, f64, f16, bf16, i32, i64, u8); cast to u8 first",
                               reduce_op_name(op)));
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
