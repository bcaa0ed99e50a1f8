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
// The minimum, as max: (values, int64 indices) of the first minimum along `dim`, the gradient to
// it; min(x) of all elements shares the gradient among the ties. NaN counts as the minimum.
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor min(const Tensor& x);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
// torch.var / torch.std over `dims` (empty: all): the sum of squared deviations from the mean
// divided by max(0, n - correction) (correction 1: Bessel's, PyTorch's default). 16-bit inputs are
// computed in f32 and rounded once.
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, double correction = 1.0, bool keepdim = false);
Tensor std(const Tensor& x, const std::vector<int64_t>& dims = {}, double correction = 1.0, bool keepdim = false);

}  // namespace tandem::ops
