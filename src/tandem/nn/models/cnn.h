// W2: the small Fashion-MNIST CNN. Parameter and buffer names equal this PyTorch module's:
//
//   class CNN(nn.Module):
//       def __init__(self):
//           super().__init__()
//           block = lambda cin, cout, s: [nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
//           self.features = nn.Sequential(*block(1, 32, 1), *block(32, 64, 2), *block(64, 128, 2))
//           self.fc = nn.Linear(128, 10)
//       def forward(self, x):
//           return self.fc(self.features(x).mean((2, 3)))
//
// ("features.0.weight", "features.1.weight", "features.1.running_mean", ..., "fc.bias").
#pragma once

#include <memory>

#include "tandem/nn/layers.h"

namespace tandem::nn::models {

struct CnnOptions {
  int64_t in_channels = 1;
  int64_t num_classes = 10;
};

class Cnn : public Module {
 public:
  explicit Cnn(const CnnOptions& options = {});
  Tensor forward(const Tensor& x) override;  // (N, C, H, W) -> (N, num_classes)

  std::shared_ptr<Sequential> features;
  std::shared_ptr<Linear> fc;
};

std::shared_ptr<Cnn> cnn(const CnnOptions& options = {});

}  // namespace tandem::nn::models
