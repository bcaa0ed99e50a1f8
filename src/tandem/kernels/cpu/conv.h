// 2-d convolution on CPU. f32 and bf16 (f32 accumulation) run on oneDNN's convolution
// primitives with activations in channels-last (NHWC) layout, which its AVX-512/AMX kernels use
// natively: a conv output stays channels-last through ReLU/BatchNorm into the next conv, so data
// is reordered only at the boundaries (an NCHW input, the weights). f64 runs on plain loops (for
// gradcheck); f16 goes through f32. Primitives are built once per shape and reused. The bf16
// weight gradient (groups 1, C*KH*KW >= 64) runs as AMX GEMMs over im2col blocks instead of
// oneDNN 2.6's backward-weights kernel, which is 5x slower than its matmul on these shapes.
// Where bf16 products run widened (bf16_products.h), bf16 convolutions widen their operands to
// f32 exactly, run the f32 primitives and round the result once.
#pragma once

#include <array>
#include <utility>

#include "tandem/core/tensor.h"

namespace tandem::kernels {

struct Conv2dParams {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
};

// Validates shapes and returns (N, O, OH, OW); throws ShapeError/ValueError naming the values.
Shape conv2d_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p);
// The channels-last strides of an (N, C, H, W) shape.
Shape channels_last_strides(const Shape& shape);
// x with channels-last layout (x itself when it already is).
Tensor to_channels_last(const Tensor& x);

// y = conv(x, w) + bias: x (N, C, H, W), w (O, C/groups, KH, KW), bias undefined or (O).
Tensor conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p);
// dL/dx for dL/dy = gy.
Tensor conv2d_backward_input(const Tensor& gy, const Tensor& w, const Shape& x_shape, const Conv2dParams& p);
// (dL/dw, dL/dbias or undefined).
std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& gy, const Tensor& x, const Shape& w_shape, bool with_bias,
                                                 const Conv2dParams& p);

}  // namespace tandem::kernels
