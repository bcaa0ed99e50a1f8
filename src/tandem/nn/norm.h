// Normalisation layers with PyTorch's parameters and buffers: BatchNorm keeps running_mean,
// running_var (f32) and num_batches_tracked (int64) as persistent buffers.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "tandem/nn/module.h"
#include "tandem/ops/norm.h"

namespace tandem::nn {

struct BatchNormOptions {
  double eps = 1e-5;
  // std::nullopt: cumulative moving average, running = mean of all batches seen (PyTorch's
  // momentum=None: the factor is 1 / num_batches_tracked).
  std::optional<double> momentum = 0.1;
  bool affine = true;
  bool track_running_stats = true;
};

// BatchNorm over (N, C) / (N, C, L) (BatchNorm1d), (N, C, H, W) (BatchNorm2d) or (N, C, D, H, W)
// (BatchNorm3d); expected_dims 2 means "2 or 3", 0 any input of at least 2 dims (SyncBatchNorm).
class BatchNorm : public Module {
 public:
  BatchNorm(int64_t num_features, int64_t expected_dims, const BatchNormOptions& options, std::string type_name);
  Tensor forward(const Tensor& x) override;
  // relu(forward(x)) as one fused op (ops::batch_norm_relu): what a [BatchNorm, ReLU] pair runs.
  Tensor forward_relu(const Tensor& x);
  std::string extra_repr() const override;
  std::vector<std::string> optional_state_keys() const override { return {"num_batches_tracked"}; }
  // The running-stats update factor of a training forward that just counted its batch in
  // num_batches_tracked: the momentum, or 1 / num_batches_tracked without one.
  double running_average_factor() const;

  Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  int64_t num_features;
  BatchNormOptions options;
  // When set, training takes its batch statistics over a process group
  // (ops::batch_norm_over_group): SyncBatchNorm and parallel::convert_sync_batchnorm set it, so
  // a converted layer stays the object models hold.
  std::shared_ptr<const ops::BatchNormGroupStats> group_stats;

 private:
  Tensor forward_impl(const Tensor& x, bool relu);
  int64_t expected_dims_;  // 2 means "2 or 3" (BatchNorm1d), 0 "at least 2"
};

class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm(num_features, 2, options, "BatchNorm1d") {}
};

class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm(num_features, 4, options, "BatchNorm2d") {}
};

class BatchNorm3d : public BatchNorm {
 public:
  explicit BatchNorm3d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm(num_features, 5, options, "BatchNorm3d") {}
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true, bool bias = true);
  explicit LayerNorm(int64_t dim, double eps = 1e-5) : LayerNorm(Shape{dim}, eps) {}
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

  Tensor weight, bias;
  Shape normalized_shape;
  double eps;
};

class GroupNorm : public Module {
 public:
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

  Tensor weight, bias;
  int64_t num_groups, num_channels;
  double eps;
};

}  // namespace tandem::nn
