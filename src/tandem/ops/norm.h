// Normalisation ops. Statistics are always computed in f32 (f64 for f64 inputs), also for
// bf16/f16 inputs; the output keeps the input's dtype and memory layout.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::ops {

// PyTorch's batch_norm on x (N, C, *). Training: normalise with the batch's biased variance and,
// when running stats are given, update them in place with `momentum` (running_var with the
// unbiased variance). Eval: normalise with the running stats. weight/bias optional (C).
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);

// relu(batch_norm(...)) in the same passes over the data (the [BatchNorm2d, ReLU] pair of a conv
// block): same arguments and results as the two ops in sequence, without the intermediate
// tensor, the ReLU pass and the ReLU's backward pass.
Tensor batch_norm_relu(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);

// Batch statistics over more than this process's batch: what a SyncBatchNorm
// (parallel/sync_batch_norm.h) plugs into batch_norm's training mode. Both are collectives, called
// once per forward and once per backward on every process of the group.
struct BatchNormGroupStats {
  // In: this process's values per channel (`count`, possibly 0) and per-channel mean and biased
  // variance. Out: the same for the group's whole batch.
  std::function<void(double& count, std::vector<double>& mean, std::vector<double>& var)> stats;
  // In: this process's per-channel sums of dy and dy * (x - mean), mean the group's. Out: the
  // group's sums.
  std::function<void(std::vector<double>& sum_dy, std::vector<double>& sum_dy_xc)> grad_sums;
};

// Training-mode batch_norm (relu: batch_norm_relu) with the statistics of the group's batch:
// normalises with the group's mean and variance, updates the running stats (when given) with the
// group's unbiased variance, and in backward takes the input gradient from the group's sums, while
// weight and bias get this process's own share (DDP averages them). Same kernels, layouts and
// dtypes as batch_norm.
Tensor batch_norm_over_group(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, double momentum, double eps, bool relu,
                             std::shared_ptr<const BatchNormGroupStats> group);

// Normalises over the last normalized_shape.size() dims; weight/bias optional of that shape.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// x (N, C, *): statistics per sample over groups of C / num_groups channels; weight/bias (C).
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = Tensor(), const Tensor& bias = Tensor(),
                  double eps = 1e-5);

}  // namespace tandem::ops
