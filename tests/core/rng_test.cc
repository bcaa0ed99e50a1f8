// Philox4x32-10 against the Random123 known answers, and the determinism and statistics of
// the generators built on it.
#include <cmath>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;

namespace {

// Random123's kat_vectors list the counter as words v[0..3] and the key as k[0..1]; our API takes
// the counter as (v[0] | v[1] << 32, v[2] | v[3] << 32) and the key as k[0] | k[1] << 32.
std::array<uint32_t, 4> philox(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  return td::philox4x32(uint64_t{ctr[0]} | (uint64_t{ctr[1]} << 32), uint64_t{ctr[2]} | (uint64_t{ctr[3]} << 32),
                        uint64_t{key[0]} | (uint64_t{key[1]} << 32));
}

struct Moments {
  double mean = 0, var = 0, min = INFINITY, max = -INFINITY;
};
Moments moments(const std::vector<double>& v) {
  Moments m;
  for (double x : v) {
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= static_cast<double>(v.size());
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= static_cast<double>(v.size() - 1);
  return m;
}

}  // namespace

TEST(Philox, Random123KnownAnswers) {
  // Random123 1.14, examples/kat_vectors: "philox4x32 10 <ctr x4> <key x2> <out x4>".
  EXPECT_EQ(philox({0, 0, 0, 0}, {0, 0}), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Generator, BitsComeFromConsecutiveBlocks) {
  td::Generator g(1234);
  for (uint64_t i = 0; i < 12; ++i) {
    EXPECT_EQ(g.bits(10, i), td::philox4x32(10 + i / 4, 0, 1234)[i % 4]);
  }
  EXPECT_EQ(g.reserve(5), 0u);
  EXPECT_EQ(g.offset(), 2u);  // 5 draws need 2 blocks of 4
  EXPECT_EQ(g.reserve(4), 2u);
  EXPECT_EQ(g.offset(), 3u);
  g.manual_seed(9);
  EXPECT_EQ(g.seed(), 9u);
  EXPECT_EQ(g.offset(), 0u);
}

TEST(Generator, SameSeedSameValuesDifferentSeedsDiffer) {
  td::Generator a(42), b(42), c(43);
  const auto va = td::rand({1000}, td::kFloat32, &a).to_vector();
  const auto vb = td::rand({1000}, td::kFloat32, &b).to_vector();
  const auto vc = td::rand({1000}, td::kFloat32, &c).to_vector();
  EXPECT_EQ(va, vb);
  int same = 0;
  for (size_t i = 0; i < va.size(); ++i) same += va[i] == vc[i];
  EXPECT_LT(same, 5);  // two independent 24-bit uniforms agree with probability 2^-24
  // The next draw continues the stream instead of repeating it.
  const auto va2 = td::rand({1000}, td::kFloat32, &a).to_vector();
  EXPECT_NE(va, va2);
  // Two draws of 8 equal one draw of 16 (8 is a whole number of 4-value blocks).
  td::Generator d(5), e(5);
  std::vector<double> two = td::rand({8}, td::kFloat32, &d).to_vector();
  const auto second = td::rand({8}, td::kFloat32, &d).to_vector();
  two.insert(two.end(), second.begin(), second.end());
  EXPECT_EQ(two, td::rand({16}, td::kFloat32, &e).to_vector());
  // Restoring (seed, offset) replays.
  td::Generator f(77);
  td::rand({3}, td::kFloat32, &f);
  const uint64_t off = f.offset();
  const auto x1 = td::randn({10}, td::kFloat64, &f).to_vector();
  f.set_offset(off);
  EXPECT_EQ(td::randn({10}, td::kFloat64, &f).to_vector(), x1);
}

TEST(Generator, ManualSeedDrivesTheDefaultGenerator) {
  td::manual_seed(2024);
  const auto a = td::rand({64}).to_vector();
  const auto an = td::randn({64}).to_vector();
  td::manual_seed(2024);
  EXPECT_EQ(td::rand({64}).to_vector(), a);
  EXPECT_EQ(td::randn({64}).to_vector(), an);
  td::manual_seed(2025);
  EXPECT_NE(td::rand({64}).to_vector(), a);
  EXPECT_EQ(td::default_generator().seed(), 2025u);
}

TEST(Generator, RandIsUniform) {
  // n = 200000 uniforms: the mean's standard error is sqrt(1/12 / n) = 6.5e-4 and the variance's is
  // sqrt((1/80 - 1/144) / n) = 1.7e-4. Tolerances are 5 standard errors (the seed is fixed, so this
  // cannot flake; a wrong scale or offset is off by far more).
  const int64_t n = 200000;
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    td::Generator g(11);
    const Moments m = moments(td::rand({n}, dt, &g).to_vector());
    EXPECT_NEAR(m.mean, 0.5, 5 * 6.5e-4) << td::dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0 / 12, 5 * 1.7e-4) << td::dtype_name(dt);
    EXPECT_GE(m.min, 0.0);
    EXPECT_LT(m.max, 1.0);
    EXPECT_LT(m.min, 1e-3);  // 200000 draws reach within 1e-3 of both ends (miss chance e^-200)
    EXPECT_GT(m.max, 1 - 1e-3);
  }
  // f64 rand has more than 24 random bits: some value is not a multiple of 2^-24.
  td::Generator g(3);
  bool fine = false;
  for (double x : td::rand({16}, td::kFloat64, &g).to_vector()) fine |= std::ldexp(x, 24) != std::floor(std::ldexp(x, 24));
  EXPECT_TRUE(fine);
}

TEST(Generator, RandReducedFloatsStayBelowOne) {
  // Uniform [0, 1) must hold after rounding to the 16-bit types too: with 2^16 draws, rounding
  // a 24-bit uniform to nearest would hit 1.0 with probability ~1 - e^-128 for bf16.
  for (td::DType dt : {td::kBFloat16, td::kFloat16}) {
    td::Generator g(1);
    const Moments m = moments(td::rand({65536}, dt, &g).to_vector());
    EXPECT_GE(m.min, 0.0) << td::dtype_name(dt);
    EXPECT_LT(m.max, 1.0) << td::dtype_name(dt);
    // Mean 0.5 up to the type's quantisation bias (<= 2^-9 = 2e-3 for bf16) plus 5 standard errors
    // (5 * sqrt(1/12 / 65536) = 5.6e-3).
    EXPECT_NEAR(m.mean, 0.5, 2e-3 + 5.6e-3) << td::dtype_name(dt);
  }
}

TEST(Generator, RandnIsStandardNormal) {
  // n = 200000: the mean's standard error is 1/sqrt(n) = 2.2e-3, the variance's sqrt(2/n) = 3.2e-3,
  // and P(|x| < 1) = 0.6827 has standard error sqrt(p(1-p)/n) = 1.04e-3. Tolerances: 5 standard
  // errors (fixed seed; a wrong Box-Muller scale moves these by much more).
  const int64_t n = 200000;
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    td::Generator g(99);
    const std::vector<double> v = td::randn({n}, dt, &g).to_vector();
    const Moments m = moments(v);
    EXPECT_NEAR(m.mean, 0.0, 5 * 2.2e-3) << td::dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0, 5 * 3.2e-3) << td::dtype_name(dt);
    int64_t inside = 0, tail = 0;
    for (double x : v) {
      inside += std::fabs(x) < 1.0;
      tail += std::fabs(x) > 3.0;
      ASSERT_TRUE(std::isfinite(x));
    }
    EXPECT_NEAR(static_cast<double>(inside) / n, 0.682689, 5 * 1.04e-3);
    // P(|x| > 3) = 0.0027: expect 540 +- 5 * sqrt(540).
    EXPECT_NEAR(static_cast<double>(tail), 540.0, 5 * std::sqrt(540.0));
  }
  // Odd lengths fill every element (the last one from an unpaired Box-Muller draw).
  td::Generator g(5);
  const std::vector<double> odd = td::randn({7}, td::kFloat64, &g).to_vector();
  td::Generator g2(5);
  const std::vector<double> even = td::randn({8}, td::kFloat64, &g2).to_vector();
  for (int i = 0; i < 7; ++i) EXPECT_EQ(odd[i], even[i]);
}
