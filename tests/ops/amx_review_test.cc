// Review of the bf16 AMX GEMM (kernels/cpu/amx_gemm.h) and the bf16 attention on it
// (kernels/cpu/attention.h, ops::scaled_dot_product_attention):
//  * reads and writes stay inside the operands: A, B and C are placed flush against PROT_NONE
//    guard pages (any read or write past a row end, a tail of M/N/K or before the first element
//    faults), with leading dimensions equal to the widths and start addresses only 2-byte aligned;
//  * NaN and inf propagate as in IEEE f32 arithmetic (oneDNN's kernels give the same);
//  * two intra-op threads give the same bits as one (each 32 x 32 block is summed in the same
//    order whichever thread computes it);
//  * attention on strided / broadcast (stride 0) views gives the same bits as on contiguous
//    copies of the same values, and stays within the bf16 rounding bounds of f32 attention for
//    head dims that are not multiples of 32, T = 1, S != T, causal with S < T;
//  * TANDEM_BF16_GEMM: an unknown value is a ValueError naming it; "onednn" still computes.
// Tolerances: as tests/ops/amx_gemm_test.cc (f32 sum of K exact products: (K + 2) 2^-24 sum|ab|,
// bf16 c: + 2^-8 |c|) and tests/ops/conv_norm_attention_test.cc (attention_bf16_bounds).
#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/core/convert.h"
#include "tandem/core/error.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/gemm.h"
#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;
using testing::leaf;
using testing::within;
using testing::AttentionBounds;
using testing::attention_bf16_bounds;
using testing::bf16_bits;
using testing::bf16_value;
using V = std::vector<Tensor>;

constexpr double kU32 = 0x1p-24;
constexpr double kUBf16 = 0x1p-8;

// `bytes` of memory with a PROT_NONE page right before and right after; at_end places the data
// flush against the trailing guard, else `skew` bytes after the leading one (a start aligned to
// the element only: 2 bytes for bf16, 4 for f32).
class Guarded {
 public:
  Guarded(size_t bytes, bool at_end, size_t skew) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t data_pages = (bytes + skew + page_ - 1) / page_ + 1;
    total_ = (data_pages + 2) * page_;
    void* m = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    base_ = static_cast<char*>(m);
    mprotect(base_, page_, PROT_NONE);
    mprotect(base_ + total_ - page_, page_, PROT_NONE);
    p_ = at_end ? base_ + total_ - page_ - bytes : base_ + page_ + skew;
  }
  ~Guarded() { munmap(base_, total_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(p_);
  }

 private:
  size_t page_ = 0, total_ = 0;
  char* base_ = nullptr;
  char* p_ = nullptr;
};

class AmxReview : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kernels::amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  }
};

TEST_F(AmxReview, OperandsFlushAgainstGuardPages) {
  struct Shape3 {
    int64_t M, N, K;
  };
  const Shape3 shapes[] = {{1, 1, 1}, {17, 33, 3}, {33, 47, 31}, {40, 17, 33}, {33, 31, 64}, {5, 70, 96}, {64, 64, 64}};
  uint32_t seed = 1;
  int bad = 0;
  for (const Shape3& sh : shapes) {
    const int64_t M = sh.M, N = sh.N, K = sh.K;
    for (char ta : {'N', 'T'}) {
      for (char tb : {'N', 'T'}) {
        for (int place = 0; place < 2; ++place) {
          for (int f = 0; f < 4; ++f) {
            const bool c_bf16 = (f & 1) != 0, accumulate = (f & 2) != 0;
            SCOPED_TRACE(::testing::Message() << "M " << M << " N " << N << " K " << K << " " << ta << tb << " place "
                                              << place << " bf16 c " << c_bf16 << " accumulate " << accumulate);
            const int64_t lda = ta == 'N' ? K : M, ldb = tb == 'N' ? N : K;
            const size_t ce = c_bf16 ? 2 : 4;
            Guarded ga(static_cast<size_t>(M * K) * 2, place == 0, 2), gb(static_cast<size_t>(K * N) * 2, place == 0, 2);
            Guarded gc(static_cast<size_t>(M * N) * ce, place == 0, ce), gbias(static_cast<size_t>(N) * 4, place == 0, 4);
            uint16_t* a = ga.as<uint16_t>();
            uint16_t* b = gb.as<uint16_t>();
            float* bias = gbias.as<float>();
            auto rnd = [&seed] {
              seed = seed * 1664525u + 1013904223u;
              return static_cast<float>(seed >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
            };
            for (int64_t i = 0; i < M * K; ++i) a[i] = bf16_bits(rnd());
            for (int64_t i = 0; i < K * N; ++i) b[i] = bf16_bits(rnd());
            for (int64_t j = 0; j < N; ++j) bias[j] = bf16_value(bf16_bits(rnd()));
            std::vector<float> old(static_cast<size_t>(M * N));
            for (auto& o : old) o = bf16_value(bf16_bits(rnd()));
            for (int64_t i = 0; i < M * N; ++i) {
              if (c_bf16) gc.as<uint16_t>()[i] = bf16_bits(old[i]);
              else gc.as<float>()[i] = old[i];
            }
            kernels::amx_gemm_bf16(ta, tb, M, N, K, a, lda, b, ldb, bias, accumulate, gc.as<void>(), c_bf16, N);
            for (int64_t i = 0; i < M && bad < 3; ++i) {
              for (int64_t j = 0; j < N && bad < 3; ++j) {
                double exact = bias[j] + (accumulate ? old[i * N + j] : 0.0);
                double mag = std::fabs(bias[j]) + std::fabs(old[i * N + j]);
                for (int64_t k = 0; k < K; ++k) {
                  const double p = static_cast<double>(bf16_value(ta == 'N' ? a[i * lda + k] : a[k * lda + i])) *
                                   bf16_value(tb == 'N' ? b[k * ldb + j] : b[j * ldb + k]);
                  exact += p;
                  mag += std::fabs(p);
                }
                double tol = static_cast<double>(K + 2) * kU32 * mag;
                if (c_bf16) tol += kUBf16 * std::fabs(exact) + 1e-30;
                const double got = c_bf16 ? bf16_value(gc.as<uint16_t>()[i * N + j]) : gc.as<float>()[i * N + j];
                if (!(std::fabs(got - exact) <= tol)) {
                  ++bad;
                  ADD_FAILURE() << "c(" << i << "," << j << ") = " << got << ", exact " << exact;
                }
              }
            }
          }
        }
      }
    }
  }
}

// A NaN in A makes its row of C NaN, one in B its column; inf * 0 is NaN; an inf in A times a
// nonzero column is inf. Both packed-A paths and the in-place one (K % 32 == 0), f32 and bf16 c,
// with bias and with accumulation (NaN in the old c stays NaN).
TEST_F(AmxReview, NanAndInfPropagate) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t M = 40, N = 40;
  for (int64_t K : {5, 64}) {
    for (char ta : {'N', 'T'}) {
      for (char tb : {'N', 'T'}) {
        for (int f = 0; f < 4; ++f) {
          const bool c_bf16 = (f & 1) != 0, accumulate = (f & 2) != 0;
          SCOPED_TRACE(::testing::Message() << "K " << K << " " << ta << tb << " bf16 c " << c_bf16 << " acc " << accumulate);
          std::vector<float> A(M * K, 0.25f), B(K * N, 0.5f);
          A[3 * K + 2] = nan;                                   // row 3 -> NaN
          A[5 * K + 1] = inf;                                   // row 5: inf * B(1, j)
          for (int64_t j = 0; j < N; ++j) B[1 * N + j] = j < 20 ? 0.0f : 1.0f;  // inf * 0 = NaN for j < 20
          B[4 * N + 7] = nan;                                   // column 7 -> NaN
          std::vector<uint16_t> a(M * K), b(K * N);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t k = 0; k < K; ++k) a[ta == 'N' ? i * K + k : k * M + i] = bf16_bits(A[i * K + k]);
          for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < N; ++j) b[tb == 'N' ? k * N + j : j * K + k] = bf16_bits(B[k * N + j]);
          std::vector<float> cf(M * N, 1.0f);
          std::vector<uint16_t> ch(M * N, bf16_bits(1.0f));
          cf[30 * N + 30] = nan, ch[30 * N + 30] = 0x7fc0;  // old c NaN at (30, 30)
          std::vector<float> bias(N, 0.0f);
          bias[33] = nan;
          kernels::amx_gemm_bf16(ta, tb, M, N, K, a.data(), ta == 'N' ? K : M, b.data(), tb == 'N' ? N : K, bias.data(),
                                 accumulate, c_bf16 ? static_cast<void*>(ch.data()) : cf.data(), c_bf16, N);
          int bad = 0;
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t j = 0; j < N; ++j) {
              const float got = c_bf16 ? bf16_value(ch[i * N + j]) : cf[i * N + j];
              const bool want_nan = i == 3 || j == 7 || j == 33 || (i == 5 && j < 20) || (accumulate && i == 30 && j == 30);
              const bool want_inf = !want_nan && i == 5;
              const bool ok = want_nan ? std::isnan(got) : want_inf ? got == inf : std::isfinite(got);
              if (!ok && ++bad <= 3) ADD_FAILURE() << "c(" << i << "," << j << ") = " << got;
            }
          }
          if (bad > 0) return;
        }
      }
    }
  }
}

// Two intra-op threads: the same bits as one (B packing and blocks of rows split across them).
TEST_F(AmxReview, TwoThreadsGiveTheSameBits) {
  const int saved = get_num_threads();
  Generator gen(77);
  const Tensor a = randn({2, 300, 96}, kFloat32, &gen).to(kBFloat16);
  const Tensor b = randn({2, 96, 250}, kFloat32, &gen).to(kBFloat16);
  const Tensor at = randn({2, 70, 300}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
  const Tensor bt = randn({2, 250, 70}, kFloat32, &gen).to(kBFloat16).transpose(1, 2);
  const Tensor bias = randn({250}, kFloat32, &gen);
  V one, two;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    V& out = threads == 1 ? one : two;
    out.push_back(kernels::gemm(a, b, bias, kBFloat16));
    out.push_back(kernels::gemm(a, b, Tensor(), kFloat32));
    out.push_back(kernels::gemm(at, bt, bias, kFloat32));
    out.push_back(kernels::gemm(at, bt, Tensor(), kBFloat16));
  }
  set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(all_close(two[i], one[i], 0, 0)) << "product " << i;
}

// bf16 matmul on broadcast views (stride 0 along the batch or the rows) and on views whose
// unit-stride dim has size 1: within the bound of the f64 product of the same values.
TEST_F(AmxReview, GemmOnBroadcastAndSizeOneViews) {
  Generator gen(78);
  auto check = [](const Tensor& a, const Tensor& b, const char* what) {
    SCOPED_TRACE(what);
    const Tensor c = ops::matmul(a, b);
    ASSERT_EQ(c.dtype(), kBFloat16);
    const Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
    const Tensor exact = ops::matmul(a64, b64);
    const Tensor mag = ops::matmul(ops::abs(a64), ops::abs(b64));
    const double K = static_cast<double>(a.size(-1));
    const Tensor tol = ops::add(ops::mul(mag, (K + 2) * kU32), ops::mul(ops::abs(exact), kUBf16));
    const Tensor err = ops::sub(c.to(kFloat64), exact);
    EXPECT_LE(ops::max(ops::sub(ops::abs(err), tol)).item(), 0.0);
  };
  const Tensor base = randn({1, 40, 72}, kFloat32, &gen).to(kBFloat16);
  const Tensor w = randn({3, 72, 50}, kFloat32, &gen).to(kBFloat16);
  check(base.expand({3, 40, 72}), w, "A expanded over the batch (stride 0)");
  check(randn({1, 72}, kFloat32, &gen).to(kBFloat16).expand({40, 72}), w.select(0, 1), "A rows expanded (stride 0)");
  check(randn({72, 1}, kFloat32, &gen).to(kBFloat16).expand({72, 50}).transpose(0, 1), w.select(0, 0),
        "A expanded along K");
  check(randn({40, 72}, kFloat32, &gen).to(kBFloat16), randn({50, 72}, kFloat32, &gen).to(kBFloat16).t(), "B^T");
  check(randn({40, 72}, kFloat32, &gen).to(kBFloat16), randn({72, 1}, kFloat32, &gen).to(kBFloat16).expand({72, 50}),
        "B columns expanded (stride 0)");
  check(randn({72, 40}, kFloat32, &gen).to(kBFloat16).narrow(1, 3, 1).t(), w.select(0, 2), "A 1 x K from a column");
  check(randn({40, 72}, kFloat32, &gen).to(kBFloat16), randn({72, 9}, kFloat32, &gen).to(kBFloat16).narrow(1, 4, 1),
        "B K x 1 from a column");
  check(randn({40, 1}, kFloat32, &gen).to(kBFloat16), randn({9, 50}, kFloat32, &gen).to(kBFloat16).narrow(0, 2, 1), "K = 1");
}

// The epilogue's bf16 rounding equals core/convert's bit for bit on f32 values of every class
// (normal, subnormal, ties, near the largest finite value, inf, NaN): c = 0 + bias with K = 0.
TEST_F(AmxReview, Bf16RoundingEqualsConvert) {
  const int64_t N = 4096;
  std::vector<float> bias(N);
  uint32_t x = 12345;
  for (int64_t j = 0; j < N; ++j) {
    x = x * 1664525u + 1013904223u;
    uint32_t bits = x;
    if (j % 4 == 1) bits &= 0x807fffffu;                    // subnormal (or zero)
    if (j % 8 == 2) bits = (bits & 0xffff0000u) | 0x8000u;  // a tie
    if (j % 16 == 3) bits = (bits & 0x80000000u) | 0x7f7f0000u | (bits & 0xffffu);  // near FLT_MAX
    if (j % 32 == 5) bits = (bits & 0x80000000u) | 0x7f800000u | (j % 64 == 5 ? 0 : (bits & 0x3fffffu) | 1u);
    std::memcpy(&bias[j], &bits, 4);
  }
  std::vector<float> want_f(N);
  for (int64_t j = 0; j < N; ++j) want_f[j] = 0.0f + bias[j];  // the epilogue adds bias to a zero sum
  std::vector<uint16_t> want(N), got(N);
  convert(want_f.data(), kFloat32, want.data(), kBFloat16, N);
  const uint16_t dummy = 0;
  kernels::amx_gemm_bf16('N', 'N', 1, N, 0, &dummy, 0, &dummy, N, bias.data(), false, got.data(), true, N);
  int bad = 0;
  for (int64_t j = 0; j < N; ++j) {
    if (got[j] != want[j] && ++bad <= 5) {
      ADD_FAILURE() << "bias bits " << std::hex << std::bit_cast<uint32_t>(bias[j]) << ": got " << got[j] << ", convert "
                    << want[j];
    }
  }
}

// ---- attention ----

TEST_F(AmxReview, AttentionOddHeadDimsAndLengthsWithinBounds) {
  struct Case {
    int64_t T, S, D, Dv;
    bool causal;
  };
  const Case cases[] = {{20, 20, 8, 8, true},   {33, 50, 40, 24, false}, {70, 45, 72, 40, true},
                        {1, 1, 40, 40, false},  {1, 30, 8, 72, true},    {65, 3, 16, 8, true},
                        {5, 130, 72, 8, false}, {96, 96, 96, 33, true}};
  uint64_t seed = 3000;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.T << " S " << c.S << " D " << c.D << " Dv " << c.Dv << " causal "
                                      << c.causal);
    auto both = [&](const Shape& sh, double lo, double hi) {
      const Tensor b16 = leaf(sh, lo, hi, seed++, kBFloat16);
      Tensor f32 = b16.detach().to(kFloat32);
      f32.requires_grad_(true);
      return std::pair<Tensor, Tensor>{b16, f32};
    };
    auto [q16, q32] = both({2, 2, c.T, c.D}, -2, 2);
    auto [k16, k32] = both({2, 2, c.S, c.D}, -2, 2);
    auto [v16, v32] = both({2, 2, c.S, c.Dv}, -1, 1);
    const Tensor y16 = ops::scaled_dot_product_attention(q16, k16, v16, c.causal);
    const Tensor y32 = ops::scaled_dot_product_attention(q32, k32, v32, c.causal);
    ASSERT_EQ(y16.dtype(), kBFloat16);
    const Tensor gy = randn(y32.shape(), kBFloat16, nullptr);
    const V g16 = autograd::grad({ops::sum(ops::mul(y16.to(kFloat32), gy.to(kFloat32)))}, {q16, k16, v16});
    const V g32 = autograd::grad({ops::sum(ops::mul(y32, gy.to(kFloat32)))}, {q32, k32, v32});
    const AttentionBounds b = attention_bf16_bounds(q32, k32, v32, gy, c.causal, y32, g32);
    EXPECT_TRUE(within(y16, y32, b.y)) << "output";
    const Tensor* bounds[3] = {&b.dq, &b.dk, &b.dv};
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(within(g16[i], g32[i], *bounds[i])) << "gradient " << i;
  }
}

// Views (heads of a permuted buffer, q broadcast over queries with stride 0, 3-d operands, an
// upstream gradient broadcast over queries) against contiguous copies of the same values: the
// kernel must give the same bits whatever the layout.
TEST_F(AmxReview, AttentionViewsEqualContiguousCopies) {
  auto run = [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal, const Tensor& w) {
    const Tensor y = ops::scaled_dot_product_attention(q, k, v, causal);
    // loss = sum over queries of y, weighted per (.., d): its gradient wrt y is w broadcast over T.
    V out{y.contiguous()};
    const V g = autograd::grad({ops::sum(ops::mul(ops::sum(y, {-2}), w))}, {q, k, v});
    out.insert(out.end(), g.begin(), g.end());
    return out;
  };
  auto fresh = [](const Tensor& t) {
    Tensor c = t.detach().contiguous();
    c.requires_grad_(true);
    return c;
  };
  const int64_t B = 2, H = 3, T = 37, S = 41;
  // D = 40: q, k packed per block; D = 64: rows of q (and of the broadcast upstream gradient)
  // read in place by the tile loads, with row stride 0.
  for (const auto& [D, causal] : {std::pair<int64_t, bool>{40, false}, {40, true}, {64, false}, {64, true}}) {
    SCOPED_TRACE(::testing::Message() << "D " << D << (causal ? " causal" : " non-causal"));
    // k, v: heads of a (B, S, H, D) buffer viewed (B, H, S, D) (unit stride along D).
    const Tensor kb = leaf({B, S, H, D}, -2, 2, 4000, kBFloat16), vb = leaf({B, S, H, D}, -1, 1, 4001, kBFloat16);
    const Tensor k = kb.permute({0, 2, 1, 3}), v = vb.permute({0, 2, 1, 3});
    const Tensor q1 = leaf({B, H, 1, D}, -2, 2, 4002, kBFloat16);
    const Tensor q = q1.expand({B, H, T, D});  // stride 0 over queries
    const Tensor w = leaf({B, H, D}, -1, 1, 4003, kBFloat16).detach();
    const V got = run(q, k, v, causal, w);
    const Tensor qc = fresh(q), kc = fresh(k), vc = fresh(v);
    const V want = run(qc, kc, vc, causal, w);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_close(got[i], want[i], 0, 0)) << "4-d, result " << i;
    // 3-d operands (BH, T, D), one of them a transposed view with unit stride along D.
    const Tensor q3 = leaf({B * H, T, D}, -2, 2, 4004, kBFloat16);
    const Tensor k3 = leaf({S, B * H, D}, -2, 2, 4005, kBFloat16).transpose(0, 1);
    const Tensor v3 = leaf({B * H, S, D / 2 + 12}, -1, 1, 4006, kBFloat16);
    const Tensor w3 = leaf({B * H, D / 2 + 12}, -1, 1, 4007, kBFloat16).detach();
    const V got3 = run(q3, k3, v3, causal, w3);
    const V want3 = run(fresh(q3), fresh(k3), fresh(v3), causal, w3);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_close(got3[i], want3[i], 0, 0)) << "3-d, result " << i;
  }
}

// A zero head dim: the scores are empty sums (0), so with an explicit scale every query
// attends uniformly (out = mean of v over the visible keys, as torch's math attention gives);
// the output used to be left unwritten (the head count was computed as numel / (T * D)).
TEST(AmxReviewAttention, ZeroHeadDim) {
  for (DType dt : {kBFloat16, kFloat32, kFloat64}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << (causal ? " causal" : ""));
      const Tensor q = zeros({2, 3, 5, 0}, dt), k = zeros({2, 3, 7, 0}, dt);
      const Tensor v = leaf({2, 3, 7, 4}, -1, 1, 4100, dt);
      const Tensor y = ops::scaled_dot_product_attention(q, k, v, causal, 1.0);
      // d sum(y) / dv[j] = sum over queries t of P[t, j] = sum_t 1 / (keys t sees), exact in bf16
      // up to the rounding of P (2^-8 relative per term).
      const Tensor dv = autograd::grad({ops::sum(y.to(kFloat64))}, {v})[0];
      for (int64_t j = 0; j < 7; ++j) {
        double w = 0;
        for (int64_t t = 0; t < 5; ++t) w += causal ? (j <= t ? 1.0 / (t + 1) : 0.0) : 1.0 / 7;
        EXPECT_TRUE(all_close(dv.narrow(2, j, 1).to(kFloat64), full({2, 3, 1, 4}, w, kFloat64), 2 * kUBf16, 1e-6)) << "dv " << j;
      }
      const Tensor v64 = v.to(kFloat64);
      Tensor want = empty({2, 3, 5, 4}, kFloat64);
      for (int64_t t = 0; t < 5; ++t) {
        const int64_t n = causal ? t + 1 : 7;
        want.narrow(2, t, 1).copy_(ops::mean(v64.narrow(2, 0, n), {2}, true));
      }
      EXPECT_TRUE(all_close(y.to(kFloat64), want, dt == kBFloat16 ? 2 * kUBf16 : 1e-6, 1e-6));
      // No queries: an empty output, zero gradients for k and v.
      const Tensor q0 = leaf({2, 3, 0, 8}, -1, 1, 4101, dt), k0 = leaf({2, 3, 6, 8}, -1, 1, 4102, dt);
      const Tensor v0 = leaf({2, 3, 6, 4}, -1, 1, 4103, dt);
      const Tensor y0 = ops::scaled_dot_product_attention(q0, k0, v0, causal);
      EXPECT_EQ(y0.shape(), (Shape{2, 3, 0, 4}));
      const V g0 = autograd::grad({ops::sum(y0.to(kFloat64))}, {k0, v0});
      EXPECT_TRUE(all_close(g0[0], zeros({2, 3, 6, 8}, dt), 0, 0) && all_close(g0[1], zeros({2, 3, 6, 4}, dt), 0, 0));
    }
  }
}

// Child of AmxReviewEnv.Bf16GemmSwitch: kernels::gemm with an f32 bias and a
// bf16 result under TANDEM_BF16_GEMM=onednn, against the bound of the AMX kernel ((K + 2) 2^-24
// sum|ab| + u |c|); exit code 3 when within it.
int onednn_f32_bias_child() {
  setenv("TANDEM_BF16_GEMM", "onednn", 1);
  Generator gen(79);
  const int64_t M = 40, K = 72, N = 50;
  const Tensor a = randn({1, M, K}, kFloat32, &gen).to(kBFloat16), b = randn({1, K, N}, kFloat32, &gen).to(kBFloat16);
  const Tensor bias = randn({N}, kFloat32, &gen);
  const Tensor c = kernels::gemm(a, b, bias, kBFloat16);
  const Tensor a64 = a.to(kFloat64), b64 = b.to(kFloat64);
  const Tensor exact = ops::add(ops::matmul(a64, b64), bias.to(kFloat64));
  const Tensor mag = ops::add(ops::matmul(ops::abs(a64), ops::abs(b64)), ops::abs(bias.to(kFloat64)));
  const Tensor tol = ops::add(ops::mul(mag, (K + 2) * kU32), ops::mul(ops::abs(exact), kUBf16));
  const double excess = ops::max(ops::sub(ops::abs(ops::sub(c.to(kFloat64), exact)), tol)).item();
  return !kernels::amx_bf16_enabled() && c.dtype() == kBFloat16 && excess <= 0 ? 3 : 4;
}

// TANDEM_BF16_GEMM is read once per process, so each value is tried in a child process (a
// death test re-runs this binary).
TEST(AmxReviewEnv, Bf16GemmSwitch) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(
      {
        setenv("TANDEM_BF16_GEMM", "cublas", 1);
        try {
          const Tensor a = randn({8, 8}, kFloat32, nullptr).to(kBFloat16);
          (void)ops::matmul(a, a);
        } catch (const ValueError& e) {
          std::_Exit(std::string(e.what()).find("\"cublas\"") != std::string::npos ? 3 : 4);
        } catch (...) {
          std::_Exit(5);
        }
        std::_Exit(6);
      },
      ::testing::ExitedWithCode(3), "");
  // "onednn": bf16 matmul and attention still compute (oneDNN's matmul; attention in f32 and
  // rounded once: u |y|). The matmul differs from f32 by its rounding (u |m|) and the two f32
  // summation orders of 40 products of |a| < 5: 2 * 40 * 2^-24 * 40 * 25 < 1e-3.
  EXPECT_EXIT(
      {
        setenv("TANDEM_BF16_GEMM", "onednn", 1);
        const Tensor a = randn({2, 2, 9, 40}, kFloat32, nullptr).to(kBFloat16);
        const Tensor y = ops::scaled_dot_product_attention(a, a, a, true);
        const Tensor r = ops::scaled_dot_product_attention(a.to(kFloat32), a.to(kFloat32), a.to(kFloat32), true);
        const Tensor m = ops::matmul(a, a.transpose(2, 3));
        const Tensor mr = ops::matmul(a.to(kFloat32), a.to(kFloat32).transpose(2, 3));
        const bool ok = !kernels::amx_bf16_enabled() && y.dtype() == kBFloat16 && all_close(y, r, kUBf16, 0) &&
                        all_close(m, mr, kUBf16, 1e-3);
        std::_Exit(ok ? 3 : 4);
      },
      ::testing::ExitedWithCode(3), "");
  // "onednn" with an f32 bias and a bf16 result: the bias is added in f32 as on the AMX kernel
  // (it was rounded to bf16 first: an extra u |bias|, up to 2^-8 of the bias off).
  EXPECT_EXIT(std::_Exit(onednn_f32_bias_child()), ::testing::ExitedWithCode(3), "");
}

}  // namespace
}  // namespace tandem
