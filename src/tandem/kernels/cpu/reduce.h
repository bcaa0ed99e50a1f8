// Reductions over a set of dimensions on CPU. Sums accumulate in f64 (f32/f64 inputs) or f32
// (16-bit inputs, which are f32 statistics by policy), so long rows keep their precision.
#pragma once

#include <utility>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::kernels {

// Normalised, sorted, de-duplicated dims; empty `dims` means all dimensions.
std::vector<int64_t> reduction_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op);
// The output shape of reducing `dims` (keepdim keeps them as size 1).
Shape reduced_shape(const Shape& shape, const std::vector<int64_t>& dims, bool keepdim);

// Sum over `dims` (already normalised), output dtype `out_dtype` (floating).
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, DType out_dtype);
// Max over one dim: (values, int64 indices of the first maximum). NaN wins, as in PyTorch.
// How many values (or rows) an f32 partial sum of 16-bit values takes before it is added into an
// f64 total: far below 2^24, where an f32 sum stops growing by values near 1. sum() and linear's
// bias gradient fold at the same points.
inline constexpr int64_t kFoldEvery = 4096;

std::pair<Tensor, Tensor> max_dim(const Tensor& x, int64_t dim, bool keepdim, bool minimum = false);

}  // namespace tandem::kernels
