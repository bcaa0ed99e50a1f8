// SyncBatchNorm: batch normalization whose statistics cover the whole process group's batch
// (torch.nn.SyncBatchNorm). Forward gathers every rank's (count, mean, M2) per channel and combines
// them exactly (Chan et al.; unequal per-rank batches are fine); backward all-reduces the two
// per-channel sums (dy, dy * (x - mean)) when the input needs a gradient (as torch: without one,
// only the weight's and bias's local sums, no collective; so whether it needs one must be the
// same on every rank). Invariant: running stats are computed from the same
// gathered numbers in the same order on every rank, so they stay identical everywhere.
// Its backward all-reduce runs inside backward, between DDP's bucket all-reduces: under
// find_unused_parameters with a set of unused parameters that differs across ranks, a bucket may
// launch before it on one rank and after it on another (as in PyTorch); shm reports that as a
// collective mismatch, other backends may pair the wrong collectives. Keep the unused set the same
// on every rank there, or give SyncBatchNorm a process group of its own.
#pragma once

#include <memory>

#include "tandem/dist/process_group.h"
#include "tandem/nn/norm.h"

namespace tandem::parallel {

// BatchNorm's training statistics over `group` (what SyncBatchNorm and convert_sync_batchnorm put
// in BatchNorm::group_stats): BatchNorm's kernels (any layout, f32/bf16/f16 read in place,
// per-channel sums folded into f64, the fused ReLU), the ranks' statistics combined in f64.
// Eval mode stays plain BatchNorm. Throws ValueError at a forward where the whole group has
// exactly one value per channel; where it has none (every rank's batch empty) the output is empty
// and the running stats stay, as BatchNorm does with an empty batch.
std::shared_ptr<const ops::BatchNormGroupStats> group_batch_stats(std::shared_ptr<dist::ProcessGroup> group);

class SyncBatchNorm : public nn::BatchNorm {
 public:
  // dims: 0 (the default, as torch's SyncBatchNorm) any (N, C, *) input; 2 only (N, C) or
  // (N, C, L), 4 only (N, C, H, W), 5 only (N, C, D, H, W).
  SyncBatchNorm(int64_t num_features, std::shared_ptr<dist::ProcessGroup> group,
                const nn::BatchNormOptions& options = {}, int64_t dims = 0);
};

// Makes every BatchNorm in `module` synchronize over `group` (the layers keep their parameters,
// buffers and identity; models holding them directly see the change). Returns how many were
// converted. PyTorch's torch.nn.SyncBatchNorm.convert_sync_batchnorm.
int64_t convert_sync_batchnorm(nn::Module& module, std::shared_ptr<dist::ProcessGroup> group);

}  // namespace tandem::parallel
