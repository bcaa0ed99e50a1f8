// Parameter initialisation (torch.nn.init), in place and without autograd, drawing from
// `gen` (default: the thread's default generator).
#pragma once

#include "tandem/core/rng.h"
#include "tandem/core/tensor.h"

namespace tandem::nn::init {

void uniform_(Tensor& t, double a, double b, Generator* gen = nullptr);
void normal_(Tensor& t, double mean, double std, Generator* gen = nullptr);
void constant_(Tensor& t, double value);
void zeros_(Tensor& t);
void ones_(Tensor& t);
// fan_in / fan_out of a weight (dim 1 / dim 0, times the receptive field for conv weights).
std::pair<int64_t, int64_t> fans(const Tensor& t);
// PyTorch's kaiming_uniform_ with leaky-relu slope `a`, mode fan_in.
void kaiming_uniform_(Tensor& t, double a = 0.0, Generator* gen = nullptr);
void xavier_uniform_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);

}  // namespace tandem::nn::init
