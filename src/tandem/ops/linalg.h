// Matrix products through oneDNN: f32, and bf16 with f32 accumulation (f64 on a plain loop,
// f16 via f32 on this CPU).
#pragma once

#include "tandem/core/tensor.h"

namespace tandem::ops {

// PyTorch's matmul: 1-d x 1-d (dot), 2-d x 2-d, and batched with broadcast batch dims.
// Both operands must share a dtype. Throws ShapeError naming both shapes on a mismatch.
Tensor matmul(const Tensor& a, const Tensor& b);
// y = x @ weight^T + bias; x: (..., in), weight: (out, in), bias: undefined or (out).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

}  // namespace tandem::ops
