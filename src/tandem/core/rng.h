// Counter-based random numbers (Philox4x32-10). A Generator is (seed, offset): element i of a
// draw depends only on the seed and on offset + i, so results do not depend on threading or
// on how a draw is split, and a generator's state is two integers to save and restore.
#pragma once

#include <array>
#include <cstdint>

namespace tandem {

// One Philox4x32-10 block: four 32-bit outputs for a 128-bit counter and a 64-bit key.
std::array<uint32_t, 4> philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key);

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void manual_seed(uint64_t seed) { seed_ = seed; offset_ = 0; }
  void set_offset(uint64_t offset) { offset_ = offset; }
  // Reserves `n` 32-bit draws and returns the first counter of the reservation.
  uint64_t reserve(uint64_t n) { const uint64_t o = offset_; offset_ += (n + 3) / 4; return o; }

  // The i-th uniform 32-bit value of a reservation starting at `base` (a block counter).
  uint32_t bits(uint64_t base, uint64_t i) const;
  // Uniform in [0, 1) with 24 random bits.
  float uniform(uint64_t base, uint64_t i) const { return static_cast<float>(bits(base, i) >> 8) * (1.0f / 16777216.0f); }
  // Uniform in [0, 1) with 53 random bits, from draws 2i and 2i+1.
  double uniform_double(uint64_t base, uint64_t i) const;

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;  // in 128-bit blocks
};

// The calling thread's default generator (seed 0 until manual_seed). Thread-local, so two
// threads never race on it.
Generator& default_generator();
// Seeds the calling thread's default generator, like torch.manual_seed.
void manual_seed(uint64_t seed);

}  // namespace tandem
