// Adam and AdamW with PyTorch's update rule (bias-corrected moments, eps outside the sqrt,
// optional amsgrad). Adam adds weight decay to the gradient; AdamW decays the weights.
#pragma once

#include "tandem/optim/optimizer.h"

namespace tandem::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // AdamW's default is 1e-2 (see AdamW)
  bool amsgrad = false;
  bool maximize = false;
  // Update every f32 parameter in one fused multi-tensor pass (same results as per-tensor).
  bool fused = true;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options = {});
  Adam(std::vector<ParamGroup> groups, AdamOptions options = {});

 protected:
  void update() override;
  std::map<std::string, StateKind> state_keys() const override;
  Adam(std::vector<ParamGroup> groups, AdamOptions options, std::string name, bool decoupled);

 private:
  bool decoupled_;
  bool fused_;
};

class AdamW : public Adam {
 public:
  static AdamOptions defaults() {
    AdamOptions o;
    o.weight_decay = 1e-2;
    return o;
  }
  AdamW(std::vector<Tensor> params, AdamOptions options = defaults());
  AdamW(std::vector<ParamGroup> groups, AdamOptions options = defaults());
};

}  // namespace tandem::optim
