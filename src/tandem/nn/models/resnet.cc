#include "tandem/nn/models/resnet.h"

#include <cmath>
#include <functional>

#include "tandem/nn/init.h"
#include "tandem/ops/conv.h"
#include "tandem/ops/elementwise.h"

namespace tandem::nn::models {

namespace {

std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<Conv2d>(in, out, 3, Conv2dOptions{.stride = {stride, stride}, .padding = {1, 1}, .bias = false});
}

}  // namespace

BasicBlock::BasicBlock(int64_t in, int64_t planes, int64_t stride) : Module("BasicBlock") {
  conv1 = register_module("conv1", conv3x3(in, planes, stride));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, 1));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  if (stride != 1 || in != planes) {
    downsample = register_module("downsample", std::make_shared<Sequential>());
    downsample->push_back(
        std::make_shared<Conv2d>(in, planes, 1, Conv2dOptions{.stride = {stride, stride}, .bias = false}));
    downsample->push_back(std::make_shared<BatchNorm2d>(planes));
  }
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = ops::relu((*bn1)((*conv1)(x)));
  out = (*bn2)((*conv2)(out));
  return ops::relu(ops::add(out, downsample ? (*downsample)(x) : x));
}

ResNet18::ResNet18(const ResNetOptions& o) : Module("ResNet") {
  conv1 = register_module("conv1", conv3x3(o.in_channels, 64, 1));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(64));
  int64_t in = 64;
  auto layer = [&](const char* name, int64_t planes, int64_t stride) {
    auto seq = register_module(name, std::make_shared<Sequential>());
    seq->push_back(std::make_shared<BasicBlock>(in, planes, stride));
    seq->push_back(std::make_shared<BasicBlock>(planes, planes, 1));
    in = planes;
    return seq;
  };
  layer1 = layer("layer1", 64, 1);
  layer2 = layer("layer2", 128, 2);
  layer3 = layer("layer3", 256, 2);
  layer4 = layer("layer4", 512, 2);
  fc = register_module("fc", std::make_shared<Linear>(512, o.num_classes));
  // torchvision: kaiming_normal_(mode="fan_out", nonlinearity="relu") for every conv.
  // (Walks children directly: named_modules() needs the shared_ptr this constructor lacks.)
  std::function<void(const Module&)> init_convs = [&](const Module& m) {
    for (auto& [name, child] : m.named_children()) {
      if (auto conv = std::dynamic_pointer_cast<Conv2d>(child)) {
        const double std = std::sqrt(2.0 / static_cast<double>(init::fans(conv->weight).second));
        init::normal_(conv->weight, 0.0, std);
      }
      init_convs(*child);
    }
  };
  init_convs(*this);
}

Tensor ResNet18::forward(const Tensor& x) {
  Tensor h = ops::relu((*bn1)((*conv1)(x)));
  h = (*layer4)((*layer3)((*layer2)((*layer1)(h))));
  return (*fc)(ops::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
}

std::shared_ptr<ResNet18> resnet18(const ResNetOptions& o) { return std::make_shared<ResNet18>(o); }

}  // namespace tandem::nn::models
