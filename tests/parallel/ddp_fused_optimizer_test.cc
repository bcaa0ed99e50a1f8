// DistributedDataParallel::register_fused_optimizer (torch's _register_fused_optim): the optimizer
// steps each bucket's parameters inside backward, as soon as that bucket's all-reduce completed.
// Each parameter's update reads only its own averaged gradient and state, so training this way
// must equal backward-then-step() bit for bit; the order (early buckets stepped before the last
// all-reduce is taken) is observed from inside a communication hook. Ranks are forked over shm.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/nn/models/mlp.h"
#include "tandem/ops/loss.h"
#include "tandem/optim/adam.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "parallel/ranks.h"

namespace td = tandem;
using td::Tensor;
using td::dist::ProcessGroup;
using td::parallel::DDPOptions;
using td::parallel::DistributedDataParallel;
using td::testing::bitwise_equal;
using td::testing::fail;

namespace {

void on_ranks(int n, const td::testing::RankFn& fn) {
  td::testing::on_ranks(n, fn, std::chrono::seconds(120), std::chrono::seconds(30));
}

// A small W1 (32 -> 64 -> 64 -> 10) in 1 KB buckets: each layer its own bucket, so that a
// backward has several buckets to step one after the other.
std::shared_ptr<td::nn::Module> small_mlp() {
  td::manual_seed(3);
  return td::nn::models::mlp({.in_features = 32, .hidden = {64, 64}, .num_classes = 10});
}
DDPOptions small_buckets(DDPOptions o = {}) {
  o.bucket_cap_mb = 0.001;
  o.first_bucket_mb = 0.001;
  return o;
}

// Two parameter groups (weights, biases) with their own hyperparameters, so that a bucket's
// subset step has to find each parameter's group.
std::shared_ptr<td::optim::Optimizer> make_optimizer(td::nn::Module& m, const std::string& kind) {
  std::vector<Tensor> weights, biases;
  for (const auto& [name, p] : m.named_parameters()) (name.ends_with("bias") ? biases : weights).push_back(p);
  if (kind == "sgd") {
    return std::make_shared<td::optim::SGD>(
        std::vector<td::optim::ParamGroup>{{weights, {}}, {biases, {{"lr", 0.2}, {"nesterov", 1}}}},
        td::optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
  }
  return std::make_shared<td::optim::AdamW>(
      std::vector<td::optim::ParamGroup>{{weights, {}}, {biases, {{"lr", 3e-3}, {"weight_decay", 0.0}}}},
      td::optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.05});
}

std::pair<Tensor, Tensor> batch(int step, int micro, int rank) {
  td::Generator gen(static_cast<uint64_t>(500 + 100 * step + 10 * micro + rank));
  return {td::randn({6, 32}, td::kFloat32, &gen), td::randint(0, 10, {6}, &gen)};
}

struct Trained {
  std::vector<Tensor> params, grads;  // after the last step
  td::optim::OptimizerState state;
};

// `steps` steps of `micro` micro-batches (all but the last under no_sync), with the optimizer
// fused into DDP's backward or stepped after it.
Trained train(const std::shared_ptr<ProcessGroup>& group, const DDPOptions& options, const std::string& kind,
              bool fused, int steps, int micro, bool bf16_wire = false) {
  auto model = small_mlp();
  DistributedDataParallel ddp(model, group, options);
  if (bf16_wire) ddp.register_comm_hook(td::parallel::bf16_compress_hook);
  auto opt = make_optimizer(*model, kind);
  if (fused) ddp.register_fused_optimizer(opt);
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = batch(s, k, group->rank());
      if (k + 1 < micro) {
        auto guard = ddp.no_sync();
        td::ops::cross_entropy(ddp(x), y).backward();
      } else {
        td::ops::cross_entropy(ddp(x), y).backward();
      }
    }
    if (!fused) opt->step();
  }
  Trained t;
  for (const Tensor& p : model->parameters()) {
    t.params.push_back(p.clone());
    t.grads.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  }
  t.state = opt->state_dict();
  return t;
}

void expect_bitwise_same(const Trained& a, const Trained& b, const std::string& what) {
  for (size_t i = 0; i < a.params.size(); ++i) {
    if (!bitwise_equal(a.params[i], b.params[i])) fail(what + ": parameter " + std::to_string(i) + " differs");
    if (a.grads[i].defined() != b.grads[i].defined() ||
        (a.grads[i].defined() && !bitwise_equal(a.grads[i], b.grads[i]))) {
      fail(what + ": the gradient of parameter " + std::to_string(i) + " differs");
    }
  }
  if (a.state.state.size() != b.state.state.size()) fail(what + ": optimizer states differ in size");
  for (size_t i = 0; i < a.state.state.size(); ++i) {
    if (a.state.state[i].size() != b.state.state[i].size()) fail(what + ": optimizer state keys differ");
    for (const auto& [key, t] : a.state.state[i]) {
      auto it = b.state.state[i].find(key);
      if (it == b.state.state[i].end() || !bitwise_equal(t, it->second)) {
        fail(what + ": optimizer state[" + std::to_string(i) + "]." + key + " differs");
      }
    }
  }
}

}  // namespace

// The core property, over the ways finalize hands gradients over: per bucket as they complete
// (default, bucket views, delay_allreduce, a compression hook), after the last one (find_unused,
// static_graph), and the deterministic mode; SGD (momentum, Nesterov group) and AdamW; no_sync
// micro-batches; world sizes 1 (nothing reduced), 2 and 3.
TEST(DDPFusedOptimizer, EqualsStepAfterBackwardBitForBit) {
  for (int world : {1, 2, 3}) {
    on_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      struct Case {
        std::string name;
        DDPOptions options;
        int micro;
        bool bf16_wire = false;  // bf16_compress_hook: the result is cast back inside the hook's `then`
      };
      std::vector<Case> cases;
      cases.push_back({"default", small_buckets(), 1});
      cases.push_back({"no_sync x2", small_buckets(), 2});
      DDPOptions view = small_buckets();
      view.gradient_as_bucket_view = true;
      cases.push_back({"gradient_as_bucket_view", view, 2});
      DDPOptions delay = small_buckets();
      delay.delay_allreduce = true;
      cases.push_back({"delay_allreduce", delay, 1});
      cases.push_back({"bf16_compress_hook", small_buckets(), 2, true});
      DDPOptions unused = small_buckets();
      unused.find_unused_parameters = true;
      cases.push_back({"find_unused_parameters", unused, 2});
      DDPOptions stat = small_buckets();
      stat.static_graph = true;
      cases.push_back({"static_graph", stat, 1});
      DDPOptions det = small_buckets();
      det.deterministic = true;
      cases.push_back({"deterministic", det, 2});
      for (const auto& c : cases) {
        for (const std::string kind : {"sgd", "adamw"}) {
          const std::string what = "world " + std::to_string(world) + ", " + c.name + ", " + kind;
          Trained fused = train(g, c.options, kind, true, 3, c.micro, c.bf16_wire);
          Trained after = train(g, c.options, kind, false, 3, c.micro, c.bf16_wire);
          expect_bitwise_same(fused, after, what);
        }
      }
    });
  }
}

// Overlap, observed: when the last bucket's all-reduce result is taken (its hook's `then`, on the
// backward thread), the first bucket's parameters were already updated and the last bucket's
// not yet. With find_unused_parameters nothing is stepped before every bucket completed.
TEST(DDPFusedOptimizer, StepsEarlyBucketsBeforeTheLastAllReduceIsTaken) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    for (bool find_unused : {false, true}) {
      DDPOptions o = small_buckets();
      o.find_unused_parameters = find_unused;
      auto model = small_mlp();
      DistributedDataParallel ddp(model, g, o);
      auto opt = make_optimizer(*model, "sgd");
      ddp.register_fused_optimizer(opt);
      const auto layout = ddp.reducer().bucket_indices();
      if (layout.size() < 3) fail("expected several buckets, got " + std::to_string(layout.size()));
      const Tensor first = ddp.reducer().parameter(layout.front().front());
      const Tensor last = ddp.reducer().parameter(layout.back().front());
      Tensor first_before, last_before;
      int seen = 0;
      bool first_stepped = false, last_stepped = true;
      ddp.register_comm_hook([&](ProcessGroup& pg, td::parallel::GradBucket& b) {
        td::parallel::HookResult r = td::parallel::allreduce_hook(pg, b);
        if (b.is_last) {
          r.then = [&] {
            ++seen;
            first_stepped = !bitwise_equal(first, first_before);
            last_stepped = !bitwise_equal(last, last_before);
          };
        }
        return r;
      });
      // The first synchronized backward keeps the construction-time layout (the rebuild comes at its end).
      first_before = first.clone();
      last_before = last.clone();
      opt->zero_grad();
      auto [x, y] = batch(0, 0, g->rank());
      td::ops::cross_entropy(ddp(x), y).backward();
      if (seen != 1) fail("the last bucket's hook ran " + std::to_string(seen) + " times");
      const std::string mode = find_unused ? "find_unused_parameters" : "default";
      if (find_unused ? first_stepped : !first_stepped) {
        fail(mode + ": the first bucket was " + (first_stepped ? "" : "not ") +
             "stepped when the last all-reduce was taken");
      }
      if (last_stepped) fail(mode + ": the last bucket was stepped before its all-reduce was taken");
      if (bitwise_equal(first, first_before) || bitwise_equal(last, last_before)) {
        fail(mode + ": after backward, not every bucket was stepped");
      }
    }
  });
}

// step() on a fused optimizer would update twice: refused (also through GradScaler), until the
// DDP goes. Step post hooks run once per synchronized backward; no_sync backwards do not step.
TEST(DDPFusedOptimizer, StepIsRefusedPostHooksRunOnceNoSyncDoesNotStep) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto model = small_mlp();
    auto opt = make_optimizer(*model, "sgd");
    int post_hooks = 0;
    opt->register_step_post_hook([&](td::optim::Optimizer&) { ++post_hooks; });
    {
      DistributedDataParallel ddp(model, g, small_buckets());
      ddp.register_fused_optimizer(opt);
      if (ddp.fused_optimizer() != opt) fail("fused_optimizer() is not the registered one");
      try {
        opt->step();
        fail("step() on a fused optimizer did not throw");
      } catch (const td::Error& e) {
        if (std::string(e.what()).find("register_fused_optimizer") == std::string::npos) {
          fail(std::string("step()'s error does not say why: ") + e.what());
        }
      }
      td::amp::GradScaler scaler;
      try {
        scaler.step(*opt);
        fail("GradScaler.step on a fused optimizer did not throw");
      } catch (const td::Error& e) {
        if (std::string(e.what()).find("stepped by") == std::string::npos) {
          fail(std::string("GradScaler.step's error does not say why: ") + e.what());
        }
      }
      const Tensor w = model->parameters().front();
      for (int s = 0; s < 3; ++s) {
        opt->zero_grad();
        Tensor before = w.clone();
        {
          auto guard = ddp.no_sync();
          auto [x, y] = batch(s, 0, g->rank());
          td::ops::cross_entropy(ddp(x), y).backward();
        }
        if (!bitwise_equal(w, before)) fail("a no_sync backward stepped the optimizer");
        auto [x, y] = batch(s, 1, g->rank());
        td::ops::cross_entropy(ddp(x), y).backward();
        if (bitwise_equal(w, before)) fail("a synchronized backward did not step the optimizer");
      }
      if (post_hooks != 3) fail("step post hooks ran " + std::to_string(post_hooks) + " times in 3 steps");
    }
    opt->step();  // DDP is gone: step() is the caller's again
    if (post_hooks != 4) fail("step() after the DDP went did not run");
  });
}

TEST(DDPFusedOptimizer, OptimizerMustHoldOnlyParametersDdpReduces) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto expect_value_error = [](const std::function<void()>& f, const std::string& needle, const std::string& what) {
      try {
        f();
      } catch (const td::ValueError& e) {
        if (std::string(e.what()).find(needle) == std::string::npos) {
          fail(what + ": the error does not name '" + needle + "': " + e.what());
        }
        return;
      }
      fail(what + ": no ValueError");
    };
    // An ignored parameter keeps its rank's own gradient: a fused step of it would never happen.
    {
      auto model = small_mlp();
      DDPOptions o = small_buckets();
      o.params_and_buffers_to_ignore = {"3.bias"};
      DistributedDataParallel ddp(model, g, o);
      auto opt = make_optimizer(*model, "sgd");
      expect_value_error([&] { ddp.register_fused_optimizer(opt); }, "'3.bias' (in params_and_buffers_to_ignore)",
                         "ignored parameter");
      if (!opt->stepped_by().empty()) fail("a refused registration left the optimizer taken");
    }
    // Another module's parameter (as amp O2's master copies would be).
    {
      auto model = small_mlp();
      auto other = small_mlp();
      DistributedDataParallel ddp(model, g, small_buckets());
      auto opt = make_optimizer(*other, "adamw");
      expect_value_error([&] { ddp.register_fused_optimizer(opt); }, "is not one this DDP reduces", "other module");
    }
    // A frozen parameter never has a gradient, so no step would update it either: allowed.
    {
      auto model = small_mlp();
      model->named_parameters().front().second.requires_grad_(false);
      DistributedDataParallel ddp(model, g, small_buckets());
      ddp.register_fused_optimizer(make_optimizer(*model, "sgd"));
    }
    // One optimizer per DDP, one DDP per optimizer.
    {
      auto model = small_mlp();
      DistributedDataParallel ddp(model, g, small_buckets());
      auto opt = make_optimizer(*model, "sgd");
      ddp.register_fused_optimizer(opt);
      expect_value_error([&] { ddp.register_fused_optimizer(make_optimizer(*model, "sgd")); }, "already steps",
                         "second optimizer");
      DistributedDataParallel again(model, g, small_buckets());
      expect_value_error([&] { again.register_fused_optimizer(opt); }, "already stepped by", "second DDP");
    }
  });
}
