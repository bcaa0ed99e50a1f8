// ResNet-18, CIFAR variant (3x3 stride-1 stem, no max-pool), with torchvision's parameter names
// ("conv1.weight", "bn1.*", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight", "fc.*")
// and initialisation (kaiming_normal fan_out for convs, BatchNorm weight 1 / bias 0).
#pragma once

#include <memory>

#include "tandem/nn/conv.h"
#include "tandem/nn/layers.h"
#include "tandem/nn/norm.h"

namespace tandem::nn::models {

class BasicBlock : public Module {
 public:
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm2d> bn1, bn2;
  std::shared_ptr<Sequential> downsample;  // null when the shapes already match
};

struct ResNetOptions {
  int64_t in_channels = 3;
  int64_t num_classes = 10;
};

class ResNet18 : public Module {
 public:
  explicit ResNet18(const ResNetOptions& options = {});
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<BatchNorm2d> bn1;
  std::shared_ptr<Sequential> layer1, layer2, layer3, layer4;
  std::shared_ptr<Linear> fc;
};

std::shared_ptr<ResNet18> resnet18(const ResNetOptions& options = {});

}  // namespace tandem::nn::models
