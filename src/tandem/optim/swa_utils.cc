#include "tandem/optim/swa_utils.h"

#include <optional>
#include <vector>

#include "tandem/autograd/grad_mode.h"
#include "tandem/nn/norm.h"

namespace tandem::optim {

int64_t update_bn(nn::Module& model, const std::function<Tensor()>& next_input) {
  std::vector<nn::BatchNorm*> bns;
  for (auto& [name, m] : model.named_modules()) {
    if (auto* bn = dynamic_cast<nn::BatchNorm*>(m.get()); bn != nullptr && bn->options.track_running_stats) {
      bns.push_back(bn);
    }
  }
  if (bns.empty()) return 0;
  // Restores momentum and mode however the loop ends.
  struct Restore {
    nn::Module& model;
    bool training;
    std::vector<nn::BatchNorm*>& bns;
    std::vector<std::optional<double>> momentum;
    ~Restore() {
      for (size_t i = 0; i < bns.size(); ++i) bns[i]->options.momentum = momentum[i];
      model.train(training);
    }
  } restore{model, model.is_training(), bns, {}};
  NoGradGuard no_grad;
  for (auto* bn : bns) {
    restore.momentum.push_back(bn->options.momentum);
    bn->running_mean.fill_(0.0);
    bn->running_var.fill_(1.0);
    bn->num_batches_tracked.fill_(0.0);
  }
  model.train();
  int64_t batches = 0;
  // PyTorch's momentum=None: each BatchNorm's k-th call (1-based, counted by its own
  // num_batches_tracked) enters with weight 1/k, so its running value is the plain mean over the
  // calls it saw, also when a layer runs several times per forward or not in every forward.
  for (auto* bn : bns) bn->options.momentum = std::nullopt;
  for (Tensor x = next_input(); x.defined(); x = next_input()) {
    model(x);
    ++batches;
  }
  return batches;
}

}  // namespace tandem::optim
