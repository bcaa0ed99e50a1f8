// FNV-1a, 64 bits: a cheap, stable hash of bytes (checksums compared across ranks, stream keys).
// Not for anything adversarial.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

// Continues hash `h` over `n` bytes at `data` (start from the default to hash from scratch).
inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace tandem
