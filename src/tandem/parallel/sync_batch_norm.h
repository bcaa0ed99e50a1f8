// SyncBatchNorm: batch normalization whose statistics cover the whole process group's batch
// (torch.nn.SyncBatchNorm). Forward gathers every rank's (count, mean, M2) per channel and combines
// them exactly (Chan et al.; unequal per-rank batches are fine); backward all-reduces the two
// per-channel sums (dy, dy * (x - mean)). Invariant: running stats are computed from the same
// gathered numbers in the same order on every rank, so they stay identical everywhere.
#pragma once

#include <memory>

#include "tandem/dist/process_group.h"
#include "tandem/nn/norm.h"

namespace tandem::parallel {

// The training-mode forward of `bn` over `group` (updates bn's running stats; relu: followed by a
// fused ReLU, as BatchNorm::forward_relu). Eval mode is plain BatchNorm. BatchNorm's kernels
// (ops::batch_norm_over_group: any layout, f32/bf16/f16 read in place, per-channel sums folded
// into f64), the ranks' statistics combined in f64; output in x's dtype and layout.
Tensor sync_batch_norm(const Tensor& x, nn::BatchNorm& bn, std::shared_ptr<dist::ProcessGroup> group,
                       bool relu = false);

class SyncBatchNorm : public nn::BatchNorm {
 public:
  // dims: 4 for (N, C, H, W) inputs, 2 for (N, C) or (N, C, L).
  SyncBatchNorm(int64_t num_features, std::shared_ptr<dist::ProcessGroup> group,
                const nn::BatchNormOptions& options = {}, int64_t dims = 4);
};

// Makes every BatchNorm in `module` synchronize over `group` (the layers keep their parameters,
// buffers and identity; models holding them directly see the change). Returns how many were
// converted. PyTorch's torch.nn.SyncBatchNorm.convert_sync_batchnorm.
int64_t convert_sync_batchnorm(nn::Module& module, std::shared_ptr<dist::ProcessGroup> group);

}  // namespace tandem::parallel
