// Differentiable reductions. Empty `dims` reduces over every dimension.
#pragma once

#include <utility>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::ops {

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// (values, int64 indices) of the maximum along `dim`; the gradient flows to the first maximum.
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
// The maximum of all elements (a 0-d tensor).
Tensor max(const Tensor& x);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);

}  // namespace tandem::ops
