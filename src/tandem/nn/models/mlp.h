// W1: the Fashion-MNIST MLP, parameter names as PyTorch's
// nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
// nn.Linear(1024, 10)): "1.weight", "1.bias", "3.weight", ..., "5.bias".
#pragma once

#include <memory>
#include <vector>

#include "tandem/nn/layers.h"

namespace tandem::nn::models {

struct MlpOptions {
  int64_t in_features = 784;
  std::vector<int64_t> hidden = {1024, 1024};
  int64_t num_classes = 10;
};

std::shared_ptr<Sequential> mlp(const MlpOptions& options = {});

}  // namespace tandem::nn::models
