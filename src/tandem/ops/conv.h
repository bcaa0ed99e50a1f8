// Convolution and pooling (NCHW shapes; conv outputs are channels-last in memory, see
// kernels/cpu/conv.h). All differentiable.
#pragma once

#include <array>

#include "tandem/core/tensor.h"

namespace tandem::ops {

struct Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
};

// x (N, C, H, W), weight (O, C/groups, KH, KW), bias undefined or (O) -> (N, O, OH, OW).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Conv2dOptions& options = {});

struct Pool2dOptions {
  std::array<int64_t, 2> kernel_size{2, 2};
  std::array<int64_t, 2> stride{0, 0};  // 0: same as kernel_size (PyTorch's default)
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};  // max_pool2d only
  bool ceil_mode = false;
  bool count_include_pad = true;  // avg_pool2d only
};

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& options);
Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& options);
// Averages over bins [floor(i*H/OH), ceil((i+1)*H/OH)) as PyTorch does.
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);

}  // namespace tandem::ops
