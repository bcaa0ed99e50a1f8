#include "tandem/nn/models/cnn.h"

#include "tandem/nn/conv.h"
#include "tandem/nn/norm.h"
#include "tandem/ops/reduce.h"

namespace tandem::nn::models {

Cnn::Cnn(const CnnOptions& o) : Module("CNN") {
  features = register_module("features", std::make_shared<Sequential>());
  const int64_t channels[4] = {o.in_channels, 32, 64, 128};
  const int64_t strides[3] = {1, 2, 2};
  for (int i = 0; i < 3; ++i) {
    features->push_back(std::make_shared<Conv2d>(channels[i], channels[i + 1], 3,
                                                 Conv2dOptions{.stride = {strides[i], strides[i]}, .padding = {1, 1}, .bias = false}));
    features->push_back(std::make_shared<BatchNorm2d>(channels[i + 1]));
    features->push_back(std::make_shared<ReLU>());
  }
  fc = register_module("fc", std::make_shared<Linear>(128, o.num_classes));
}

Tensor Cnn::forward(const Tensor& x) { return (*fc)(ops::mean((*features)(x), {2, 3})); }

std::shared_ptr<Cnn> cnn(const CnnOptions& o) { return std::make_shared<Cnn>(o); }

}  // namespace tandem::nn::models
