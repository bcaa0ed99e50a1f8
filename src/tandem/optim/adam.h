// Adam and AdamW with PyTorch's update rule (bias-corrected moments, eps outside the sqrt,
// optional amsgrad). Adam adds weight decay to the gradient; AdamW decays the weights.
#pragma once

#include <optional>

#include "tandem/optim/optimizer.h"

namespace tandem::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // Unset: each optimizer's PyTorch default, 0 for Adam and 1e-2 for AdamW (so AdamW(p, {.lr = x})
  // decays as torch.optim.AdamW(p, lr=x) does).
  std::optional<double> weight_decay;
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
