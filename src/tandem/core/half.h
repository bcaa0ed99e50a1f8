// 16-bit floating-point scalars: IEEE binary16 (`half`) and bfloat16. Conversion from float
// rounds to nearest even; NaN stays NaN (quiet), infinities and subnormals are exact.
#pragma once

#include <bit>
#include <cstdint>

namespace tandem {

namespace detail {

inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN (NaN keeps its top payload bits and is made quiet)
    return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 places the half subnormal's units
    // (2^-24) in the f32 mantissa's last bit, and the FPU's own round-to-nearest-even rounds.
    const float shifted = std::bit_cast<float>(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  const uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;  // rebias exponent 127 -> 15, add rounding bias (ties to even)
  return static_cast<uint16_t>(sign | (ax >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return std::bit_cast<float>(sign);
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
  }
  // inf, or NaN made quiet (as F16C's vcvtph2ps does, so that scalar and vector paths agree)
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

}  // namespace detail

// IEEE 754 binary16. Arithmetic goes through float.
struct half {
  uint16_t bits = 0;
  half() = default;
  half(float f) : bits(detail::float_to_half_bits(f)) {}  // NOLINT: implicit like a float type
  operator float() const { return detail::half_bits_to_float(bits); }
  static half from_bits(uint16_t b) { half h; h.bits = b; return h; }
};

// bfloat16: the top 16 bits of an f32. Arithmetic goes through float.
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  bfloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}  // NOLINT
  operator float() const { return detail::bf16_bits_to_float(bits); }
  static bfloat16 from_bits(uint16_t b) { bfloat16 h; h.bits = b; return h; }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

}  // namespace tandem
