#include "tandem/nn/models/cnn.h"

#include "tandem/nn/conv.h"
#include "tandem/nn/norm.h"
#include "tandem/ops/conv.h"

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

// features(x).mean((2, 3)), then fc. Each [BatchNorm2d, ReLU] pair runs as one fused op
// (BatchNorm::forward_relu: same results, one pass fewer each way), and the mean over H, W is the
// global average pool, which reads the channels-last activations in place and returns its
// gradient channels-last (ops::mean would reorder to NCHW, and under autocast cast to f32 first).
Tensor Cnn::forward(const Tensor& x) {
  const Sequential& f = *features;
  Tensor h = x;
  for (size_t i = 0; i < f.size(); ++i) {
    if (auto bn = std::dynamic_pointer_cast<BatchNorm>(f[i]); bn && i + 1 < f.size() && std::dynamic_pointer_cast<ReLU>(f[i + 1])) {
      h = bn->forward_relu(h);
      ++i;
    } else {
      h = (*f[i])(h);
    }
  }
  return (*fc)(ops::adaptive_avg_pool2d(h, {1, 1}).view({h.size(0), h.size(1)}));
}

std::shared_ptr<Cnn> cnn(const CnnOptions& o) { return std::make_shared<Cnn>(o); }

}  // namespace tandem::nn::models
