// Branch-free float math that compilers vectorise (libm's expf/tanhf are scalar calls).
// exp_approx: Cody-Waite range reduction and a degree-6 polynomial; relative error < 2e-7 over
// the clamped range [-87.3, 88.7] (results below e^-87.3 flush to ~1e-38, never 0/denormal).
#pragma once

#include <bit>
#include <cstdint>

namespace tandem::kernels {

inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  const float t = x * 1.44269504088896341f + shift;
  const float n = t - shift;
  float r = x - n * 0.693145751953125f;  // ln2 split in a high part exact in float ...
  r = r - n * 1.42860682030941723212e-6f;  // ... and the low remainder
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * std::bit_cast<float>(static_cast<uint32_t>(e) << 23);
}


}  // namespace tandem::kernels
