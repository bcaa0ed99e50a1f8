// Batched matrix multiply on CPU: f32 through oneDNN; bf16 (f32 accumulation) as bf16_products()
// says: Tandem's AMX kernel (amx_gemm.h), oneDNN's bf16 matmul, or widened to f32; a plain loop
// path for f64 and an f32 detour for f16. oneDNN primitives are built once per shape, stride pattern and
// dtype, then reused.
#pragma once

#include "tandem/core/tensor.h"

namespace tandem::kernels {

// c[b] = a[b] @ b_[b] (+ bias broadcast over rows). a: (B, M, K), b_: (B, K, N), any strides in
// which one of the two matrix dims has unit stride (otherwise copied); B may be 1 in either for
// broadcast. bias: undefined or (N). Returns a new contiguous (B, M, N) tensor of `out_dtype`.
// a and b_ must share a dtype; out_dtype is that dtype or f32 (for bf16/f16 inputs).
Tensor gemm(const Tensor& a, const Tensor& b, const Tensor& bias, DType out_dtype);

// The GFLOP/s-relevant part only: c = a @ b into a preallocated contiguous c (used by benches).
void gemm_into(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c);

// c = f32(bf16(a @ b)) for bf16 a and b_ and a preallocated contiguous f32 c of (B, M, N): the
// product rounded once to bf16 (as gemm(a, b_, {}, bf16) gives) and stored widened to f32, the
// values that product converted to f32 holds. On the AMX kernel in one pass (the rounding in its
// epilogue); elsewhere through a bf16 product and a conversion. For a bf16 gradient produced
// straight into the f32 buffer of the parameter it is cast back to (autograd's rounded
// destinations, node.h).
void gemm_into_rounded_bf16(const Tensor& a, const Tensor& b, Tensor& c);

// t as f32: t itself when it is f32; a dense t keeps its strides (one linear conversion pass, so
// a transposed weight stays transposed), any other becomes contiguous. Widening bf16 and f16 is
// exact.
Tensor widened_to_f32(const Tensor& t);

// Raw row-major f32 BLAS-style product on the calling thread's oneDNN:
//   c (M x N, row stride ldc) = op(a) @ op(b) + beta * c,
// where op(x) is x ('N') or its transpose ('T'), and lda/ldb are the row strides of a and b as
// stored. For kernels that tile their own loops (attention) and write straight into strided
// outputs; beta = 1 accumulates.
void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace tandem::kernels
