// half / bfloat16 scalar rounding (round to nearest even, overflow, NaN, subnormals, -0), the
// bulk convert() vector paths against the scalar reference, and dtype promotion.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tandem/core/convert.h"
#include "util/test_util.h"

namespace td = tandem;

namespace {

uint32_t fbits(float f) { return std::bit_cast<uint32_t>(f); }
float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint16_t h(float f) { return td::half(f).bits; }
uint16_t b(float f) { return td::bfloat16(f).bits; }

// An independent reference for f32 -> binary16: scale to the half quantum in double (exact, since
// a float has 24 significant bits and the scaling is by a power of two) and let nearbyint()
// (round-half-even under the default rounding mode) pick the integer.
uint16_t ref_half(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0;  // not used for NaN
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {
    const double r = std::nearbyint(a / std::ldexp(1.0, -24));  // subnormal units of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));  // r == 1024 is the min normal
  }
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  const int e = e2 - 1;  // a in [2^e, 2^(e+1))
  const double r = std::nearbyint(a / std::ldexp(1.0, e - 10));  // in [1024, 2048]
  return static_cast<uint16_t>(sign | (((e + 15) << 10) + static_cast<int>(r) - 1024));
}

// An independent reference for f32 -> bfloat16: compare the distances to the two candidates
// in double; ties go to the even one.
uint16_t ref_bf16(float f) {
  const uint32_t x = fbits(f);
  const uint32_t lo = x & 0xffff0000u, hi = lo + 0x10000u;
  if ((x & 0xffffu) == 0) return static_cast<uint16_t>(lo >> 16);
  auto value = [](uint32_t bits) {
    // The candidate past the largest finite bf16 is +-2^128 (it encodes +-inf).
    if ((bits & 0x7fffffffu) == 0x7f800000u) return std::copysign(std::ldexp(1.0, 128), std::bit_cast<float>(bits));
    return static_cast<double>(std::bit_cast<float>(bits));
  };
  const double dl = std::fabs(static_cast<double>(f) - value(lo)), dh = std::fabs(static_cast<double>(f) - value(hi));
  if (dl < dh) return static_cast<uint16_t>(lo >> 16);
  if (dh < dl) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

bool half_is_nan(uint16_t v) { return (v & 0x7c00) == 0x7c00 && (v & 0x3ff) != 0; }
bool bf16_is_nan(uint16_t v) { return (v & 0x7f80) == 0x7f80 && (v & 0x7f) != 0; }

}  // namespace

// ---------------------------------------------------------------------------------- half

TEST(Half, ExactValues) {
  EXPECT_EQ(h(0.0f), 0x0000);
  EXPECT_EQ(h(-0.0f), 0x8000);  // -0 keeps its sign
  EXPECT_EQ(h(1.0f), 0x3c00);
  EXPECT_EQ(h(-2.0f), 0xc000);
  EXPECT_EQ(h(0.5f), 0x3800);
  EXPECT_EQ(h(65504.0f), 0x7bff);  // largest finite half
  EXPECT_EQ(h(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(h(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(static_cast<float>(td::half::from_bits(0x8000)), 0.0f);
  EXPECT_TRUE(std::signbit(static_cast<float>(td::half::from_bits(0x8000))));
}

TEST(Half, RoundsTiesToEven) {
  // 1 + 2^-11 lies halfway between 1 (0x3c00, even) and 1 + 2^-10 (0x3c01).
  EXPECT_EQ(h(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 lies halfway between 0x3c01 (odd) and 0x3c02 (even).
  EXPECT_EQ(h(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above / below a tie go to the nearer neighbour.
  EXPECT_EQ(h(from_bits(fbits(1.0f + std::ldexp(1.0f, -11)) + 1)), 0x3c01);
  EXPECT_EQ(h(from_bits(fbits(1.0f + 3 * std::ldexp(1.0f, -11)) - 1)), 0x3c01);
  // Negative ties mirror the positive ones.
  EXPECT_EQ(h(-(1.0f + std::ldexp(1.0f, -11))), 0xbc00);
  EXPECT_EQ(h(-(1.0f + 3 * std::ldexp(1.0f, -11))), 0xbc02);
  // A tie whose rounding carries into the exponent: 2 - 2^-11 is halfway between 0x3bff and 2.
  EXPECT_EQ(h(2.0f - std::ldexp(1.0f, -11)), 0x4000);
}

TEST(Half, OverflowsToInfinityAt65520) {
  // 65520 is halfway between 65504 (0x7bff, odd) and 65536 (the next step, = inf): it rounds up.
  EXPECT_EQ(h(65520.0f), 0x7c00);
  EXPECT_EQ(h(-65520.0f), 0xfc00);
  EXPECT_EQ(h(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(h(65519.0f), 0x7bff);
  EXPECT_EQ(h(1e10f), 0x7c00);
  EXPECT_EQ(h(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(h(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(h(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isinf(static_cast<float>(td::half::from_bits(0x7c00))));
}

TEST(Half, NaNStaysNaN) {
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7f802000u, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t r = h(from_bits(nan));
    EXPECT_TRUE(half_is_nan(r)) << std::hex << nan << " -> " << r;
    EXPECT_TRUE(r & 0x0200) << "NaN made quiet: " << std::hex << r;
    EXPECT_EQ(r & 0x8000, (nan >> 16) & 0x8000) << "sign kept";
  }
  // Every half NaN becomes a quiet float NaN with its sign and payload.
  for (uint32_t m = 1; m < 0x400; ++m) {
    for (uint32_t sign : {0u, 0x8000u}) {
      const float f = static_cast<float>(td::half::from_bits(static_cast<uint16_t>(sign | 0x7c00 | m)));
      EXPECT_TRUE(std::isnan(f));
      EXPECT_EQ(fbits(f), (sign << 16) | 0x7fc00000u | (m << 13)) << std::hex << m;
    }
  }
}

TEST(Half, SubnormalsExactBothWays) {
  for (uint16_t m = 1; m < 0x400; ++m) {
    const float v = static_cast<float>(td::half::from_bits(m));
    EXPECT_EQ(v, std::ldexp(static_cast<float>(m), -24)) << m;
    EXPECT_EQ(h(v), m);
    EXPECT_EQ(h(-v), 0x8000 | m);
  }
  // Ties below the smallest normal: 2^-25 is halfway between 0 and 2^-24 -> 0 (even).
  EXPECT_EQ(h(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(h(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(h(3 * std::ldexp(1.0f, -25)), 0x0002);  // between 1 and 2 units -> 2
  EXPECT_EQ(h(from_bits(fbits(std::ldexp(1.0f, -25)) + 1)), 0x0001);
  // Halfway between the largest subnormal (0x3ff) and the smallest normal (0x400): even = 0x400.
  EXPECT_EQ(h(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  EXPECT_EQ(h(1022.5f * std::ldexp(1.0f, -24)), 0x03fe);
  // f32 subnormals are far below half's range: they round to (signed) zero.
  EXPECT_EQ(h(from_bits(0x00000001u)), 0x0000);
  EXPECT_EQ(h(from_bits(0x807fffffu)), 0x8000);
}

TEST(Half, EveryHalfRoundTrips) {
  for (uint32_t v = 0; v < 0x10000; ++v) {
    const uint16_t bits = static_cast<uint16_t>(v);
    const float f = static_cast<float>(td::half::from_bits(bits));
    if (half_is_nan(bits)) {
      EXPECT_TRUE(half_is_nan(h(f)));
      continue;
    }
    ASSERT_EQ(h(f), bits) << std::hex << bits;
  }
}

TEST(Half, MatchesReferenceOnSweep) {
  // Every midpoint between neighbouring halves (and one float ulp either side), plus a strided
  // sweep over all f32 bit patterns.
  std::vector<float> xs;
  for (uint32_t v = 0; v < 0x7c00; ++v) {
    const double lo = static_cast<float>(td::half::from_bits(static_cast<uint16_t>(v)));
    const double hi = v + 1 == 0x7c00 ? 65536.0 : static_cast<float>(td::half::from_bits(static_cast<uint16_t>(v + 1)));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in f32
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, 1e30f));
  }
  for (uint64_t u = 0; u < 0x100000000ull; u += 65521) xs.push_back(from_bits(static_cast<uint32_t>(u)));
  int64_t checked = 0;
  for (float x : xs) {
    for (float s : {x, -x}) {
      if (std::isnan(s)) continue;
      ASSERT_EQ(h(s), ref_half(s)) << std::hexfloat << s;
      ++checked;
    }
  }
  EXPECT_GT(checked, 150000);
}

// ------------------------------------------------------------------------------ bfloat16

TEST(BFloat16, ExactValuesTiesAndOverflow) {
  EXPECT_EQ(b(0.0f), 0x0000);
  EXPECT_EQ(b(-0.0f), 0x8000);
  EXPECT_EQ(b(1.0f), 0x3f80);
  EXPECT_EQ(b(-2.0f), 0xc000);
  // Ties: 0x3f808000 is halfway between 0x3f80 (even) and 0x3f81; 0x3f818000 between 0x3f81, 0x3f82.
  EXPECT_EQ(b(from_bits(0x3f808000u)), 0x3f80);
  EXPECT_EQ(b(from_bits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(b(from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(b(from_bits(0x3f817fffu)), 0x3f81);
  EXPECT_EQ(b(from_bits(0xbf818000u)), 0xbf82);
  // Largest finite bf16 is 0x7f7f; the tie above it rounds to the even neighbour, +inf.
  EXPECT_EQ(b(from_bits(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(b(from_bits(0x7f7f8000u)), 0x7f80);
  EXPECT_EQ(b(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(b(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(b(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(b(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(BFloat16, NaNStaysNaN) {
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fffffffu, 0xff800001u, 0xffc00000u}) {
    const uint16_t r = b(from_bits(nan));
    EXPECT_TRUE(bf16_is_nan(r)) << std::hex << nan << " -> " << r;  // 0x7f800001 must not become inf
    EXPECT_TRUE(r & 0x40) << "quiet";
    EXPECT_EQ(r & 0x8000, (nan >> 16) & 0x8000);
  }
}

TEST(BFloat16, SubnormalsExactBothWays) {
  for (uint32_t m = 1; m < 0x80; ++m) {
    const uint16_t bits = static_cast<uint16_t>(m);
    const float f = static_cast<float>(td::bfloat16::from_bits(bits));
    EXPECT_EQ(fbits(f), m << 16);
    EXPECT_NE(f, 0.0f);
    EXPECT_EQ(b(f), bits);
    EXPECT_EQ(b(-f), 0x8000 | bits);
  }
  EXPECT_EQ(b(from_bits(0x00000001u)), 0x0000);  // below half a bf16 unit
  EXPECT_EQ(b(from_bits(0x00008000u)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(b(from_bits(0x00018000u)), 0x0002);  // tie -> even (2)
  EXPECT_EQ(b(from_bits(0x00008001u)), 0x0001);
  EXPECT_EQ(b(from_bits(0x007fffffu)), 0x0080);  // rounds up into the smallest normal
  EXPECT_EQ(b(from_bits(0x807f0000u)), 0x807f);
}

TEST(BFloat16, MatchesReferenceOnSweep) {
  int64_t checked = 0;
  for (uint64_t u = 0; u < 0x100000000ull; u += 4099) {
    const float x = from_bits(static_cast<uint32_t>(u));
    if (std::isnan(x)) continue;
    ASSERT_EQ(b(x), ref_bf16(x)) << std::hex << u;
    ++checked;
  }
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {  // the tie pattern under every bf16
    const float x = from_bits((hi << 16) | 0x8000u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(b(x), ref_bf16(x)) << std::hex << hi;
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
}

// ----------------------------------------------------------------------- bulk convert()

namespace {

// Bit patterns that stress the conversions: every kind of special value in every lane, plus
// random patterns.
std::vector<float> stress_patterns(size_t random_count) {
  std::vector<uint32_t> u;
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u,
                               0x007fffffu, 0x807fffffu, 0x00400000u, 0x00008001u, 0x00800000u, 0x7f800000u,
                               0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu,
                               0x7f7fffffu, 0x7f7f8000u, 0x3f808000u, 0x3f818000u, 0x477ff000u, 0x477fefffu,
                               0x33000000u, 0x33000001u, 0x38800000u, 0x387fc000u, 0x3f800000u, 0xc77ff000u};
  for (uint32_t s : specials) u.push_back(s);
  // A run of subnormals long enough to fill several whole vectors.
  for (uint32_t k = 0; k < 100; ++k) u.push_back((k * 0x1d3a7u + 1u) & 0x007fffffu);
  for (uint32_t k = 0; k < 50; ++k) u.push_back(0x80000000u | ((k * 0x31u + 0x8000u) & 0x007fffffu));
  std::mt19937 rng(42);
  for (size_t k = 0; k < random_count; ++k) {
    uint32_t r = rng();
    switch (k % 4) {
      case 0: break;                                  // anything
      case 1: r &= 0x807fffffu; break;                // subnormal or zero
      case 2: r = (r & 0x87ffffffu) | 0x30000000u; break;  // around half's range
      case 3: r |= 0x7f800000u; break;                // inf / NaN
    }
    u.push_back(r);
  }
  std::vector<float> out(u.size());
  std::memcpy(out.data(), u.data(), u.size() * 4);
  return out;
}

}  // namespace

TEST(Convert, F32ToBF16BitIdenticalToScalar) {
  RecordProperty("cpu_features", td::cpu_features().summary());
  const std::vector<float> src = stress_patterns(20000);
  // Lengths that are and are not multiples of the vector width, and start offsets that move
  // each pattern through every lane.
  for (int64_t start : {0, 1, 5, 15}) {
    for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 32, 33, 47, 100, 1001, 4096}) {
      if (start + n > static_cast<int64_t>(src.size())) continue;
      std::vector<td::bfloat16> fast(static_cast<size_t>(n) + 1), ref(static_cast<size_t>(n) + 1);
      fast[n].bits = ref[n].bits = 0xabcd;  // guard element
      td::convert(src.data() + start, td::kFloat32, fast.data(), td::kBFloat16, n);
      td::convert_f32_to_bf16_scalar(src.data() + start, ref.data(), n);
      for (int64_t i = 0; i <= n; ++i) {
        ASSERT_EQ(fast[i].bits, ref[i].bits)
            << "start " << start << " n " << n << " i " << i << " input 0x" << std::hex << fbits(src[start + i]);
      }
    }
  }
  // The whole sweep in one call.
  std::vector<td::bfloat16> fast(src.size()), ref(src.size());
  td::convert(src.data(), td::kFloat32, fast.data(), td::kBFloat16, static_cast<int64_t>(src.size()));
  td::convert_f32_to_bf16_scalar(src.data(), ref.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(fast[i].bits, ref[i].bits) << std::hex << fbits(src[i]);
}

// convert_for_later (streaming stores for large bf16 -> f32 results) writes what convert() writes,
// bit for bit: every bf16 pattern (NaNs, infinities, subnormals) at lengths below, at and above
// the streaming threshold, with destinations starting off a 64-byte line (the plain head) and
// lengths that leave a tail, and nothing past the end (guard elements).
TEST(Convert, ForLaterEqualsConvertBitForBit) {
  const int64_t big = td::kStreamingMinElements;
  std::vector<td::bfloat16> src(static_cast<size_t>(big + 300));
  for (size_t i = 0; i < src.size(); ++i) src[i].bits = static_cast<uint16_t>((i * 40503u) ^ (i >> 3));
  std::vector<float> a(src.size() + 40), b(src.size() + 40);
  for (int64_t n : {int64_t{0}, int64_t{33}, big - 1, big, big + 17, big + 283}) {
    for (int64_t off : {0, 1, 7, 16}) {  // float offsets: 0 is 64-byte aligned only if the vector is
      std::fill(a.begin(), a.end(), -1.25f);
      std::fill(b.begin(), b.end(), -1.25f);
      td::convert(src.data(), td::kBFloat16, a.data() + off, td::kFloat32, n);
      td::convert_for_later(src.data(), td::kBFloat16, b.data() + off, td::kFloat32, n);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "n " << n << " offset " << off;
    }
  }
  // Not vacuous: the inputs include NaN, infinity and subnormal patterns.
  int nan = 0, inf = 0, sub = 0;
  for (const td::bfloat16& h : src) {
    const uint16_t e = h.bits & 0x7f80u, m = h.bits & 0x007fu;
    nan += e == 0x7f80u && m != 0;
    inf += e == 0x7f80u && m == 0;
    sub += e == 0 && m != 0;
  }
  EXPECT_GT(nan, 0);
  EXPECT_GT(inf, 0);
  EXPECT_GT(sub, 0);
  // Other dtype pairs are convert() itself.
  std::vector<float> f(1000);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) * 0.37f - 100.0f;
  std::vector<td::bfloat16> x(f.size()), y(f.size());
  td::convert(f.data(), td::kFloat32, x.data(), td::kBFloat16, 1000);
  td::convert_for_later(f.data(), td::kFloat32, y.data(), td::kBFloat16, 1000);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 2), 0);
}

TEST(Convert, SubnormalInEveryLane) {
  // A 16-lane block that is all normal except one subnormal, for every lane position.
  for (int lane = 0; lane < 16; ++lane) {
    std::vector<float> src(37, 1.5f);
    src[lane] = from_bits(0x00018000u);
    src[16 + lane] = from_bits(0x807fffffu);
    std::vector<td::bfloat16> out(src.size());
    td::convert(src.data(), td::kFloat32, out.data(), td::kBFloat16, static_cast<int64_t>(src.size()));
    EXPECT_EQ(out[lane].bits, 0x0002) << lane;
    EXPECT_EQ(out[16 + lane].bits, 0x8080) << lane;
    EXPECT_EQ(out[(lane + 1) % 16].bits, 0x3fc0);
  }
}

TEST(Convert, F32ToF16BitIdenticalToScalar) {
  const std::vector<float> src = stress_patterns(20000);
  for (int64_t start : {0, 3}) {
    for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 33, 1000}) {
      std::vector<td::half> fast(static_cast<size_t>(n)), ref(static_cast<size_t>(n));
      td::convert(src.data() + start, td::kFloat32, fast.data(), td::kFloat16, n);
      td::convert_f32_to_f16_scalar(src.data() + start, ref.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(fast[i].bits, ref[i].bits) << std::hex << fbits(src[start + i]);
    }
  }
  std::vector<td::half> fast(src.size()), ref(src.size());
  td::convert(src.data(), td::kFloat32, fast.data(), td::kFloat16, static_cast<int64_t>(src.size()));
  td::convert_f32_to_f16_scalar(src.data(), ref.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(fast[i].bits, ref[i].bits) << std::hex << fbits(src[i]);
}

TEST(Convert, SixteenBitToF32MatchesScalar) {
  // Every 16-bit pattern, widened by the bulk path and by the scalar operator float().
  std::vector<uint16_t> all(0x10000 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 40503u);
  for (uint32_t i = 0; i < 0x10000; ++i) all[i] = static_cast<uint16_t>(i);
  for (int64_t n : {int64_t{5}, int64_t{17}, static_cast<int64_t>(all.size())}) {
    std::vector<float> fb(static_cast<size_t>(n)), fh(static_cast<size_t>(n));
    td::convert(all.data(), td::kBFloat16, fb.data(), td::kFloat32, n);
    td::convert(all.data(), td::kFloat16, fh.data(), td::kFloat32, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(fbits(fb[i]), fbits(static_cast<float>(td::bfloat16::from_bits(all[i])))) << i;
      // Bit-identical, NaN payloads included (both paths make a signalling NaN quiet).
      ASSERT_EQ(fbits(fh[i]), fbits(static_cast<float>(td::half::from_bits(all[i])))) << std::hex << all[i];
    }
  }
}

TEST(Convert, OtherPairs) {
  const std::vector<double> d = {-2.75, -0.5, 0.0, 0.5, 1.0, 3.996, 255.0};
  std::vector<int64_t> i64(d.size());
  td::convert(d.data(), td::kFloat64, i64.data(), td::kInt64, static_cast<int64_t>(d.size()));
  EXPECT_EQ(i64, (std::vector<int64_t>{-2, 0, 0, 0, 1, 3, 255}));  // truncation toward zero
  bool bools[7];
  td::convert(d.data(), td::kFloat64, bools, td::kBool, 7);
  EXPECT_TRUE(bools[0] && bools[1] && !bools[2] && bools[3]);
  std::vector<td::bfloat16> bf(d.size());
  td::convert(d.data(), td::kFloat64, bf.data(), td::kBFloat16, static_cast<int64_t>(d.size()));
  EXPECT_EQ(static_cast<float>(bf[0]), -2.75f);
  EXPECT_EQ(static_cast<float>(bf[5]), 4.0f);  // 3.996 -> nearest bf16 (steps of 2^-6 in [2, 4)) is 4
  // Same dtype is a copy, in place is a no-op.
  std::vector<int32_t> a = {1, 2, 3}, c(3);
  td::convert(a.data(), td::kInt32, c.data(), td::kInt32, 3);
  EXPECT_EQ(a, c);
  td::convert(a.data(), td::kInt32, a.data(), td::kInt32, 3);
  EXPECT_EQ(a, c);
}

// --------------------------------------------------------------------------------- dtypes

TEST(DType, PromotionFollowsPyTorch) {
  using td::promote_types;
  EXPECT_EQ(promote_types(td::kFloat32, td::kBFloat16), td::kFloat32);
  EXPECT_EQ(promote_types(td::kBFloat16, td::kFloat16), td::kFloat32);
  EXPECT_EQ(promote_types(td::kFloat16, td::kFloat64), td::kFloat64);
  EXPECT_EQ(promote_types(td::kBFloat16, td::kBFloat16), td::kBFloat16);
  EXPECT_EQ(promote_types(td::kInt64, td::kFloat16), td::kFloat16);
  EXPECT_EQ(promote_types(td::kInt64, td::kBFloat16), td::kBFloat16);
  EXPECT_EQ(promote_types(td::kBool, td::kFloat32), td::kFloat32);
  EXPECT_EQ(promote_types(td::kUInt8, td::kInt32), td::kInt32);
  EXPECT_EQ(promote_types(td::kInt32, td::kInt64), td::kInt64);
  EXPECT_EQ(promote_types(td::kBool, td::kUInt8), td::kUInt8);
  EXPECT_EQ(promote_types(td::kBool, td::kBool), td::kBool);
  const td::DType all[] = {td::kFloat32, td::kFloat64, td::kFloat16, td::kBFloat16,
                           td::kInt64,   td::kInt32,   td::kUInt8,   td::kBool};
  for (td::DType a : all) {
    for (td::DType c : all) {
      EXPECT_EQ(promote_types(a, c), promote_types(c, a)) << td::dtype_name(a) << " " << td::dtype_name(c);
      if (td::is_floating(a) || td::is_floating(c)) EXPECT_TRUE(td::is_floating(promote_types(a, c)));
    }
  }
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(td::element_size(td::kFloat64), 8u);
  EXPECT_EQ(td::element_size(td::kFloat32), 4u);
  EXPECT_EQ(td::element_size(td::kBFloat16), 2u);
  EXPECT_EQ(td::element_size(td::kFloat16), 2u);
  EXPECT_EQ(td::element_size(td::kInt64), 8u);
  EXPECT_EQ(td::element_size(td::kInt32), 4u);
  EXPECT_EQ(td::element_size(td::kUInt8), 1u);
  EXPECT_EQ(td::element_size(td::kBool), 1u);
  EXPECT_EQ(td::dtype_name(td::kBFloat16), "bfloat16");
  EXPECT_EQ(td::dtype_name(td::kFloat16), "float16");
  EXPECT_EQ(td::dtype_name(td::kBool), "bool");
  EXPECT_TRUE(td::is_reduced_float(td::kBFloat16));
  EXPECT_FALSE(td::is_reduced_float(td::kFloat32));
  EXPECT_FALSE(td::is_floating(td::kInt64));
}
