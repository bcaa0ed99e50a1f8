// Fused, vectorised activation kernels on dense f32 buffers (GELU with the tanh approximation,
// forward and backward in one pass each). Multiversioned for AVX-512 / AVX2 / baseline.
#pragma once

#include <cstdint>

#include "tandem/core/dtype.h"

namespace tandem::kernels {

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_tanh_f32(const float* x, float* y, int64_t n);
// gx = g * dy/dx
void gelu_tanh_backward_f32(const float* g, const float* x, float* gx, int64_t n);
// The same on 16-bit floats (bf16 or f16, all buffers of `dtype`), through f32 in blocks.
void gelu_tanh_reduced(const void* x, void* y, int64_t n, DType dtype);
void gelu_tanh_backward_reduced(const void* g, const void* x, void* gx, int64_t n, DType dtype);

}  // namespace tandem::kernels
