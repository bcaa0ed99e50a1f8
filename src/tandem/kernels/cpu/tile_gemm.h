// Small f32 matrix products for kernels that tile their own loops (attention): a register-blocked
// AVX-512 body (6 rows x 64 columns of C in 24 registers) with no packing, no workspace and no
// library call. For 64 x 64 x 64 it runs ~4.5 us against ~5.5-11 us for oneDNN's sgemm called
// back to back, and inside a training step sgemm's small calls measured 17-27 us. Large products
// stay on kernels::sgemm (gemm.h). Without AVX-512 it falls back to sgemm.
#pragma once

#include <cstdint>

namespace tandem::kernels {

// c (M x N, row stride ldc) = A @ B, or c += A @ B when `accumulate`, where
//   A(i, k) = a[i * a_rs + k * a_cs]   (a_cs = 1: row-major A; a_rs = 1: A stored transposed)
//   B(k, j) = b[k * ldb + j]           (row-major, unit stride along j).
// Each c element is one f32 fused multiply-add chain over k = 0..K-1 in order (onto c's old
// value when accumulating). Intended for M, N, K up to a few hundred.
void tile_sgemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                bool accumulate, float* c, int64_t ldc);

// The portable body (plain loops, same order of operations), for tests and CPUs without AVX-512.
void tile_sgemm_reference(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                          int64_t ldb, bool accumulate, float* c, int64_t ldc);

// dst (cols x rows, row stride rows) = the transpose of src (rows x cols, row stride ld): 16 x 16
// blocks transposed in registers with AVX-512, edges and CPUs without it by plain loops.
void transpose_f32(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst);

}  // namespace tandem::kernels
