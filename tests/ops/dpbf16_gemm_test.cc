// The AVX512-BF16 tile product (kernels/cpu/dpbf16_gemm.h) that the bf16 attention uses on CPUs
// without AMX. Two checks per case, over every shape class of its blocking (rows below, at and
// past the 6-row block, columns below, at and past one 16-wide vector and the 64-wide block, K = 0,
// 1, odd, even, past 64), A and B each row-major and stored transposed, row strides wider than the
// matrices (even and odd, so the in-place A path and the packed ones both run), accumulating or
// not, f32 and bf16 c:
//  * bit for bit equal to dpbf16_tile_gemm_reference, the scalar statement of the instruction's
//    arithmetic (pairs of k, odd product added first, each add rounded, subnormals flushed);
//  * the reference (so the kernel) within K * 2^-24 * sum|a||b| + 2^-24 |c| of the exact f64 sum
//    (f32 sums of exact products), plus half a bf16 ulp of the result for a bf16 c.
// A wrong index, a dropped pair or a swapped operand is off by whole products, far outside both.
// Skipped where the CPU has no AVX512-BF16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/kernels/cpu/dpbf16_gemm.h"
#include "util/test_util.h"

namespace tandem {
namespace {

using testing::bf16_bits;
using testing::bf16_value;
using testing::random_bf16;

struct Case {
  int64_t M, N, K;
  char ta, tb;
  bool accumulate, c_bf16;
  int64_t pad;  // extra row stride
};

// Returns the number of elements that differ from the reference or break the bound.
int check_case(const Case& cs, uint64_t seed) {
  const int64_t M = cs.M, N = cs.N, K = cs.K;
  const int64_t lda = (cs.ta == 'N' ? K : M) + cs.pad, ldb = (cs.tb == 'N' ? N : K) + cs.pad + 1, ldc = N + 3;
  const std::vector<uint16_t> a = random_bf16((cs.ta == 'N' ? M : K) * lda, seed, -2.0f, 2.0f);
  const std::vector<uint16_t> b = random_bf16((cs.tb == 'N' ? K : N) * ldb, seed + 1, -2.0f, 2.0f);
  const std::vector<uint16_t> c0h = random_bf16(M * ldc, seed + 2, -2.0f, 2.0f);
  std::vector<float> c0f(static_cast<size_t>(M * ldc));
  for (size_t i = 0; i < c0f.size(); ++i) c0f[i] = bf16_value(c0h[i]);
  std::vector<uint16_t> got_h = c0h, ref_h = c0h;
  std::vector<float> got_f = c0f, ref_f = c0f;
  void* got = cs.c_bf16 ? static_cast<void*>(got_h.data()) : static_cast<void*>(got_f.data());
  void* ref = cs.c_bf16 ? static_cast<void*>(ref_h.data()) : static_cast<void*>(ref_f.data());
  kernels::dpbf16_tile_gemm_bf16(cs.ta, cs.tb, M, N, K, a.data(), lda, b.data(), ldb, cs.accumulate, got, cs.c_bf16, ldc);
  kernels::dpbf16_tile_gemm_reference(cs.ta, cs.tb, M, N, K, a.data(), lda, b.data(), ldb, cs.accumulate, ref,
                                      cs.c_bf16, ldc);
  auto A = [&](int64_t i, int64_t k) { return static_cast<double>(bf16_value(cs.ta == 'N' ? a[i * lda + k] : a[k * lda + i])); };
  auto B = [&](int64_t k, int64_t j) { return static_cast<double>(bf16_value(cs.tb == 'N' ? b[k * ldb + j] : b[j * ldb + k])); };
  int bad = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const size_t at = static_cast<size_t>(i * ldc + j);
      const double g = cs.c_bf16 ? bf16_value(got_h[at]) : got_f[at];
      const double r = cs.c_bf16 ? bf16_value(ref_h[at]) : ref_f[at];
      if (j >= N) {  // past N: untouched
        if (g != c0f[at]) ++bad;
        continue;
      }
      const bool same = cs.c_bf16 ? got_h[at] == ref_h[at] : std::memcmp(&got_f[at], &ref_f[at], sizeof(float)) == 0;
      double exact = cs.accumulate ? c0f[at] : 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        exact += A(i, k) * B(k, j);
        mag += std::fabs(A(i, k) * B(k, j));
      }
      double tol = static_cast<double>(K + 1) * 0x1p-24 * (mag + (cs.accumulate ? std::fabs(c0f[at]) : 0.0));
      if (cs.c_bf16) tol += 0x1p-8 * std::fabs(exact) + 0x1p-8 * tol;
      const bool close = std::fabs(r - exact) <= tol;
      if (!same || !close) {
        if (++bad <= 3) {
          ADD_FAILURE() << "M=" << M << " N=" << N << " K=" << K << " " << cs.ta << cs.tb << " acc=" << cs.accumulate
                        << " bf16=" << cs.c_bf16 << " pad=" << cs.pad << " at (" << i << "," << j << "): kernel " << g
                        << " reference " << r << " exact " << exact << " tol " << tol;
        }
      }
    }
  }
  return bad;
}

TEST(Dpbf16Gemm, EqualsReferenceBitForBitAndExactWithinF32Bound) {
  if (!kernels::dpbf16_usable()) GTEST_SKIP() << "no AVX512-BF16 on this CPU (or TANDEM_BF16_GEMM=onednn)";
  uint64_t seed = 1;
  int bad = 0, cases = 0;
  for (int64_t M : {1, 5, 6, 7, 13, 64}) {
    for (int64_t N : {1, 15, 16, 17, 64, 65, 130}) {
      for (int64_t K : {0, 1, 2, 3, 31, 64, 127}) {
        for (char ta : {'N', 'T'}) {
          for (char tb : {'N', 'T'}) {
            const bool accumulate = (seed % 3) == 0, c_bf16 = (seed % 4) == 1;
            const int64_t pad = static_cast<int64_t>(seed % 3);
            bad += check_case({M, N, K, ta, tb, accumulate, c_bf16, pad}, seed * 7);
            ++seed;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "over " << cases << " cases";
}

// Every combination of accumulate and c dtype on the shapes the attention kernel uses (64-row
// query tiles, head dim 64, up to 128 keys).
TEST(Dpbf16Gemm, AttentionShapesAllModes) {
  if (!kernels::dpbf16_usable()) GTEST_SKIP() << "no AVX512-BF16 on this CPU (or TANDEM_BF16_GEMM=onednn)";
  int bad = 0;
  uint64_t seed = 500;
  for (bool accumulate : {false, true}) {
    for (bool c_bf16 : {false, true}) {
      bad += check_case({64, 128, 64, 'N', 'T', accumulate, c_bf16, 0}, ++seed);   // Q K^T
      bad += check_case({64, 64, 128, 'N', 'N', accumulate, c_bf16, 0}, ++seed);   // P V, dS K
      bad += check_case({128, 64, 64, 'T', 'N', accumulate, c_bf16, 0}, ++seed);  // P^T dO, dS^T Q
    }
  }
  EXPECT_EQ(bad, 0);
}

// Subnormal operands count as zero and subnormal sums are flushed, as the instruction does: a
// product of the smallest normal bf16 values underflows to 0, and a subnormal input contributes
// nothing even next to a large partner.
TEST(Dpbf16Gemm, SubnormalsFlushLikeTheInstruction) {
  if (!kernels::dpbf16_usable()) GTEST_SKIP() << "no AVX512-BF16 on this CPU (or TANDEM_BF16_GEMM=onednn)";
  const uint16_t tiny = 0x0080;  // smallest normal bf16, 2^-126
  const uint16_t sub = 0x0001;   // a subnormal bf16
  const uint16_t big = bf16_bits(0x1p100f);
  const std::vector<uint16_t> a = {tiny, sub, big, tiny};
  const std::vector<uint16_t> b = {tiny, big, tiny, big};
  for (bool c_bf16 : {false, true}) {
    std::vector<float> got_f(1, 0.0f), ref_f(1, 0.0f);
    std::vector<uint16_t> got_h(1, 0), ref_h(1, 0);
    void* got = c_bf16 ? static_cast<void*>(got_h.data()) : static_cast<void*>(got_f.data());
    void* ref = c_bf16 ? static_cast<void*>(ref_h.data()) : static_cast<void*>(ref_f.data());
    kernels::dpbf16_tile_gemm_bf16('N', 'T', 1, 1, 4, a.data(), 4, b.data(), 4, false, got, c_bf16, 1);
    kernels::dpbf16_tile_gemm_reference('N', 'T', 1, 1, 4, a.data(), 4, b.data(), 4, false, ref, c_bf16, 1);
    // tiny * tiny underflows (flushed), sub * big reads as 0, big * tiny = 2^-26, tiny * big = 2^-26.
    const float expect = 0x1p-25f;
    if (c_bf16) {
      EXPECT_EQ(got_h[0], ref_h[0]);
      EXPECT_EQ(bf16_value(got_h[0]), expect);
    } else {
      EXPECT_EQ(got_f[0], ref_f[0]);
      EXPECT_EQ(got_f[0], expect);
    }
  }
}

}  // namespace
}  // namespace tandem
