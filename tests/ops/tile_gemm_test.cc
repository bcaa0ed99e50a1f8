// The register-tile f32 product and transpose behind the attention kernel
// (kernels/cpu/tile_gemm.h): every shape class of the AVX-512 body (6-row blocks and each
// remainder, 16-column vectors and masked tails, 64-column blocks, K = 0 and 1, A row-major and
// stored transposed, overwrite and accumulate, row strides beyond the width) equals the portable
// loops bit for bit (both are one FMA chain per element over k in order), and the portable loops
// equal the f64 product within f32's K * 2^-24 * sum|a||b| bound, so a wrong index fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/core/rng.h"
#include "tandem/kernels/cpu/tile_gemm.h"

namespace tandem {
namespace {

std::vector<float> random_values(int64_t n, uint64_t seed) {
  const Generator gen(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = gen.uniform(0, static_cast<uint64_t>(i)) * 2.0f - 1.0f;
  return v;
}

TEST(TileSgemm, EqualsPortableLoopsBitForBitAndF64WithinBound) {
  const int64_t Ms[] = {1, 5, 6, 7, 13, 64};
  const int64_t Ns[] = {1, 15, 16, 17, 64, 70, 130};
  const int64_t Ks[] = {0, 1, 9, 64};
  uint64_t seed = 7;
  for (int64_t M : Ms) {
    for (int64_t N : Ns) {
      for (int64_t K : Ks) {
        for (bool a_transposed : {false, true}) {
          for (bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "M " << M << " N " << N << " K " << K << " A^T " << a_transposed
                                              << " accumulate " << accumulate);
            // Row strides wider than the matrices, so a stride mix-up reads the wrong values.
            const int64_t lda = (a_transposed ? M : K) + 3, ldb = N + 5, ldc = N + 2;
            const int64_t a_rows = a_transposed ? K : M;
            const std::vector<float> a = random_values(std::max<int64_t>(a_rows, 1) * lda, seed++);
            const std::vector<float> b = random_values(std::max<int64_t>(K, 1) * ldb, seed++);
            const std::vector<float> c0 = random_values(M * ldc, seed++);
            const int64_t a_rs = a_transposed ? 1 : lda, a_cs = a_transposed ? lda : 1;
            std::vector<float> fast = c0, ref = c0;
            kernels::tile_sgemm(M, N, K, a.data(), a_rs, a_cs, b.data(), ldb, accumulate, fast.data(), ldc);
            kernels::tile_sgemm_reference(M, N, K, a.data(), a_rs, a_cs, b.data(), ldb, accumulate, ref.data(), ldc);
            int bad = 0;
            for (int64_t i = 0; i < M && bad < 3; ++i) {
              for (int64_t j = 0; j < ldc && bad < 3; ++j) {
                const float got = fast[i * ldc + j];
                if (j >= N) {  // padding between rows is never written
                  if (got != c0[i * ldc + j]) ++bad, ADD_FAILURE() << "wrote padding at " << i << "," << j;
                  continue;
                }
                double exact = accumulate ? c0[i * ldc + j] : 0.0, mag = std::fabs(exact);
                for (int64_t k = 0; k < K; ++k) {
                  const double p = static_cast<double>(a[i * a_rs + k * a_cs]) * b[k * ldb + j];
                  exact += p;
                  mag += std::fabs(p);
                }
                if (got != ref[i * ldc + j]) ++bad, ADD_FAILURE() << "differs from the loops at " << i << "," << j;
                if (std::fabs(got - exact) > static_cast<double>(K + 1) * 0x1p-24 * mag) {
                  ++bad, ADD_FAILURE() << "off the f64 product at " << i << "," << j << ": " << got << " vs " << exact;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(TileSgemm, TransposeIsExact) {
  for (int64_t rows : {1, 15, 16, 33, 128}) {
    for (int64_t cols : {1, 16, 17, 64}) {
      SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
      const int64_t ld = cols + 4;
      const std::vector<float> src = random_values(rows * ld, static_cast<uint64_t>(rows * 1000 + cols));
      std::vector<float> dst(static_cast<size_t>(rows * cols), -1.0f);
      kernels::transpose_f32(src.data(), rows, cols, ld, dst.data());
      int bad = 0;
      for (int64_t r = 0; r < rows && bad < 3; ++r) {
        for (int64_t c = 0; c < cols && bad < 3; ++c) {
          if (dst[c * rows + r] != src[r * ld + c]) ++bad, ADD_FAILURE() << "at " << r << "," << c;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tandem
