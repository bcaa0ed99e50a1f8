// Batched matrix multiply on CPU through oneDNN (f32; bf16 with f32 accumulation), with a
// plain loop path for f64 and an f32 detour for f16. Primitives are built once per shape,
// stride pattern and dtype, then reused.
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

}  // namespace tandem::kernels
