#include "tandem/nn/models/mlp.h"

namespace tandem::nn::models {

std::shared_ptr<Sequential> mlp(const MlpOptions& o) {
  auto seq = std::make_shared<Sequential>();
  seq->push_back(std::make_shared<Flatten>());
  int64_t in = o.in_features;
  for (int64_t h : o.hidden) {
    seq->push_back(std::make_shared<Linear>(in, h));
    seq->push_back(std::make_shared<ReLU>());
    in = h;
  }
  seq->push_back(std::make_shared<Linear>(in, o.num_classes));
  return seq;
}

}  // namespace tandem::nn::models
