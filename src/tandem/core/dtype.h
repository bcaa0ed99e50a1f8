// Element types of tensors, and the compile-time map from DType to C++ scalar type.
// The numeric values of DType are stable (they appear in saved files); append, never reorder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tandem/core/half.h"

namespace tandem {

enum class DType : uint8_t { f32 = 0, f64, f16, bf16, i64, i32, u8, b8 };

inline constexpr DType kFloat32 = DType::f32;
inline constexpr DType kFloat64 = DType::f64;
inline constexpr DType kFloat16 = DType::f16;
inline constexpr DType kBFloat16 = DType::bf16;
inline constexpr DType kInt64 = DType::i64;
inline constexpr DType kInt32 = DType::i32;
inline constexpr DType kUInt8 = DType::u8;
inline constexpr DType kBool = DType::b8;

size_t element_size(DType t);
// PyTorch's spelling: "float32", "bfloat16", "int64", "bool", ...
std::string_view dtype_name(DType t);
bool is_floating(DType t);
// f16 and bf16: stored in 16 bits, computed in f32.
inline bool is_reduced_float(DType t) { return t == DType::f16 || t == DType::bf16; }
// PyTorch's promotion between two tensor dtypes (f32 + bf16 -> f32, bf16 + f16 -> f32, ...).
DType promote_types(DType a, DType b);

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };

// The type arithmetic on T runs in: float for the 16-bit floats, T otherwise.
template <class T> struct compute_type { using type = T; };
template <> struct compute_type<half> { using type = float; };
template <> struct compute_type<bfloat16> { using type = float; };
template <class T> using compute_t = typename compute_type<T>::type;

}  // namespace tandem

// Runs the trailing lambda-body with `scalar_t` bound to the C++ type of `dtype`.
#define TANDEM_DTYPE_CASE(D, T, ...) \
  case D: {                          \
    using scalar_t = T;              \
    return __VA_ARGS__();            \
  }

#define TANDEM_DISPATCH_FLOATING(dtype, opname, ...)                                      \
  [&] {                                                                                   \
    switch (dtype) {                                                                      \
      TANDEM_DTYPE_CASE(::tandem::DType::f32, float, __VA_ARGS__)                         \
      TANDEM_DTYPE_CASE(::tandem::DType::f64, double, __VA_ARGS__)                        \
      TANDEM_DTYPE_CASE(::tandem::DType::bf16, ::tandem::bfloat16, __VA_ARGS__)           \
      TANDEM_DTYPE_CASE(::tandem::DType::f16, ::tandem::half, __VA_ARGS__)                \
      default:                                                                            \
        throw ::tandem::DTypeError(fmt::format("{}: expected a floating-point tensor (float32, " \
                                               "float64, bfloat16, float16), got {}",     \
                                               opname, ::tandem::dtype_name(dtype)));     \
    }                                                                                     \
  }()

#define TANDEM_DISPATCH_ALL(dtype, opname, ...)                                           \
  [&] {                                                                                   \
    switch (dtype) {                                                                      \
      TANDEM_DTYPE_CASE(::tandem::DType::f32, float, __VA_ARGS__)                         \
      TANDEM_DTYPE_CASE(::tandem::DType::f64, double, __VA_ARGS__)                        \
      TANDEM_DTYPE_CASE(::tandem::DType::bf16, ::tandem::bfloat16, __VA_ARGS__)           \
      TANDEM_DTYPE_CASE(::tandem::DType::f16, ::tandem::half, __VA_ARGS__)                \
      TANDEM_DTYPE_CASE(::tandem::DType::i64, int64_t, __VA_ARGS__)                       \
      TANDEM_DTYPE_CASE(::tandem::DType::i32, int32_t, __VA_ARGS__)                       \
      TANDEM_DTYPE_CASE(::tandem::DType::u8, uint8_t, __VA_ARGS__)                        \
      TANDEM_DTYPE_CASE(::tandem::DType::b8, bool, __VA_ARGS__)                           \
    }                                                                                     \
    throw ::tandem::DTypeError(fmt::format("{}: unknown dtype", opname));                 \
  }()
