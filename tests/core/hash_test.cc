// core/hash.h: checksum64 (DDP's replica checks) tells apart buffers that differ anywhere.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "tandem/core/hash.h"

namespace {

std::vector<uint8_t> bytes(size_t n) {
  std::vector<uint8_t> b(n);
  uint64_t s = 88172645463325252ull;
  for (auto& x : b) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    x = static_cast<uint8_t>(s);
  }
  return b;
}

}  // namespace

// Every single-bit flip, at every byte of the 32-byte rounds and of the tail, changes the checksum;
// the same bytes give the same checksum; the seed and the length count.
TEST(Hash, Checksum64ChangesWithEveryBitAndLength) {
  for (size_t n : {0, 1, 7, 31, 32, 33, 100, 257}) {
    std::vector<uint8_t> b = bytes(n);
    const uint64_t h = tandem::checksum64(b.data(), n);
    EXPECT_EQ(h, tandem::checksum64(bytes(n).data(), n)) << n;
    EXPECT_NE(h, tandem::checksum64(b.data(), n, 7)) << n;
    std::set<uint64_t> seen{h};
    for (size_t i = 0; i < n; ++i) {
      for (int bit = 0; bit < 8; ++bit) {
        b[i] ^= static_cast<uint8_t>(1u << bit);
        seen.insert(tandem::checksum64(b.data(), n));
        b[i] ^= static_cast<uint8_t>(1u << bit);
      }
    }
    EXPECT_EQ(seen.size(), 1 + 8 * n) << "a flipped bit went unnoticed or two flips collided, n = " << n;
    // A zero byte appended (the same words, one more tail byte) is another buffer.
    std::vector<uint8_t> longer = b;
    longer.push_back(0);
    EXPECT_NE(h, tandem::checksum64(longer.data(), n + 1)) << n;
  }
  // Words swapped between lanes or between rounds are other buffers too.
  std::vector<uint8_t> b = bytes(64);
  std::vector<uint8_t> swapped = b;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
  EXPECT_NE(tandem::checksum64(b.data(), 64), tandem::checksum64(swapped.data(), 64));
  swapped = b;
  std::swap_ranges(swapped.begin(), swapped.begin() + 32, swapped.begin() + 32);
  EXPECT_NE(tandem::checksum64(b.data(), 64), tandem::checksum64(swapped.data(), 64));
}
