// torch.optim.swa_utils.update_bn: recompute BatchNorm running statistics with the current
// weights. After training (or weight averaging) the running averages trail weights that kept
// moving; evaluation then normalises with statistics of an older network. update_bn resets every
// tracked BatchNorm (running_mean 0, running_var 1, num_batches_tracked 0) and runs the model
// forward in training mode over the given batches, each layer's momentum set so that the running
// statistics become the plain average of the per-batch statistics (PyTorch's momentum=None):
// running_mean = mean of the batch means, running_var = mean of the unbiased batch variances.
#pragma once

#include <cstdint>
#include <functional>

#include "tandem/core/tensor.h"
#include "tandem/nn/module.h"

namespace tandem::optim {

// `next_input` returns the next batch's model input, or an undefined Tensor when the data is
// exhausted. Runs without gradients; weights are untouched. The model's train/eval mode and every
// layer's momentum are restored afterwards, also when the forward throws. A model with no
// BatchNorm that tracks running statistics returns 0 without calling next_input. SyncBatchNorm
// layers are included (each forward is a collective: every rank must pass the same number of
// batches). Any autocast guard the caller holds applies to the forwards. Returns the number of
// batches run.
int64_t update_bn(nn::Module& model, const std::function<Tensor()>& next_input);

}  // namespace tandem::optim
