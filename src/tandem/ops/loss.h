// Softmax family and losses. Statistics and losses are computed in f32 (f64 for f64 inputs)
// whatever the storage dtype, as the precision policy requires.
#pragma once

#include <string_view>

#include "tandem/core/tensor.h"

namespace tandem::ops {

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  std::string_view reduction = "mean";  // "mean", "sum" or "none"
  // Class weights (C), PyTorch's `weight`: each row's loss is scaled by its target's weight (the
  // smoothing term by every class's), and "mean" divides by the summed weights of the rows not
  // ignored. No gradient flows to it (PyTorch's is not differentiable either).
  Tensor weight;
};

// PyTorch's cross_entropy with class-index targets: input (N, C) or (N, C, d1, ...) or (C),
// target int64 (N) / (N, d1, ...) / (). One fused pass (log-softmax + NLL + smoothing); the
// loss is f32 (f64 for f64 input). Out-of-range targets throw ValueError naming them.
Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& options = {});

struct NllLossOptions {
  int64_t ignore_index = -100;
  std::string_view reduction = "mean";
};
// Negative log-likelihood of log-probabilities `input` (N, C) at class indices `target` (N).
Tensor nll_loss(const Tensor& input, const Tensor& target, const NllLossOptions& options = {});

// Mean squared error, reduction "mean", "sum" or "none".
Tensor mse_loss(const Tensor& input, const Tensor& target, std::string_view reduction = "mean");

}  // namespace tandem::ops
