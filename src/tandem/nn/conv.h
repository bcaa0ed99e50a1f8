// Convolution and pooling layers, PyTorch's names, parameters and initialisation.
#pragma once

#include <array>
#include <string>

#include "tandem/nn/module.h"
#include "tandem/ops/conv.h"

namespace tandem::nn {

struct Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
  bool bias = true;
  DType dtype = kFloat32;
};

// weight (out, in/groups, k, k) and bias (out) uniform in +-1/sqrt(fan_in), as in PyTorch.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel_size, const Conv2dOptions& options = {});
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, const Conv2dOptions& options = {})
      : Conv2d(in_channels, out_channels, {kernel_size, kernel_size}, options) {}
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void reset_parameters();

  Tensor weight, bias;
  int64_t in_channels, out_channels;
  std::array<int64_t, 2> kernel_size;
  ops::Conv2dOptions conv;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(ops::Pool2dOptions options) : Module("MaxPool2d"), options_(options) {}
  Tensor forward(const Tensor& x) override { return ops::max_pool2d(x, options_); }

 private:
  ops::Pool2dOptions options_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(ops::Pool2dOptions options) : Module("AvgPool2d"), options_(options) {}
  Tensor forward(const Tensor& x) override { return ops::avg_pool2d(x, options_); }

 private:
  ops::Pool2dOptions options_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::array<int64_t, 2> output_size) : Module("AdaptiveAvgPool2d"), size_(output_size) {}
  Tensor forward(const Tensor& x) override { return ops::adaptive_avg_pool2d(x, size_); }

 private:
  std::array<int64_t, 2> size_;
};

}  // namespace tandem::nn
