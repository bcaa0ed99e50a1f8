// SGD with momentum, dampening, Nesterov and weight decay: PyTorch's update rule exactly.
#pragma once

#include "tandem/optim/optimizer.h"

namespace tandem::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options = {});
  SGD(std::vector<ParamGroup> groups, SGDOptions options = {});

 protected:
  // step(): for each parameter with a gradient:
  //   d = g + wd * p;  buf = momentum * buf + (1 - dampening) * d  (buf = d on the first step);
  //   d = nesterov ? d + momentum * buf : buf;  p -= lr * d.
  void update() override;
  std::map<std::string, StateKind> state_keys() const override { return {{"momentum_buffer", StateKind::kLikeParam}}; }
};

}  // namespace tandem::optim
