// Scaled dot-product attention: a fused kernel that never materialises the T x T matrix
// (kernels/cpu/attention.h), and the plain composed version kept as its test reference.
#pragma once

#include <optional>

#include "tandem/core/tensor.h"

namespace tandem::ops {

// q (..., T, D), k (..., S, D), v (..., S, Dv) with equal leading dims -> (..., T, Dv).
// causal masks key j for query i when j > i (PyTorch's is_causal, top-left aligned).
// scale defaults to 1/sqrt(D). Computed in f32 (f64 for f64 inputs); output in q's dtype.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = false,
                                    std::optional<double> scale = std::nullopt);

// softmax(q k^T * scale + mask) v from matmul/softmax/masked_fill: the reference.
Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = false,
                                              std::optional<double> scale = std::nullopt);

}  // namespace tandem::ops
