// Shape ops beyond Tensor's own view methods: concatenation, splitting, gathering rows.
// All are differentiable.
#pragma once

#include <optional>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::ops {

// Concatenates along `dim`; all tensors must match in the other dims and in dtype.
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Stacks equal-shaped tensors along a new dimension `dim`.
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Pieces of `split_size` along `dim` (the last may be smaller); views of the input.
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
// Pieces of the given sizes (must sum to x.size(dim)).
std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
// `chunks` pieces of ceil(size / chunks) (fewer when the size does not fill them), like PyTorch.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
// Rows `index` (int64 or int32, 1-d) of x along `dim`; backward adds into those rows.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// weight[indices]: (num_embeddings, D) gathered by an integer tensor of any shape -> (..., D).
// Indices out of range throw ValueError naming the index. padding_idx rows get no gradient.
// padding_idx (F.embedding's): that row gets no gradient; negative counts from the end; outside
// [-num_embeddings, num_embeddings) is a ValueError.
Tensor embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding_idx = std::nullopt);

}  // namespace tandem::ops
