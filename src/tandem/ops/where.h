// Selection ops: where, masked_fill, tril/triu. Differentiable in the selected values.
#pragma once

#include "tandem/core/tensor.h"

namespace tandem::ops {

// out = cond ? a : b, broadcasting all three; cond is a bool tensor.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// out = mask ? value : x (mask bool); x and mask broadcast together, as PyTorch's out-of-place
// masked_fill (a mask with more dims than x gives the broadcast shape).
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// Keeps elements on and below the `diagonal`-th diagonal of the last two dims (tril) or on and
// above it (triu), zeroing the rest.
Tensor tril(const Tensor& x, int64_t diagonal = 0);
Tensor triu(const Tensor& x, int64_t diagonal = 0);

}  // namespace tandem::ops
