// Small bf16 matrix products on AVX512-BF16 (VDPBF16PS), for CPUs with that extension and no
// AMX (AMD Zen 4 and later, Intel Cooper Lake): the tile products of the bf16 attention kernel
// (attention.h), which otherwise widens q, k, v to f32 and multiplies at the f32 FMA rate. Each
// instruction multiplies 16 pairs of bf16 and adds them to 16 f32 sums: twice the f32 rate where
// it issues as often as an FMA (Zen 4); where it does not, bf16_products() is widened and the
// attention kernel stays on f32 (bf16_products.h).
#pragma once

#include <cstdint>

namespace tandem::kernels {

// The CPU has AVX512-BF16 (with AVX512BW/VL) and TANDEM_BF16_GEMM does not say "onednn": the
// kernel below can run (its tests run wherever this holds).
bool dpbf16_usable();

// dpbf16_usable() and bf16_products() is native: the attention kernel takes these products.
bool dpbf16_enabled();

// c (M x N, row stride ldc) = op(A) @ op(B) [+ c's old value when `accumulate`], with a and b
// holding bf16 bit patterns and op as in amx_gemm.h:
//   transa 'N': A(i, k) = a[i * lda + k]     'T': A(i, k) = a[k * lda + i]
//   transb 'N': B(k, j) = b[k * ldb + j]     'T': B(k, j) = b[j * ldb + k]
// Arithmetic of VDPBF16PS: products of bf16 are exact in f32; per pair of k (2p, 2p+1) the
// instruction adds the odd product, then the even one, to the running f32 sum, each add rounded
// to nearest even, with subnormal inputs read as zero and subnormal results flushed to zero (an
// odd K gets a zero partner). The old c (f32, or bf16 when c_bf16) starts the sum; a bf16 c is
// rounded once at the end, to nearest even as core/convert.h. Runs on the calling thread only,
// outside the GEMM kernel timer (the attention kernel splits heads across threads itself).
// Requires dpbf16_usable() (the CPU part of it).
void dpbf16_tile_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                           const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16, int64_t ldc);

// What dpbf16_tile_gemm_bf16 computes, in plain scalar code with the same order of operations and
// the same subnormal handling: the reference of the tests.
void dpbf16_tile_gemm_reference(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a,
                                int64_t lda, const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16,
                                int64_t ldc);

}  // namespace tandem::kernels
