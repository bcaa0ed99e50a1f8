// bf16 matrix products on Intel AMX tiles, written for the shapes of training steps on one core
// (M ~ 10^3, N and K 10^2-10^3). Why not oneDNN's: Debian's oneDNN 2.6 runs these shapes at
// 190-290 GFLOP/s on its AMX matmul (it re-packs B, and A when transposed, inside every call with
// small blocks); this kernel packs B once per call into the tile layout (in column chunks of at
// most ~4 MiB), reads a row-major A in place (else packs it per block of 32 rows, in L1) and keeps
// four 16 x 16 f32 accumulator tiles (a 32 x 32 block of C) busy over all of K. Used by kernels::gemm for bf16
// when amx_bf16_enabled(); TANDEM_BF16_GEMM=onednn switches back to oneDNN's matmul (bf16_products.h).
#pragma once

#include <cstdint>

namespace tandem::kernels {

// The CPU has AMX-BF16 and Linux granted this process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once).
bool amx_bf16_usable();

// bf16_products() is amx (bf16_products.h: AMX-BF16 usable, TANDEM_BF16_GEMM not "onednn" or
// "f32"): whether kernels::gemm, the attention kernel and the bf16 weight gradient of convolution
// take the AMX products.
bool amx_bf16_enabled();

// c (M x N, row stride ldc) = op(A) @ op(B) [+ bias] [+ c's old value when `accumulate`], where
// a and b hold bf16 bit patterns and
//   transa 'N': A(i, k) = a[i * lda + k]     'T': A(i, k) = a[k * lda + i]
//   transb 'N': B(k, j) = b[k * ldb + j]     'T': B(k, j) = b[j * ldb + k]
// Products are exact in f32 and summed in f32 (the hardware adds each pair of k, then the tile
// accumulator over k in order; like oneDNN's AMX kernels, the tile product reads subnormal bf16
// inputs as zero and flushes subnormal sums); bias (f32, N values, or null) and the old c are
// added to that sum (full 32 x 32 blocks of an f32 c without bias start the sum from the old c
// instead) and the result is written once: f32, or bf16 rounded to nearest-even (subnormals
// included, bit for bit as core/convert.h) when c_bf16 (bf16 c is read as bf16 when
// accumulating). With `round_bf16` an f32 c receives that same bf16 rounding, stored widened back
// to f32: the values a bf16 c converted to f32 would hold, in one pass (a bf16 gradient cast back
// to its f32 parameter's dtype). Requires amx_bf16_usable(). Splits blocks of 32 rows of C across
// the intra-op thread pool. `order`: the kernel may compute C^T = op(B)^T op(A)^T and write it
// transposed (faster for a few rows of C against a large B: a Linear's forward on a small batch);
// every element is the same sum in the same order either way, so the bits do not depend on it.
enum class AmxOperandOrder {
  automatic,  // swapped where that is faster (<= 128 rows of C against a B of >= 1 MiB stored transposed)
  as_given,
  swapped,  // computes C^T = op(B)^T op(A)^T and writes it transposed: the same bits
};
void amx_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                   const uint16_t* b, int64_t ldb, const float* bias, bool accumulate, void* c, bool c_bf16,
                   int64_t ldc, bool round_bf16 = false, AmxOperandOrder order = AmxOperandOrder::automatic);

// The same product (no bias) for kernels that tile their own loops (attention): runs on the
// calling thread only and outside the GEMM kernel timer.
void amx_tile_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                        const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16, int64_t ldc);

}  // namespace tandem::kernels
