// What DDP's equivalence checks share (ddp_test and the mpirun program ddp_mpi_main): the three
// workloads as a model, an optimizer, a global batch per step and a loss; training on a rank's
// share of each global batch; and the comparison of two models' state within a relative bound.
#pragma once

#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "tandem/data/sampler.h"
#include "tandem/dist/process_group.h"
#include "tandem/nn/models/cnn.h"
#include "tandem/nn/models/gpt.h"
#include "tandem/nn/models/mlp.h"
#include "tandem/ops/loss.h"
#include "tandem/ops/shape.h"
#include "tandem/optim/adam.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/sync_batch_norm.h"
#include "parallel/ranks.h"

namespace tandem::testing {

// Compares two models' state (parameters and buffers): the norm-wise relative difference of
// everything together must be <= `rel` (the acceptance figure), and of each tensor <= `per_tensor`.
// Throws naming the worst tensor otherwise. Integer buffers must be equal.
inline void expect_same_state(const nn::Module& a, const nn::Module& b, double rel, const std::string& what,
                              double per_tensor = 0) {
  if (per_tensor == 0) per_tensor = rel;
  auto sa = a.state_dict(), sb = b.state_dict();
  if (sa.size() != sb.size()) fail(what + ": state dicts differ in size");
  double num = 0, den = 0;
  for (size_t i = 0; i < sa.size(); ++i) {
    if (sa[i].second.dtype() == kInt64) {
      if (sa[i].second.data_ptr<int64_t>()[0] != sb[i].second.data_ptr<int64_t>()[0])
        fail(fmt::format("{}: {} differs", what, sa[i].first));
      continue;
    }
    Tensor x = sa[i].second, y = sb[i].second;
    if (sa[i].first.ends_with("attn.qkv.bias")) {
      // The key bias has an exactly zero true gradient (adding a constant vector to every key
      // shifts each row of scores by a constant, which softmax ignores), so AdamW's update of it
      // is g / sqrt(v) of pure rounding noise: +-lr per step with a random sign in any two
      // summation orders. Compare the query and value thirds, where the gradient is real.
      const int64_t d = x.numel() / 3;
      x = ops::cat({x.narrow(0, 0, d), x.narrow(0, 2 * d, d)}, 0);
      y = ops::cat({y.narrow(0, 0, d), y.narrow(0, 2 * d, d)}, 0);
    }
    const double d = rel_diff(x, y);
    Tensor x64 = x.to(kFloat64).contiguous(), y64 = y.to(kFloat64).contiguous();
    for (int64_t k = 0; k < x64.numel(); ++k) {
      const double dx = x64.data_ptr<double>()[k] - y64.data_ptr<double>()[k];
      num += dx * dx;
      den += y64.data_ptr<double>()[k] * y64.data_ptr<double>()[k];
    }
    if (std::getenv("TANDEM_TEST_VERBOSE")) fmt::print(stderr, "{}: {} rel {:.3g}\n", what, sa[i].first, d);
    if (!(d <= per_tensor))
      fail(fmt::format("{}: '{}' differs by rel {:.3g} (limit {:.1g})", what, sa[i].first, d, per_tensor));
  }
  const double total = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  if (!(total <= rel)) fail(fmt::format("{}: the state differs by rel {:.3g} overall (limit {:.1g})", what, total, rel));
}

// Rows of the global batch that rank r of n takes: r, r + n, r + 2n, ... (DistributedSampler
// without shuffling on a dataset of exactly the global batch).
inline Tensor rank_rows(const Tensor& global, int64_t rank, int64_t world) {
  data::DistributedSampler sampler(global.size(0), {.num_replicas = world, .rank = rank, .shuffle = false});
  auto idx = sampler.indices();
  return ops::index_select(global, 0, tensor(idx, {static_cast<int64_t>(idx.size())}));
}

// ---- the three workloads: a global batch per step and a loss ----

struct Workload {
  std::function<std::shared_ptr<nn::Module>()> make_model;
  std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)> make_optimizer;
  // The global batch of step s: inputs and targets.
  std::function<std::pair<Tensor, Tensor>(int step, int64_t global_batch)> batch;
  std::function<Tensor(const Tensor& out, const Tensor& target)> loss;
};

inline Workload w1_mlp() {
  return {[] { return std::static_pointer_cast<nn::Module>(nn::models::mlp()); },
          [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
            return std::make_unique<optim::SGD>(m.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
          },
          [](int step, int64_t g) {
            Generator gen(1000 + step);
            return std::make_pair(randn({g, 1, 28, 28}, kFloat32, &gen), randint(0, 10, {g}, &gen));
          },
          [](const Tensor& out, const Tensor& y) { return ops::cross_entropy(out, y); }};
}

inline Workload w2_cnn() {
  Workload w = w1_mlp();
  w.make_model = [] { return std::static_pointer_cast<nn::Module>(nn::models::cnn()); };
  w.make_optimizer = [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::AdamW>(m.parameters(), optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.01});
  };
  return w;
}

inline Workload w3_gpt() {
  return {[] { return std::static_pointer_cast<nn::Module>(nn::models::gpt()); },
          [](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
            return std::make_unique<optim::AdamW>(m.parameters(), optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.1});
          },
          [](int step, int64_t g) {
            Generator gen(2000 + step);
            Tensor tokens = randint(0, 256, {g, 129}, &gen);
            return std::make_pair(tokens.narrow(1, 0, 128).contiguous(), tokens.narrow(1, 1, 128).contiguous());
          },
          [](const Tensor& logits, const Tensor& y) {
            return ops::cross_entropy(logits.view({-1, logits.size(-1)}), y.reshape({-1}));
          }};
}

// Trains `model` for `steps` on this rank's share of each global batch (world 1: all of it).
inline void train(nn::Module& forward_module, nn::Module& params_module, const Workload& w, int steps, int64_t rank,
                  int64_t world, int64_t per_rank) {
  auto opt = w.make_optimizer(params_module);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = w.batch(s, per_rank * world);
    Tensor xs = world == 1 ? x : rank_rows(x, rank, world), ys = world == 1 ? y : rank_rows(y, rank, world);
    opt->zero_grad();
    Tensor loss = w.loss(forward_module.forward(xs), ys);
    loss.backward();
    opt->step();
  }
}

// This rank's half of the equivalence: DDP over `group` (SyncBatchNorm over it when `sync_bn`)
// trained `steps` steps with `per_rank` samples per rank, against one process trained in this rank
// on the global batch; throws naming the worst tensor when they differ by more than `rel`.
inline void expect_ddp_equals_global_batch(const std::shared_ptr<dist::ProcessGroup>& group, const Workload& w,
                                           int64_t per_rank, int steps, double rel, bool sync_bn, double per_tensor = 0) {
  const int world = group->size();
  manual_seed(0);
  auto model = w.make_model();
  if (sync_bn) parallel::convert_sync_batchnorm(*model, group);
  parallel::DistributedDataParallel ddp(model, group);
  train(ddp, *model, w, steps, group->rank(), world, per_rank);

  manual_seed(0);
  auto reference = w.make_model();
  train(*reference, *reference, w, steps, 0, 1, per_rank * world);
  expect_same_state(*model, *reference, rel, fmt::format("rank {} of {}", group->rank(), world), per_tensor);
}

}  // namespace tandem::testing
