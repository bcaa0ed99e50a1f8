// The AMX bf16 product (kernels/cpu/amx_gemm.h) against the exact f64 sum of the same bf16
// products, over every shape class of its blocking: rows and columns below, at and past one 16 x 16
// tile and one 32 x 32 block, K = 0, odd K, K past a 32-value tile step, A and B each row-major and
// stored transposed, row strides wider than the matrices, with and without bias, accumulating
// onto c or not, f32 and bf16 c. Tolerance: the f32 sum of K products is within
// K * 2^-24 * sum|a||b| of exact (plus |bias| + |c| terms for the two extra f32 additions); a bf16 c
// adds half a bf16 ulp of the result (at most 2^-8 relative). A wrong index or a dropped pair is off by
// a whole product, far outside this. Skipped where the CPU has no AMX-BF16.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/core/rng.h"
#include "tandem/core/tensor.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/gemm.h"
#include "ops/ops_test_util.h"
#include "util/test_util.h"

namespace tandem {
namespace {

using testing::bf16_bits;
using testing::bf16_value;
using testing::random_bf16;

struct Case {
  int64_t M, N, K;
  char ta, tb;
  bool bias, accumulate, c_bf16;
  kernels::AmxOperandOrder order = kernels::AmxOperandOrder::automatic;
  int64_t lda_pad = 3;  // A's row stride beyond its stored width
};

// Runs one case; returns the number of elements outside the bound (reports the first few).
int check_case(const Case& cs, uint64_t seed) {
  const int64_t M = cs.M, N = cs.N, K = cs.K;
  const int64_t lda = (cs.ta == 'N' ? K : M) + cs.lda_pad, ldb = (cs.tb == 'N' ? N : K) + 5, ldc = N + 2;
  const std::vector<uint16_t> a = random_bf16((cs.ta == 'N' ? M : std::max<int64_t>(K, 1)) * lda, seed);
  const std::vector<uint16_t> b = random_bf16((cs.tb == 'N' ? std::max<int64_t>(K, 1) : N) * ldb, seed + 1);
  const std::vector<uint16_t> c0h = random_bf16(M * ldc, seed + 2);
  std::vector<float> bias(static_cast<size_t>(N));
  for (int64_t j = 0; j < N; ++j) bias[j] = bf16_value(c0h[j % c0h.size()]) * 3.0f;
  std::vector<float> c0f(static_cast<size_t>(M * ldc));
  for (size_t i = 0; i < c0f.size(); ++i) c0f[i] = bf16_value(c0h[i]);
  std::vector<uint16_t> ch = c0h;
  std::vector<float> cf = c0f;
  void* c = cs.c_bf16 ? static_cast<void*>(ch.data()) : static_cast<void*>(cf.data());
  kernels::amx_gemm_bf16(cs.ta, cs.tb, M, N, K, a.data(), lda, b.data(), ldb, cs.bias ? bias.data() : nullptr,
                         cs.accumulate, c, cs.c_bf16, ldc, false, cs.order);
  auto A = [&](int64_t i, int64_t k) { return bf16_value(cs.ta == 'N' ? a[i * lda + k] : a[k * lda + i]); };
  auto B = [&](int64_t k, int64_t j) { return bf16_value(cs.tb == 'N' ? b[k * ldb + j] : b[j * ldb + k]); };
  int bad = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const double got = cs.c_bf16 ? bf16_value(ch[i * ldc + j]) : cf[i * ldc + j];
      const double old = c0f[i * ldc + j];
      if (j >= N) {  // the padding between rows is never written
        if (got != old && ++bad <= 3) ADD_FAILURE() << "wrote padding at " << i << "," << j;
        continue;
      }
      double exact = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(A(i, k)) * B(k, j);
        exact += p;
        mag += std::fabs(p);
      }
      double extra = 0;
      if (cs.bias) exact += bias[j], extra += std::fabs(bias[j]);
      if (cs.accumulate) exact += old, extra += std::fabs(old);
      double tol = (static_cast<double>(K) + 2) * std::ldexp(1.0, -24) * (mag + extra);
      if (cs.c_bf16) tol += std::ldexp(1.0, -8) * std::fabs(exact) + 1e-30;
      if (!(std::fabs(got - exact) <= tol) && ++bad <= 3) {
        ADD_FAILURE() << "c(" << i << "," << j << ") = " << got << ", exact " << exact << ", tolerance " << tol;
      }
    }
  }
  return bad;
}

class AmxGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kernels::amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  }
};

TEST_F(AmxGemm, EveryBlockingClassMatchesExactSum) {
  const int64_t Ms[] = {1, 15, 16, 17, 32, 33, 70};
  const int64_t Ns[] = {1, 15, 16, 17, 31, 32, 33, 70};
  const int64_t Ks[] = {0, 1, 2, 31, 32, 33, 64, 100};
  uint64_t seed = 11;
  int64_t n = 0;
  for (int64_t M : Ms) {
    for (int64_t N : Ns) {
      for (int64_t K : Ks) {
        for (char ta : {'N', 'T'}) {
          for (char tb : {'N', 'T'}) {
            // The three flags cycle through all 8 combinations across the shapes.
            const int64_t f = n++ % 8;
            // Also with the operands swapped (C^T = op(B)^T op(A)^T, written transposed), which
            // the kernel picks itself only for large B.
            for (auto order : {kernels::AmxOperandOrder::as_given, kernels::AmxOperandOrder::swapped}) {
              const Case cs{M, N, K, ta, tb, (f & 1) != 0, (f & 2) != 0, (f & 4) != 0, order};
              SCOPED_TRACE(::testing::Message() << "M " << M << " N " << N << " K " << K << " " << ta << tb << " bias "
                                                << cs.bias << " accumulate " << cs.accumulate << " bf16 c " << cs.c_bf16
                                                << " swapped " << (order == kernels::AmxOperandOrder::swapped));
              if (check_case(cs, seed) > 0) return;
            }
            seed += 3;
          }
        }
      }
    }
  }
}

TEST_F(AmxGemm, ModelSizedProductsEveryFlag) {
  // Several blocks in each direction, both packed-A paths and the in-place one (K % 32 == 0).
  uint64_t seed = 901;
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{256, 96, 320}, {130, 200, 96}}) {
    for (char ta : {'N', 'T'}) {
      for (char tb : {'N', 'T'}) {
        for (int f = 0; f < 8; ++f) {
          const Case cs{M, N, K, ta, tb, (f & 1) != 0, (f & 2) != 0, (f & 4) != 0};
          SCOPED_TRACE(::testing::Message() << "M " << M << " N " << N << " K " << K << " " << ta << tb << " flags " << f);
          if (check_case(cs, seed) > 0) return;
          seed += 3;
        }
      }
    }
  }
}

TEST_F(AmxGemm, LongKPacksBInSeveralColumnChunks) {
  // B is packed in chunks of about 4 MiB of columns: with K = 32770 (Kp = 32800) a chunk is 32
  // columns, so N = 100 takes four chunks (the last one partial).
  uint64_t seed = 1301;
  for (char ta : {'N', 'T'}) {
    for (char tb : {'N', 'T'}) {
      for (int f : {0, 7}) {
        const Case cs{20, 100, 32770, ta, tb, (f & 1) != 0, (f & 2) != 0, (f & 4) != 0};
        SCOPED_TRACE(::testing::Message() << ta << tb << " flags " << f);
        if (check_case(cs, seed) > 0) return;
        seed += 3;
      }
      // The bound above grows with K (it is ~16 here), so the bias and the old c, which move the
      // result by ~1, are checked by difference: the same product with and without them differs
      // by bias + old up to the rounding of the two extra f32 additions.
      const int64_t M = 20, N = 100, K = 32770, lda = ta == 'N' ? K : M, ldb = tb == 'N' ? N : K;
      const std::vector<uint16_t> a = random_bf16(K * std::max(M, N), seed), b = random_bf16(K * std::max(M, N), seed + 1);
      std::vector<float> bias(N), old(M * N), plain(M * N, 0.0f);
      for (int64_t j = 0; j < N; ++j) bias[j] = 1.0f + static_cast<float>(j) / 8;
      for (int64_t i = 0; i < M * N; ++i) old[i] = -2.0f - static_cast<float>(i % 37) / 4;
      std::vector<float> full = old;
      kernels::amx_gemm_bf16(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, nullptr, false, plain.data(), false, N);
      kernels::amx_gemm_bf16(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, bias.data(), true, full.data(), false, N);
      int bad = 0;
      for (int64_t i = 0; i < M && bad < 3; ++i) {
        for (int64_t j = 0; j < N && bad < 3; ++j) {
          const double want = bias[j] + old[i * N + j], got = static_cast<double>(full[i * N + j]) - plain[i * N + j];
          // fl(fl(s + bias) + old): 2^-24 |s + bias| + 2^-24 |result|, doubled for slack.
          const double tol = std::ldexp(1.0, -23) * (std::fabs(plain[i * N + j]) + std::fabs(bias[j]) + std::fabs(full[i * N + j]));
          if (!(std::fabs(got - want) <= tol)) ++bad, ADD_FAILURE() << "bias + old at " << i << "," << j << ": " << got << " vs " << want;
        }
      }
      seed += 2;
    }
  }
}

// Swapping the operands changes where each product is computed, not what: every element is the
// same pairs of k summed in the same order, so the result is bit for bit the one as given — with
// bias, accumulation, bf16 c and the bf16-rounded f32 c, over partial blocks. The shapes include
// a Linear's forward on a batch of 64 and 128 (x W^T with W 1024 x 1024 / 1024 x 784), where
// the kernel swaps on its own, and products whose B is packed in several column chunks while A's
// blocks are read in place (K % 32 == 0, B over 512 KiB).
TEST_F(AmxGemm, SwappedOperandsAndColumnChunksGiveTheSameBits) {
  using kernels::AmxOperandOrder;
  uint64_t seed = 2101;
  for (const auto& [M, N, K] : {std::array<int64_t, 3>{128, 1024, 1024}, {64, 1024, 784}, {70, 300, 1024}, {33, 530, 992}}) {
    for (char ta : {'N', 'T'}) {
      for (char tb : {'N', 'T'}) {
        const int64_t lda = (ta == 'N' ? K : M) + 32, ldb = (tb == 'N' ? N : K) + 32, ldc = N + 3;
        const std::vector<uint16_t> a = random_bf16((ta == 'N' ? M : K) * lda, seed);
        const std::vector<uint16_t> b = random_bf16((tb == 'N' ? K : N) * ldb, seed + 1);
        const std::vector<uint16_t> old16 = random_bf16(M * ldc, seed + 2);
        std::vector<float> bias(static_cast<size_t>(N)), old32(old16.size());
        for (int64_t j = 0; j < N; ++j) bias[j] = bf16_value(old16[j]) * 0.5f;
        for (size_t i = 0; i < old32.size(); ++i) old32[i] = bf16_value(old16[i]);
        for (int f = 0; f < 8; ++f) {
          const bool with_bias = (f & 1) != 0, accumulate = (f & 2) != 0;
          const bool c_bf16 = (f & 4) != 0, round = !c_bf16 && with_bias;  // rounded f32 c in half the f32 cases
          SCOPED_TRACE(::testing::Message() << M << " x " << N << " x " << K << " " << ta << tb << " flags " << f);
          auto run = [&](AmxOperandOrder order) {
            std::vector<uint16_t> c16 = old16;
            std::vector<float> c32 = old32;
            void* c = c_bf16 ? static_cast<void*>(c16.data()) : static_cast<void*>(c32.data());
            kernels::amx_gemm_bf16(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, with_bias ? bias.data() : nullptr,
                                   accumulate, c, c_bf16, ldc, round, order);
            std::vector<uint32_t> bits(c_bf16 ? c16.size() : c32.size());
            for (size_t i = 0; i < bits.size(); ++i) {
              if (c_bf16) bits[i] = c16[i];
              else std::memcpy(&bits[i], &c32[i], 4);
            }
            return bits;
          };
          const std::vector<uint32_t> given = run(AmxOperandOrder::as_given);
          EXPECT_EQ(given, run(AmxOperandOrder::swapped));
          EXPECT_EQ(given, run(AmxOperandOrder::automatic));
        }
        // And the product itself is right (as_given here takes several column chunks of B).
        const Case cs{M, N, K, ta, tb, true, true, false, AmxOperandOrder::as_given};
        if (check_case(cs, seed + 3) > 0) return;
        seed += 5;
      }
    }
  }
}

// A packed whole before the products: stored transposed with K >= 256 (K not a multiple of 32,
// a partial last block of rows), and row-major on a row stride of 1 KiB multiples against 512 or
// more columns (where the kernel copies it to a padded stride). Exact-sum bound as above.
TEST_F(AmxGemm, AWholePackedOrCopiedMatchesExactSum) {
  uint64_t seed = 3101;
  const Case cases[] = {
      {70, 100, 300, 'T', 'N', true, true, false},  {70, 100, 300, 'T', 'T', false, false, true},
      {33, 40, 1024, 'T', 'N', false, true, false}, {70, 530, 512, 'N', 'N', true, false, false, {}, 0},
      {64, 512, 512, 'N', 'T', false, true, true, {}, 0}, {70, 530, 512, 'N', 'T', true, true, false, {}, 512},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(::testing::Message() << cs.M << " x " << cs.N << " x " << cs.K << " " << cs.ta << cs.tb << " lda pad "
                                      << cs.lda_pad);
    if (check_case(cs, seed) > 0) return;
    seed += 3;
  }
}

// kernels::gemm on bf16 tensors takes the AMX kernel here: batched with a broadcast B, views with
// either dim unit-stride, a bf16 and an f32 bias, bf16 and f32 outputs; compared with the f64
// product of the same bf16 values (same bound as above).
TEST_F(AmxGemm, GemmOnBf16TensorsMatchesF64) {
  Generator gen(5);
  const int64_t Bn = 3, M = 40, K = 72, N = 50;
  const Tensor a_rm = randn({Bn, M, K}, kFloat32, &gen).to(kBFloat16);
  const Tensor a_t = randn({Bn, K, M}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
  const Tensor b_rm = randn({1, K, N}, kFloat32, &gen).to(kBFloat16);
  const Tensor b_t = randn({1, N, K}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
  const Tensor bias16 = randn({N}, kFloat32, &gen).to(kBFloat16);
  const Tensor bias32 = randn({N}, kFloat32, &gen);
  for (const Tensor* a : {&a_rm, &a_t}) {
    for (const Tensor* b : {&b_rm, &b_t}) {
      for (const Tensor* bias : {static_cast<const Tensor*>(nullptr), &bias16, &bias32}) {
        for (DType out : {kBFloat16, kFloat32}) {
          SCOPED_TRACE(::testing::Message() << "A^T " << (a == &a_t) << " B^T " << (b == &b_t) << " bias "
                                            << (bias == nullptr ? "none" : dtype_name(bias->dtype())) << " out "
                                            << dtype_name(out));
          const Tensor c = kernels::gemm(*a, *b, bias != nullptr ? *bias : Tensor(), out);
          ASSERT_EQ(c.dtype(), out);
          const Tensor a64 = a->to(kFloat64).contiguous(), b64 = b->to(kFloat64).contiguous();
          const Tensor c64 = c.to(kFloat64).contiguous();
          const double* pa = a64.data_ptr<double>();
          const double* pb = b64.data_ptr<double>();
          const double* pc = c64.data_ptr<double>();
          const Tensor bias64 = bias != nullptr ? bias->to(kFloat64).contiguous() : Tensor();
          int bad = 0;
          for (int64_t bi = 0; bi < Bn && bad < 3; ++bi) {
            for (int64_t i = 0; i < M && bad < 3; ++i) {
              for (int64_t j = 0; j < N && bad < 3; ++j) {
                double exact = bias != nullptr ? bias64.data_ptr<double>()[j] : 0.0;
                double mag = std::fabs(exact);
                for (int64_t k = 0; k < K; ++k) {
                  const double p = pa[(bi * M + i) * K + k] * pb[k * N + j];
                  exact += p;
                  mag += std::fabs(p);
                }
                double tol = (K + 2) * std::ldexp(1.0, -24) * mag;
                if (out == kBFloat16) tol += std::ldexp(1.0, -8) * std::fabs(exact);
                const double got = pc[(bi * M + i) * N + j];
                if (!(std::fabs(got - exact) <= tol)) {
                  ++bad;
                  ADD_FAILURE() << "c[" << bi << "," << i << "," << j << "] = " << got << ", exact " << exact;
                }
              }
            }
          }
        }
      }
    }
  }
}

// gemm_into_rounded_bf16 (the AMX epilogue's rounding, f32 c) holds bit for bit what the bf16
// product converted to f32 holds: batched and broadcast, either operand transposed, shapes with
// partial tiles and blocks. Not skipped without AMX: it runs once per way bf16 products can run
// here (bf16_products.h): the widened way rounds its f32 product in place, in blocks of 4096.
TEST(GemmRounded, EqualsTheBf16ProductWidened) {
  ops_test::for_each_bf16_way([] {
    Generator gen(6);
    for (auto [Bn, M, K, N] : {std::array<int64_t, 4>{1, 19, 45, 37}, {2, 33, 70, 50}, {1, 128, 64, 96}, {1, 7, 1, 3}}) {
      SCOPED_TRACE(::testing::Message() << Bn << " x " << M << " x " << K << " x " << N);
      const Tensor a_rm = randn({Bn, M, K}, kFloat32, &gen).to(kBFloat16);
      const Tensor a_t = randn({Bn, K, M}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
      const Tensor b_rm = randn({1, K, N}, kFloat32, &gen).to(kBFloat16);
      const Tensor b_t = randn({1, N, K}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
      for (const Tensor* a : {&a_rm, &a_t}) {
        for (const Tensor* b : {&b_rm, &b_t}) {
          Tensor c = full({Bn, M, N}, 7.0, kFloat32);
          kernels::gemm_into_rounded_bf16(*a, *b, c);
          EXPECT_EQ(c.to_vector(), kernels::gemm(*a, *b, Tensor(), kBFloat16).to(kFloat32).to_vector());
        }
      }
    }
  });
  Tensor wrong = zeros({1, 19, 37}, kBFloat16);
  EXPECT_THROW(kernels::gemm_into_rounded_bf16(zeros({1, 19, 45}, kBFloat16), zeros({1, 45, 37}, kBFloat16), wrong),
               DTypeError);
}

}  // namespace
}  // namespace tandem
