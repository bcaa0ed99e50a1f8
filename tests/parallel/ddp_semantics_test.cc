// DDP and SyncBatchNorm corner cases against PyTorch's semantics (issue #7's review): gradient
// accumulation under no_sync with parameters used in some micro-batches only, frozen and tied
// parameters, the bucket rebuild, backward/forward call patterns, and SyncBatchNorm's options.
// Every case compares with a single-process reference computed in the same rank; ranks are forked
// over shm (dist::spawn) with a whole-test deadline.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "tandem/autograd/grad_mode.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/spawn.h"
#include "tandem/nn/layers.h"
#include "tandem/nn/norm.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/reduce.h"
#include "tandem/ops/shape.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/sync_batch_norm.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::dist::ProcessGroup;
using td::parallel::DDPOptions;
using td::parallel::DistributedDataParallel;

namespace {

// The whole run has a 60 s deadline (each case takes well under a second), every collective a
// 20 s timeout.
void on_ranks(int n, const td::testing::RankFn& fn) {
  td::testing::on_ranks(n, fn, std::chrono::seconds(60), std::chrono::seconds(20));
}
using td::testing::fail;

// f32 sums of a handful of products in two orders (ranks, micro-batches): a few ulps.
constexpr double kRtol = 1e-5, kAtol = 1e-6;

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  auto r = td::testing::all_close(got, want, kRtol, kAtol);
  if (!r) fail(what + ": " + r.message());
}

// A gradient as values: an undefined one reads as zeros of the parameter's shape.
Tensor grad_or_zeros(const Tensor& p) { return p.grad().defined() ? p.grad() : td::zeros(p.shape()); }

// w1 -> frozen (requires_grad=false) -> w2 -> tanh -> w1 again (tied: the same tensor in a child
// module), plus `extra` (a bias) only when asked. Registration order: w1, frozen, w2, extra,
// tied.w (deduplicated to w1).
struct Probe : td::nn::Module {
  Probe() : Module("Probe") {
    td::Generator gen(7);
    w1 = register_parameter("w1", td::ops::mul(td::randn({4, 4}, td::kFloat32, &gen), 0.5));
    frozen = register_parameter("frozen", td::ops::mul(td::randn({4, 4}, td::kFloat32, &gen), 0.5), false);
    w2 = register_parameter("w2", td::ops::mul(td::randn({4, 4}, td::kFloat32, &gen), 0.5));
    extra = register_parameter("extra", td::randn({4}, td::kFloat32, &gen));
    tied = std::make_shared<td::nn::Module>("Tied");
    tied->register_parameter("w", w1);
    register_module("tied", tied);
  }
  Tensor run(const Tensor& x, bool use_extra) {
    Tensor h = td::ops::linear(x, w1);
    h = td::ops::linear(h, frozen);
    h = td::ops::tanh(td::ops::linear(h, w2));
    h = td::ops::matmul(h, w1);  // the tied second use
    return use_extra ? td::ops::add(h, extra) : h;
  }
  Tensor w1, frozen, w2, extra;
  std::shared_ptr<td::nn::Module> tied;
};

Tensor probe_input(int step, int rank, int micro) {
  td::Generator gen(static_cast<uint64_t>(1000 + 100 * step + 10 * rank + micro));
  return td::randn({3, 4}, td::kFloat32, &gen);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Gradient accumulation: k micro-batches, the first k-1 under no_sync, then one synchronized
// backward. The optimizer must see (sum over ranks and micro-batches) / world — also for a
// parameter used in some micro-batches only (find_unused_parameters), with bucket views, and with
// zero_grad keeping the gradients (set_to_none=false). A parameter no rank used in the whole step
// keeps no gradient (set_to_none) as in PyTorch.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, NoSyncAccumulationAveragesTheSumForEveryOptionAndUsePattern) {
  // World size 1 too: there the reducer skips the collective but bucket views still alias slots.
  for (int n : {1, 2}) on_ranks(n, [&](std::shared_ptr<ProcessGroup> group) {
    const int world = group->size(), rank = group->rank(), k = 3, steps = 4;
    // Whether rank r uses `extra` in micro-batch i of step s (the last micro-batch is the synced
    // one). Step 0: r0 in a no_sync micro-batch only, r1 in the synced one; step 1: r0 synced,
    // r1 no_sync; step 2: both in no_sync micro-batches only (unused in the synced pass on every
    // rank); step 3: nobody.
    auto uses_extra = [&](int s, int r, int i) {
      if (s == 3) return false;
      if (s == 2) return i == r;
      return (i + r + s) % 3 == 0;
    };
    struct Case {
      DDPOptions o;
      bool set_to_none;
      bool partial_use;
    };
    std::vector<Case> cases;
    for (bool view : {false, true}) {
      for (bool none : {true, false}) {
        cases.push_back({DDPOptions{.find_unused_parameters = true, .gradient_as_bucket_view = view}, none, true});
        cases.push_back({DDPOptions{.find_unused_parameters = false, .gradient_as_bucket_view = view}, none, false});
      }
    }
    for (const Case& c : cases) {
      const std::string what = fmt::format("find_unused={} bucket_view={} set_to_none={}", c.o.find_unused_parameters,
                                           c.o.gradient_as_bucket_view, c.set_to_none);
      auto model = std::make_shared<Probe>();
      DistributedDataParallel ddp(model, group, c.o);
      td::optim::SGD opt(model->parameters(), {.lr = 0.1});
      auto reference = std::make_shared<Probe>();
      td::optim::SGD ref_opt(reference->parameters(), {.lr = 0.1});
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad(c.set_to_none);
        ref_opt.zero_grad(c.set_to_none);
        for (int i = 0; i < k; ++i) {
          const bool extra = c.partial_use ? uses_extra(s, rank, i) : true;
          Tensor x = probe_input(s, rank, i);
          auto loss = [&] { return td::ops::mul(td::ops::sum(ddp.forward_with([&] { return model->run(x, extra); })), 1.0 / k); };
          if (i + 1 < k) {
            auto guard = ddp.no_sync();
            loss().backward();
          } else {
            loss().backward();
          }
          // The reference: every rank's micro-batch i, scaled by 1 / world.
          for (int r = 0; r < world; ++r) {
            const bool e = c.partial_use ? uses_extra(s, r, i) : true;
            td::ops::mul(td::ops::sum(reference->run(probe_input(s, r, i), e)), 1.0 / (k * world)).backward();
          }
        }
        auto got = model->named_parameters(), want = reference->named_parameters();
        for (size_t p = 0; p < got.size(); ++p) {
          const std::string at = fmt::format("{}: step {} rank {} grad of '{}'", what, s, rank, got[p].first);
          if (!got[p].second.requires_grad()) continue;
          if (c.set_to_none && got[p].second.grad().defined() != want[p].second.grad().defined())
            fail(at + (want[p].second.grad().defined() ? " is missing" : " should be undefined (unused on every rank)"));
          expect_close(grad_or_zeros(got[p].second), grad_or_zeros(want[p].second), at);
        }
        opt.step();
        ref_opt.step();
      }
      auto got = model->named_parameters(), want = reference->named_parameters();
      for (size_t p = 0; p < got.size(); ++p) expect_close(got[p].second, want[p].second, what + " weights " + got[p].first);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// static_graph (PyTorch: "the set of used and unused parameters will not change during the whole
// training loop"; then find_unused_parameters is not needed): the first synchronized iteration
// finds the unused parameters, later ones take that set without searching the graph. A parameter
// unused on some ranks (always the same ones) or on every rank trains as with
// find_unused_parameters, across no_sync accumulation; a parameter that was unused at first and is
// used later, or the other way round, is an error that names it and says to use
// find_unused_parameters.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, StaticGraphTakesTheFirstIterationsUnusedParametersAndRejectsAChange) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int world = group->size(), rank = group->rank(), k = 2, steps = 3;
    // `extra`: used by rank 0 only, or by no rank; gradients copied out of the buckets or bucket views.
    for (bool rank0_uses : {true, false}) for (bool view : {false, true}) {
      auto uses = [&](int r) { return rank0_uses && r == 0; };
      const std::string what = fmt::format("{}, gradient_as_bucket_view={}",
                                           rank0_uses ? "extra used on rank 0 only" : "extra unused everywhere", view);
      auto model = std::make_shared<Probe>();
      DistributedDataParallel ddp(model, group, DDPOptions{.gradient_as_bucket_view = view, .static_graph = true});
      td::optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
      auto reference = std::make_shared<Probe>();
      td::optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        ref_opt.zero_grad();
        for (int i = 0; i < k; ++i) {
          Tensor x = probe_input(s, rank, i);
          auto loss = [&] { return td::ops::mul(td::ops::sum(ddp.forward_with([&] { return model->run(x, uses(rank)); })), 1.0 / k); };
          if (i + 1 < k) {
            auto guard = ddp.no_sync();
            loss().backward();
          } else {
            loss().backward();
          }
          for (int r = 0; r < world; ++r)
            td::ops::mul(td::ops::sum(reference->run(probe_input(s, r, i), uses(r))), 1.0 / (k * world)).backward();
        }
        if (model->extra.grad().defined() != rank0_uses)
          fail(fmt::format("{}: step {}: extra's gradient is {}defined", what, s, rank0_uses ? "un" : ""));
        auto got = model->named_parameters(), want = reference->named_parameters();
        for (size_t p = 0; p < got.size(); ++p) {
          if (!got[p].second.requires_grad()) continue;
          expect_close(grad_or_zeros(got[p].second), grad_or_zeros(want[p].second),
                       fmt::format("{}: step {} rank {} grad of '{}'", what, s, rank, got[p].first));
        }
        opt.step();
        ref_opt.step();
      }
    }
    // The graph changes on both ranks: extra unused in the first iteration and used later, or the
    // other way round.
    for (bool used_first : {false, true}) {
      auto model = std::make_shared<Probe>();
      DistributedDataParallel ddp(model, group, DDPOptions{.static_graph = true});
      td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(0, rank, 0), used_first); })).backward();
      model->zero_grad();
      const std::string what = used_first ? "extra used, then not" : "extra unused, then used";
      try {
        td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(1, rank, 0), !used_first); })).backward();
        fail(what + ": a change of the used parameters should be an error under static_graph");
      } catch (const td::AutogradError& e) {
        const std::string msg = e.what();
        for (const char* needle : {"static_graph=true", "extra", "must not change", "find_unused_parameters=true"}) {
          if (msg.find(needle) == std::string::npos) fail(fmt::format("{}: the error lacks \"{}\": {}", what, needle, msg));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// A loss that uses more than the tensor forward returns (torch: tuple outputs, a loss term on a
// parameter outside forward). find_unused_parameters searches the graph from every output of the
// std::vector overload of forward_with; static_graph needs no search (its first iteration counts
// the gradients that arrived), so it also takes a head reached through a captured tensor and a
// parameter used outside forward. Both: gradients equal the global-batch reference, the head no
// output reaches keeps no gradient, for 3 steps with momentum.
// ---------------------------------------------------------------------------------------------

namespace {
struct TwoHeads : td::nn::Module {
  TwoHeads() : Module("TwoHeads") {
    td::Generator gen(17);
    trunk = register_parameter("trunk", td::ops::mul(td::randn({5, 4}, td::kFloat32, &gen), 0.5));
    a = register_parameter("a", td::ops::mul(td::randn({2, 5}, td::kFloat32, &gen), 0.5));
    b = register_parameter("b", td::ops::mul(td::randn({3, 5}, td::kFloat32, &gen), 0.5));
    never = register_parameter("never", td::ops::mul(td::randn({3, 5}, td::kFloat32, &gen), 0.5));
    outside = register_parameter("outside", td::randn({4}, td::kFloat32, &gen));
  }
  std::vector<Tensor> run(const Tensor& x) {
    Tensor h = td::ops::tanh(td::ops::linear(x, trunk));
    return {td::ops::linear(h, a), td::ops::linear(h, b)};
  }
  Tensor trunk, a, b, never, outside;
};
// The loss of both heads, plus (with_outside) a term on `outside`, which no forward uses.
Tensor two_heads_loss(const std::vector<Tensor>& y, const Tensor& outside, bool with_outside, double scale) {
  Tensor l = td::ops::add(td::ops::sum(td::ops::mul(y[0], y[0])), td::ops::sum(y[1]));
  if (with_outside) l = td::ops::add(l, td::ops::sum(td::ops::mul(outside, outside)));
  return td::ops::mul(l, scale);
}
}  // namespace

TEST(DDPSemantics, ALossBeyondTheReturnedTensorWorksWithFindUnusedOverEveryOutputAndWithStaticGraph) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int world = group->size(), rank = group->rank();
    for (const bool static_graph : {false, true}) {
      const std::string what = static_graph ? "static_graph (head b captured, outside used)" : "find_unused_parameters (both heads returned)";
      auto model = std::make_shared<TwoHeads>();
      DistributedDataParallel ddp(model, group,
                                  DDPOptions{.find_unused_parameters = !static_graph, .static_graph = static_graph});
      td::optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
      auto reference = std::make_shared<TwoHeads>();
      td::optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        ref_opt.zero_grad();
        std::vector<Tensor> y;
        if (static_graph) {
          // forward returns head a only; head b's output reaches the loss through a capture.
          Tensor yb;
          Tensor ya = ddp.forward_with([&] {
            auto both = model->run(probe_input(s, rank, 0));
            yb = both[1];
            return both[0];
          });
          y = {ya, yb};
        } else {
          y = ddp.forward_with([&] { return model->run(probe_input(s, rank, 0)); });
        }
        two_heads_loss(y, model->outside, static_graph, 1.0).backward();
        for (int r = 0; r < world; ++r) {
          two_heads_loss(reference->run(probe_input(s, r, 0)), reference->outside, static_graph, 1.0 / world).backward();
        }
        if (model->never.grad().defined()) fail(fmt::format("{}: step {}: 'never' got a gradient", what, s));
        auto got = model->named_parameters(), want = reference->named_parameters();
        for (size_t p = 0; p < got.size(); ++p) {
          if (got[p].first == "never") continue;
          if (got[p].first == "outside" && !static_graph) continue;
          expect_close(grad_or_zeros(got[p].second), grad_or_zeros(want[p].second),
                       fmt::format("{}: step {} rank {} grad of '{}'", what, s, rank, got[p].first));
        }
        opt.step();
        ref_opt.step();
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Error paths leave nothing behind. A backward that throws half-way (here a communication hook at
// the second bucket, on every rank) ends DDP's iteration with it: a later backward that no DDP
// forward armed (the wrapped module called directly) is not taken for part of it, and the next
// DDP iteration averages as usual. A fused optimizer that throws on one rank only, in the first
// iteration (whose end rebuilds the buckets, a collective), leaves that rank in step with the
// others: the next iteration goes through and averages.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, ABackwardThatThrowsLeavesNothingBehindAndAFailingFusedStepKeepsTheRanksInStep) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int world = group->size(), rank = group->rank();
    auto loss_on = [](const Tensor& y) { return td::ops::sum(td::ops::mul(y, y)); };
    // The gradients of one averaged step from the start values (grads of `reference` cleared first).
    auto averaged = [&](int s) {
      auto reference = std::make_shared<TwoHeads>();
      for (int r = 0; r < world; ++r) {
        auto y = reference->run(probe_input(s, r, 0));
        td::ops::mul(td::ops::add(loss_on(y[0]), loss_on(y[1])), 1.0 / world).backward();
      }
      return reference;
    };
    auto expect_averaged = [&](const TwoHeads& got, int s, const std::string& what) {
      auto want = averaged(s);
      for (const char* name : {"trunk", "a", "b"}) {
        expect_close(td::testing::find_tensor(got.state_dict(), name).grad(),
                     td::testing::find_tensor(want->state_dict(), name).grad(), what + ": grad of " + name);
      }
    };
    {
      auto model = std::make_shared<TwoHeads>();
      DistributedDataParallel ddp(model, group, DDPOptions{.bucket_cap_mb = 1e-5, .first_bucket_mb = 1e-5,
                                                           .params_and_buffers_to_ignore = {"never", "outside"}});
      bool fail_next = true;
      ddp.register_comm_hook([&](ProcessGroup& g, td::parallel::GradBucket& b) {
        if (b.index == 1 && fail_next) throw td::ValueError("test hook: bucket 1 fails");
        return td::parallel::allreduce_hook(g, b);
      });
      try {
        auto y = ddp.forward_with([&] { return model->run(probe_input(0, rank, 0)); });
        td::ops::add(loss_on(y[0]), loss_on(y[1])).backward();
        fail("the hook's error did not leave backward");
      } catch (const td::ValueError& e) {
        if (std::string(e.what()).find("bucket 1 fails") == std::string::npos) fail(std::string("another error: ") + e.what());
      }
      fail_next = false;
      // Not through DDP: a local backward, no collective, no complaint about gradients twice.
      auto y = model->run(probe_input(0, rank, 0));
      td::ops::add(loss_on(y[0]), loss_on(y[1])).backward();
      model->zero_grad();
      auto y2 = ddp.forward_with([&] { return model->run(probe_input(1, rank, 0)); });
      td::ops::add(loss_on(y2[0]), loss_on(y2[1])).backward();
      expect_averaged(*model, 1, "the DDP iteration after a failed backward");
    }
    {
      auto model = std::make_shared<TwoHeads>();
      DistributedDataParallel ddp(model, group, DDPOptions{.find_unused_parameters = true});
      auto opt = std::make_shared<td::optim::SGD>(model->parameters(), td::optim::SGDOptions{.lr = 0.0});
      bool fail_once = rank == 1;
      opt->register_step_post_hook([&](td::optim::Optimizer&) {
        if (fail_once) {
          fail_once = false;
          throw td::ValueError("test: rank 1's step fails");
        }
      });
      ddp.register_fused_optimizer(opt);
      for (int s = 0; s < 2; ++s) {
        opt->zero_grad();
        try {
          auto y = ddp.forward_with([&] { return model->run(probe_input(s, rank, 0)); });
          td::ops::add(loss_on(y[0]), loss_on(y[1])).backward();
          if (s == 0 && rank == 1) fail("rank 1's failing step did not throw");
        } catch (const td::ValueError& e) {
          if (s != 0 || rank != 1) fail(fmt::format("rank {} step {}: {}", rank, s, e.what()));
        }
      }
      expect_averaged(*model, 1, "the iteration after one rank's fused step failed");  // lr 0: start values
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The deterministic mode and a parameter no micro-batch of any rank used: with
// find_unused_parameters it keeps no gradient (not zeros, which momentum would act on), as the
// overlapped path leaves it; one rank's use gives it the average; without the option every rank
// gets an error naming it.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, DeterministicModeLeavesAParameterNoRankUsedWithoutGradient) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto step = [&](DistributedDataParallel& ddp, Probe& model, auto uses) {
      for (int i = 0; i < 2; ++i) {
        auto loss = [&] { return td::ops::sum(ddp.forward_with([&] { return model.run(probe_input(0, rank, i), uses(i)); })); };
        if (i == 0) {
          auto guard = ddp.no_sync();
          loss().backward();
        } else {
          loss().backward();
        }
      }
    };
    {
      auto model = std::make_shared<Probe>();
      DistributedDataParallel ddp(model, group, DDPOptions{.find_unused_parameters = true, .deterministic = true});
      step(ddp, *model, [](int) { return false; });
      if (model->extra.grad().defined()) fail("extra, unused everywhere, got a gradient");
      if (!model->w2.grad().defined()) fail("w2 got no gradient");
      model->zero_grad();
      step(ddp, *model, [&](int i) { return rank == 0 && i == 1; });
      if (!model->extra.grad().defined()) fail("extra, used in one micro-batch of rank 0, got no gradient");
      if (!td::testing::same_everywhere(*group, model->extra.grad())) fail("extra's gradient differs across ranks");
    }
    {
      auto model = std::make_shared<Probe>();
      DistributedDataParallel ddp(model, group, DDPOptions{.deterministic = true});
      try {
        step(ddp, *model, [](int) { return false; });
        fail("a parameter no rank used should be an error without find_unused_parameters");
      } catch (const td::AutogradError& e) {
        const std::string msg = e.what();
        for (const char* needle : {": extra", "on any rank", "find_unused_parameters=true"}) {
          if (msg.find(needle) == std::string::npos) fail(fmt::format("the error lacks \"{}\": {}", needle, msg));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Frozen and tied parameters: the frozen one is not in any bucket and keeps no gradient; the tied
// one is in one bucket once, its gradient (from both uses) reduced once.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, FrozenParameterIsSkippedAndTiedParameterIsReducedOnce) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Probe>();
    DistributedDataParallel ddp(model, group);
    int64_t slots = 0;
    for (const auto& b : ddp.reducer().bucket_indices()) slots += static_cast<int64_t>(b.size());
    if (slots != 3) fail(fmt::format("buckets hold {} parameters, want 3 (w1, w2, extra)", slots));
    int calls = 0;
    ddp.register_comm_hook([&calls](ProcessGroup& g, td::parallel::GradBucket& b) {
      calls += static_cast<int>(b.parameter_names.size());
      return td::parallel::allreduce_hook(g, b);
    });
    auto reference = std::make_shared<Probe>();
    for (int s = 0; s < 2; ++s) {
      model->zero_grad();
      reference->zero_grad();
      calls = 0;
      td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(s, rank, 0), true); })).backward();
      for (int r = 0; r < 2; ++r) td::ops::mul(td::ops::sum(reference->run(probe_input(s, r, 0), true)), 0.5).backward();
      if (calls != 3) fail(fmt::format("step {}: the hook reduced {} parameter slots, want 3", s, calls));
      if (model->frozen.grad().defined()) fail("the frozen parameter got a gradient");
      expect_close(model->w1.grad(), reference->w1.grad(), fmt::format("step {}: tied w1", s));
      expect_close(model->w2.grad(), reference->w2.grad(), fmt::format("step {}: w2", s));
      expect_close(model->extra.grad(), reference->extra.grad(), fmt::format("step {}: extra", s));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Bucket rebuild: layers run in the reverse of their registration order, so gradients become
// ready in registration order — the opposite of the initial buckets. After the first iteration the
// buckets follow the ready order, and training goes on equal to the single-process reference.
// Also after a first synchronized iteration that failed (unused parameter), which must not leave
// its partial ready order behind.
// ---------------------------------------------------------------------------------------------

namespace {
struct Reversed : td::nn::Module {
  Reversed() : Module("Reversed") {
    td::manual_seed(3);
    for (int i = 0; i < 3; ++i) layers.push_back(register_module(fmt::format("l{}", i), std::make_shared<td::nn::Linear>(4, 4)));
  }
  Tensor run(const Tensor& x, bool skip_first) {
    Tensor h = x;
    for (int i = 2; i >= (skip_first ? 1 : 0); --i) h = td::ops::tanh(layers[static_cast<size_t>(i)]->forward(h));
    return h;
  }
  std::vector<std::shared_ptr<td::nn::Linear>> layers;
};
}  // namespace

TEST(DDPSemantics, RebuiltBucketsFollowTheReadyOrderAndTrainingStaysEqual) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    for (bool fail_first : {false, true}) {
      const std::string what = fail_first ? "after a failed first iteration" : "plain";
      auto model = std::make_shared<Reversed>();
      // Tiny caps: one parameter per bucket, so the bucket order is the parameter order.
      DistributedDataParallel ddp(model, group, DDPOptions{.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6});
      td::optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
      auto reference = std::make_shared<Reversed>();
      td::optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
      if (fail_first) {
        bool threw = false;
        try {
          td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(9, rank, 0), true); })).backward();
        } catch (const td::Error& e) {
          threw = std::string(e.what()).find("l0.weight") != std::string::npos;
        }
        if (!threw) fail("an unused l0 without find_unused_parameters should be an error naming it");
        model->zero_grad();
      }
      const auto initial = ddp.reducer().bucket_indices();
      for (int s = 0; s < 4; ++s) {
        opt.zero_grad();
        ref_opt.zero_grad();
        td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(s, rank, 0), false); })).backward();
        for (int r = 0; r < 2; ++r) td::ops::mul(td::ops::sum(reference->run(probe_input(s, r, 0), false)), 0.5).backward();
        opt.step();
        ref_opt.step();
        auto got = model->named_parameters(), want = reference->named_parameters();
        for (size_t p = 0; p < got.size(); ++p)
          expect_close(got[p].second, want[p].second, fmt::format("{}: step {} '{}'", what, s, got[p].first));
      }
      // Initially reverse registration (l2 first); rebuilt: l0's parameters (ready first) first,
      // every parameter exactly once.
      const auto rebuilt = ddp.reducer().bucket_indices();
      std::vector<int64_t> order, seen(6, 0);
      for (const auto& b : rebuilt) {
        for (int64_t p : b) {
          order.push_back(p);
          if (p < 0 || p >= 6 || seen[static_cast<size_t>(p)]++) fail(fmt::format("{}: parameter {} in two buckets", what, p));
        }
      }
      if (order.size() != 6) fail(fmt::format("{}: {} bucket slots for 6 parameters", what, order.size()));
      if (initial.front().front() != 5) fail(what + ": the initial first bucket should hold l2.bias");
      if (!ddp.reducer().buckets_rebuilt() || order[0] > 1 || order[1] > 1 || order[4] < 4 || order[5] < 4)
        fail(fmt::format("{}: rebuilt order {} does not follow the ready order (l0, l1, l2)", what, fmt::join(order, " ")));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Call patterns (PyTorch 1.13 behaviour, checked with its DDP over gloo): two forwards then one
// backward of both outputs reduces once (the sum of both uses); a second backward through the
// same graph (retain_graph) is not reduced — PyTorch 1.13 silently keeps it local, and so do we;
// an output that depends on no parameter leaves the gradients untouched and the next iteration
// works. None of them hangs.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, ForwardTwiceBackwardTwiceAndParameterFreeOutputsBehaveAsInPyTorch) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const double r1 = group->rank() + 1.0;
    for (bool find_unused : {false, true}) {
      auto model = std::make_shared<td::nn::Linear>(3, 2);
      DistributedDataParallel ddp(model, group, DDPOptions{.find_unused_parameters = find_unused});
      Tensor x = td::full({2, 3}, r1);
      // Forward twice, one backward: d/dW of sum over both = 2 * 2 rows * x: rank 0 4, rank 1 8 -> 6.
      Tensor y1 = td::ops::sum(ddp(x)), y2 = td::ops::sum(ddp(x));
      td::ops::add(y1, y2).backward();
      expect_close(model->weight.grad(), td::full({2, 3}, 6.0), "forward twice");
      // Backward twice: the first reduces (2 rows * x averaged: 3), the second accumulates locally.
      model->zero_grad();
      Tensor y = td::ops::sum(ddp(x));
      y.backward(Tensor(), /*retain_graph=*/true);
      expect_close(model->weight.grad(), td::full({2, 3}, 3.0), "first backward");
      y.backward();
      expect_close(model->weight.grad(), td::full({2, 3}, 3.0 + 2.0 * r1), "second backward (local, as PyTorch)");
      // An output that depends on no parameter: nothing to reduce, gradients untouched.
      model->zero_grad();
      Tensor xx = td::full({2, 3}, r1).requires_grad_();
      Tensor out;
      {
        td::NoGradGuard no_grad;
        out = ddp(x);
      }
      td::ops::add(td::ops::sum(out), td::ops::sum(xx)).backward();
      if (model->weight.grad().defined()) fail("a parameter-free output gave a parameter gradient");
      td::ops::sum(ddp(x)).backward();
      expect_close(model->weight.grad(), td::full({2, 3}, 3.0), "the iteration after a parameter-free output");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// SyncBatchNorm's options against BatchNorm on the concatenated batch.
// ---------------------------------------------------------------------------------------------

namespace {
// One training forward+backward of SyncBatchNorm on rank-sized slices vs BatchNorm on the whole
// batch, then an eval forward; compares outputs, input gradients, summed parameter gradients and
// running stats.
void sync_bn_case(std::shared_ptr<ProcessGroup> group, const std::vector<int64_t>& sizes, td::nn::BatchNormOptions o,
                  int64_t dims, const std::string& what) {
  const int rank = group->rank();
  int64_t total = 0, start = 0;
  for (size_t r = 0; r < sizes.size(); ++r) {
    if (static_cast<int>(r) < rank) start += sizes[r];
    total += sizes[r];
  }
  const int64_t n = sizes[static_cast<size_t>(rank)], C = 3;
  // (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W): one SyncBatchNorm takes every one (torch's).
  td::Shape shape{total, C};
  for (int64_t d = 2; d < dims; ++d) shape.push_back(d == 2 ? 2 : 3 - (d == 4));
  const int64_t spatial = td::shape_numel(shape) / std::max<int64_t>(1, total * C);
  td::Generator gen(11);
  Tensor x = td::ops::add(td::ops::mul(td::randn(shape, td::kFloat32, &gen), 2.0), 0.5);
  Tensor gy = td::randn(shape, td::kFloat32, &gen);
  auto make = [&](bool sync) -> std::shared_ptr<td::nn::BatchNorm> {
    if (sync) return std::make_shared<td::parallel::SyncBatchNorm>(C, group, o);
    if (dims <= 3) return std::make_shared<td::nn::BatchNorm1d>(C, o);
    if (dims == 4) return std::make_shared<td::nn::BatchNorm2d>(C, o);
    return std::make_shared<td::nn::BatchNorm3d>(C, o);
  };
  auto sync = make(true), bn = make(false);
  for (int it = 0; it < 2; ++it) {  // two iterations: the running stats' second update too
    Tensor xr = x.narrow(0, start, n).contiguous().requires_grad_();
    Tensor y = sync->forward(xr);
    td::ops::sum(td::ops::mul(y, gy.narrow(0, start, n).contiguous())).backward();
    Tensor xg = x.clone().requires_grad_();
    Tensor yg = bn->forward(xg);
    td::ops::sum(td::ops::mul(yg, gy)).backward();
    const std::string at = fmt::format("{} (iteration {})", what, it);
    expect_close(y, yg.narrow(0, start, n), at + ": forward");
    expect_close(xr.grad(), xg.grad().narrow(0, start, n), at + ": input gradient");
    if (o.affine) {
      Tensor gw = sync->weight.grad().clone(), gb = sync->bias.grad().clone();
      group->all_reduce(gw)->wait();
      group->all_reduce(gb)->wait();
      expect_close(gw, bn->weight.grad(), at + ": weight gradient");
      expect_close(gb, bn->bias.grad(), at + ": bias gradient");
      sync->zero_grad();
      bn->zero_grad();
    }
    if (o.track_running_stats) {
      expect_close(sync->running_mean, bn->running_mean, at + ": running_mean");
      expect_close(sync->running_var, bn->running_var, at + ": running_var");
      if (sync->num_batches_tracked.data_ptr<int64_t>()[0] != it + 1) fail(at + ": num_batches_tracked");
      if (!o.momentum) {
        // Cumulative average of identical batches: the batch's own mean and unbiased variance
        // (a momentum of 0.1 would give 0.1 and 0.19 of the mean).
        std::vector<int64_t> over{0};
        for (int64_t d = 2; d < dims; ++d) over.push_back(d);
        Tensor mean = td::ops::mean(x, over, true);
        Tensor d = td::ops::sub(x, mean);
        Tensor var = td::ops::div(td::ops::sum(td::ops::mul(d, d), over), static_cast<double>(x.numel() / C - 1));
        expect_close(sync->running_mean, td::ops::mean(x, over), at + ": cumulative running_mean");
        expect_close(sync->running_var, var, at + ": cumulative running_var");
      }
    }
  }
  // Eval: running stats when tracked, else this rank's own batch statistics (PyTorch: no sync).
  sync->eval();
  bn->eval();
  Tensor xr = x.narrow(0, start, n).contiguous();
  Tensor want = o.track_running_stats ? bn->forward(x).narrow(0, start, n) : bn->forward(xr);
  if (!o.track_running_stats && n * spatial < 2) return;  // one value per channel: undefined
  expect_close(sync->forward(xr), want, what + ": eval forward");
}
}  // namespace

TEST(DDPSemantics, SyncBatchNormOptionsMatchBatchNormOnTheGlobalBatch) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    sync_bn_case(group, {1, 4}, {}, 2, "rank 0 has one sample (N, C)");
    sync_bn_case(group, {1, 3}, {}, 4, "rank 0 has one sample (N, C, H, W)");
    sync_bn_case(group, {0, 5}, {}, 4, "rank 0 has an empty batch");
    sync_bn_case(group, {2, 5}, {.affine = false}, 4, "affine=false");
    sync_bn_case(group, {2, 5}, {.track_running_stats = false}, 4, "track_running_stats=false");
    sync_bn_case(group, {3, 2}, {.momentum = 0.5}, 2, "momentum 0.5");
    sync_bn_case(group, {3, 2}, {.momentum = std::nullopt}, 4, "momentum=None (cumulative average)");
    sync_bn_case(group, {1, 2}, {.momentum = std::nullopt}, 2, "momentum=None, rank 0 has one sample");
    sync_bn_case(group, {2, 3}, {}, 3, "(N, C, L)");
    sync_bn_case(group, {1, 2}, {.momentum = std::nullopt}, 5, "(N, C, D, H, W), momentum=None");
  });
}

TEST(DDPSemantics, SyncBatchNormWithOneValuePerChannelOverTheGroupIsAnError) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    auto sync = std::make_shared<td::parallel::SyncBatchNorm>(3, group, td::nn::BatchNormOptions{}, 2);
    Tensor x = td::ones({group->rank() == 0 ? 1 : 0, 3});
    try {
      sync->forward(x);
    } catch (const td::ValueError& e) {
      if (std::string(e.what()).find("more than 1 value per channel") != std::string::npos) return;
      throw;
    }
    fail("one value per channel over the whole group should be an error");
  });
}

TEST(DDPSemantics, ConvertSyncBatchNormKeepsValuesAndTrainingFlag) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    auto net = std::make_shared<td::nn::Sequential>();
    auto bn1 = std::make_shared<td::nn::BatchNorm1d>(3);
    auto bn2 = std::make_shared<td::nn::BatchNorm1d>(3);
    net->push_back(bn1);
    net->push_back(bn2);
    {
      td::NoGradGuard no_grad;
      bn1->weight.fill_(2.0);
      bn1->running_mean.fill_(0.25);
      bn1->running_var.fill_(4.0);
      bn1->num_batches_tracked.data_ptr<int64_t>()[0] = 7;
    }
    bn2->eval();
    const auto before = net->state_dict();
    if (td::parallel::convert_sync_batchnorm(*net, group) != 2) fail("expected 2 converted layers");
    const auto after = net->state_dict();
    for (size_t i = 0; i < before.size(); ++i) {
      if (after[i].second.data_ptr() != before[i].second.data_ptr()) fail("'" + before[i].first + "' was replaced");
    }
    if (!bn1->is_training() || bn2->is_training()) fail("the training flags changed");
    // The eval layer normalizes with its running stats (no collective: rank 1 does not call it).
    if (group->rank() == 0) {
      Tensor y = bn2->forward(td::full({2, 3}, 3.0));
      expect_close(y, td::full({2, 3}, 3.0 / std::sqrt(1.0 + 1e-5)), "eval after convert");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Eval mode (PyTorch 1.13, checked over gloo): a backward through DDP's output reduces the
// gradients whatever the module's training flag (fine-tuning with frozen BatchNorm statistics
// runs in eval mode), and the first forward after a synchronized one broadcasts rank 0's buffers,
// so every rank evaluates with the same running statistics.
// ---------------------------------------------------------------------------------------------

TEST(DDPSemantics, EvalModeReducesGradientsAndUsesRankZerosBuffers) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto make = [] {
      td::manual_seed(5);
      auto net = std::make_shared<td::nn::Sequential>();
      net->push_back(std::make_shared<td::nn::Linear>(3, 2));
      net->push_back(std::make_shared<td::nn::BatchNorm1d>(2));
      return net;
    };
    auto model = make();
    DistributedDataParallel ddp(model, group);
    auto input = [](int r) {
      td::Generator gen(static_cast<uint64_t>(40 + r));
      return td::ops::add(td::ops::mul(td::randn({4, 3}, td::kFloat32, &gen), r + 1.0), static_cast<double>(r));
    };
    td::ops::sum(ddp(input(rank))).backward();  // training: each rank's BatchNorm updates its own stats
    auto bn = std::dynamic_pointer_cast<td::nn::BatchNorm>((*model)[1]);
    auto rank0 = make();  // rank 0's module after the same training forward
    td::ops::sum(rank0->forward(input(0))).backward();
    auto bn0 = std::dynamic_pointer_cast<td::nn::BatchNorm>((*rank0)[1]);

    ddp.eval();
    model->zero_grad();
    {
      td::NoGradGuard no_grad;
      ddp(td::ones({1, 3}));
    }
    expect_close(bn->running_mean, bn0->running_mean, "eval: running_mean is rank 0's");
    expect_close(bn->running_var, bn0->running_var, "eval: running_var is rank 0's");

    // Eval-mode training step: the gradient is the average of both ranks' (running stats fixed).
    td::ops::sum(ddp(input(rank))).backward();
    auto reference = make();
    reference->eval();
    {
      td::NoGradGuard no_grad;
      auto rb = std::dynamic_pointer_cast<td::nn::BatchNorm>((*reference)[1]);
      rb->running_mean.copy_(bn0->running_mean);
      rb->running_var.copy_(bn0->running_var);
    }
    for (int r = 0; r < 2; ++r) td::ops::mul(td::ops::sum(reference->forward(input(r))), 0.5).backward();
    auto got = model->named_parameters(), want = reference->named_parameters();
    for (size_t p = 0; p < got.size(); ++p)
      expect_close(got[p].second.grad(), want[p].second.grad(), "eval-mode gradient of " + got[p].first);
  });
}

// ---------------------------------------------------------------------------------------------
// params_and_buffers_to_ignore (torch's _set_params_and_buffers_to_ignore_for_model) and
// init_sync. Rank r's replica differs from rank 0's in "0.weight" (ignored: kept and trained on
// the rank's own gradient) and "2.weight" (not ignored: broadcast from rank 0 at construction);
// "1.running_mean" is ignored, so the forward after a synchronized one broadcasts only the other
// buffers; so is "rank_local", a buffer of a different shape on each rank.
// ---------------------------------------------------------------------------------------------

namespace {
std::shared_ptr<td::nn::Sequential> ignore_probe(int r) {
  td::manual_seed(5);
  auto net = std::make_shared<td::nn::Sequential>();
  net->push_back(std::make_shared<td::nn::Linear>(3, 2));
  net->push_back(std::make_shared<td::nn::BatchNorm1d>(2));
  net->push_back(std::make_shared<td::nn::Linear>(2, 2));
  td::NoGradGuard no_grad;
  for (const char* name : {"0.weight", "2.weight"}) {
    Tensor p = td::testing::find_tensor(net->state_dict(), name);
    p.copy_(td::ops::add(p, static_cast<double>(r)));
  }
  return net;
}

// A parameter or buffer of `m` by name, the live tensor (state_dict shares them).
Tensor named(const td::nn::Module& m, const std::string& name) { return td::testing::find_tensor(m.state_dict(), name); }

// `fn` must throw ValueError with every needle in its message.
void expect_value_error(const std::function<void()>& fn, const std::vector<std::string>& needles, const std::string& what) {
  try {
    fn();
  } catch (const td::ValueError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) {
      if (msg.find(n) == std::string::npos) fail(what + ": the message lacks \"" + n + "\": " + msg);
    }
    return;
  }
  fail(what + ": no ValueError");
}

Tensor ignore_input(int r) {
  td::Generator gen(static_cast<uint64_t>(60 + r));
  return td::ops::add(td::ops::mul(td::randn({4, 3}, td::kFloat32, &gen), r + 1.0), static_cast<double>(r));
}
}  // namespace

TEST(DDPSemantics, IgnoredParametersAndBuffersStayRankLocal) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = ignore_probe(rank);
    // A buffer whose shape differs across ranks: ignored, it does not make the replicas "differ".
    model->register_buffer("rank_local", td::zeros({rank + 1}));
    DistributedDataParallel ddp(model, group,
                                DDPOptions{.params_and_buffers_to_ignore = {"0.weight", "1.running_mean", "rank_local"}});
    // Rank r's replica after construction: its own 0.weight, rank 0's everything else.
    auto replica = [](int r) {
      auto net = ignore_probe(0);
      td::NoGradGuard no_grad;
      named(*net, "0.weight").copy_(named(*ignore_probe(r), "0.weight"));
      return net;
    };
    expect_close(named(*model, "0.weight"), named(*ignore_probe(rank), "0.weight"), "construction keeps the ignored 0.weight");
    expect_close(named(*model, "2.weight"), named(*ignore_probe(0), "2.weight"), "construction broadcasts 2.weight");
    int64_t slots = 0;
    for (const auto& b : ddp.reducer().bucket_indices()) slots += static_cast<int64_t>(b.size());
    if (slots != 5) fail(fmt::format("buckets hold {} parameters, want 5 (all but 0.weight)", slots));

    td::ops::sum(ddp(ignore_input(rank))).backward();
    std::vector<std::shared_ptr<td::nn::Sequential>> refs;
    for (int r = 0; r < 2; ++r) {
      refs.push_back(replica(r));
      td::ops::sum(refs.back()->forward(ignore_input(r))).backward();
    }
    for (const auto& [name, p] : model->named_parameters()) {
      const Tensor want = name == "0.weight"
                              ? named(*refs[static_cast<size_t>(rank)], name).grad()
                              : td::ops::mul(td::ops::add(named(*refs[0], name).grad(), named(*refs[1], name).grad()), 0.5);
      expect_close(p.grad(), want, "gradient of " + name + (name == "0.weight" ? " (the rank's own)" : " (averaged)"));
    }

    // The eval forward after the synchronized one broadcasts rank 0's buffers, except the ignored.
    ddp.eval();
    {
      td::NoGradGuard no_grad;
      ddp(td::ones({1, 3}));
    }
    expect_close(named(*model, "1.running_mean"), named(*refs[static_cast<size_t>(rank)], "1.running_mean"),
                 "the ignored running_mean stays the rank's own");
    expect_close(named(*model, "1.running_var"), named(*refs[0], "1.running_var"), "running_var is rank 0's");

    // The replicas differ only in what is ignored, optimizer state (momentum of the rank's own
    // 0.weight gradient) included: the replica check passes.
    td::optim::SGD opt(model->parameters(), td::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    ddp.attach_optimizer(&opt);
    opt.step();
    ddp.check_replicas();
  });
}

TEST(DDPSemantics, IgnoringANameTheModuleDoesNotHaveIsAnErrorNamingIt) {
  on_ranks(1, [&](std::shared_ptr<ProcessGroup> group) {
    expect_value_error([&] { DistributedDataParallel(ignore_probe(0), group, DDPOptions{.params_and_buffers_to_ignore = {"0.wieght"}}); },
                       {"'0.wieght'", "neither a parameter nor a buffer"}, "an unknown name in params_and_buffers_to_ignore");
  });
}

// PyTorch: "DistributedDataParallel is not needed when a module doesn't have any parameter that
// requires a gradient", whether the parameters are frozen or all ignored.
TEST(DDPSemantics, AModuleWithNothingToTrainIsAnError) {
  on_ranks(1, [&](std::shared_ptr<ProcessGroup> group) {
    auto frozen = ignore_probe(0);
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    expect_value_error([&] { DistributedDataParallel(frozen, group); },
                       {"DistributedDataParallel is not needed", "its 6 parameters are frozen"}, "a frozen module");
    expect_value_error(
        [&] {
          DistributedDataParallel(ignore_probe(0), group,
                                  DDPOptions{.params_and_buffers_to_ignore = {"0.weight", "0.bias", "1.weight", "1.bias",
                                                                              "2.weight", "2.bias"}});
        },
        {"no parameter that requires a gradient"}, "every parameter ignored");
    auto partly = ignore_probe(0);
    partly->parameters()[0].requires_grad_(false);
    DistributedDataParallel fine(partly, group);  // one trainable parameter is enough
  });
}

TEST(DDPSemantics, WithoutInitSyncReplicasAreTakenAsTheyAreAndTheReplicaCheckCatchesADifference) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = ignore_probe(rank);
    DistributedDataParallel ddp(model, group, DDPOptions{.init_sync = false});
    expect_close(named(*model, "2.weight"), named(*ignore_probe(rank), "2.weight"), "no broadcast without init_sync");
    expect_value_error([&] { ddp.check_replicas(); }, {"parameter '0.weight' differs between rank 0 and rank(s) 1"},
                       "check_replicas over replicas that differ");
  });
}

TEST(DDPSemantics, JoinLeavesIgnoredTensorsRankLocal) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = ignore_probe(rank);
    DistributedDataParallel ddp(model, group, DDPOptions{.params_and_buffers_to_ignore = {"0.weight"}});
    td::optim::SGD opt(model->parameters(), td::optim::SGDOptions{.lr = 0.1});
    Tensor mine;  // this rank's ignored 0.weight when its loop ends
    ddp.join([&] {
      for (int i = 0; i < (rank == 0 ? 3 : 1); ++i) {
        opt.zero_grad();
        td::ops::sum(ddp(ignore_input(rank + 2 * i))).backward();
        opt.step();
      }
      mine = named(*model, "0.weight").clone();
    });
    // join ends with rank 0's parameters everywhere (it trained longest), except the ignored one.
    expect_close(named(*model, "0.weight"), mine, "join keeps the rank's own ignored 0.weight");
    ddp.check_replicas();
  });
}

// broadcast_buffers=false (torch 2.x): every rank keeps its own buffers at construction (they are
// not compared there either: one of a rank-dependent shape is fine), at forwards and at the end of
// join; the parameters are still rank 0's at construction and the longest-training rank's after
// join.
TEST(DDPSemantics, BroadcastBuffersFalseKeepsEveryRanksBuffersAtConstructionAndJoin) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = ignore_probe(rank);
    model->register_buffer("rank_local", td::full({rank + 1}, rank + 1.0));
    {
      td::NoGradGuard no_grad;
      named(*model, "1.running_mean").fill_(rank + 3.0);
    }
    DistributedDataParallel ddp(model, group, DDPOptions{.broadcast_buffers = false});
    expect_close(named(*model, "2.weight"), named(*ignore_probe(0), "2.weight"), "construction broadcasts 2.weight");
    expect_close(named(*model, "1.running_mean"), td::full({2}, rank + 3.0), "construction keeps the rank's running_mean");
    expect_close(named(*model, "rank_local"), td::full({rank + 1}, rank + 1.0), "construction keeps the rank's buffer");

    td::optim::SGD opt(model->parameters(), td::optim::SGDOptions{.lr = 0.1});
    std::vector<Tensor> means;  // this rank's running_mean after each of its iterations
    ddp.join([&] {
      for (int i = 0; i < (rank == 0 ? 1 : 3); ++i) {
        opt.zero_grad();
        td::ops::sum(ddp(ignore_input(rank + 2 * i))).backward();
        opt.step();
        means.push_back(named(*model, "1.running_mean").clone());
      }
    });
    // Rank 1 trained longest: its parameters everywhere, but each rank's running_mean is what its
    // own batches made of its own start (no broadcast at the forwards or at the end).
    Tensor w = named(*model, "2.weight").clone();
    group->broadcast(w, 1)->wait();
    expect_close(named(*model, "2.weight"), w, "join ends with rank 1's 2.weight");
    expect_close(named(*model, "1.running_mean"), means.back(), "join keeps the rank's running_mean");
    Tensor r0 = named(*model, "1.running_mean").clone();
    group->broadcast(r0, 0)->wait();
    Tensor r1 = named(*model, "1.running_mean").clone();
    group->broadcast(r1, 1)->wait();
    if (td::ops::max(td::ops::abs(td::ops::sub(r0, r1))).item() < 0.5) {
      fail(fmt::format("the ranks' running_means should differ (rank 0 started at 3, rank 1 at 4), got {} and {}",
                       fmt::join(r0.to_vector(), ", "), fmt::join(r1.to_vector(), ", ")));
    }
    expect_close(named(*model, "rank_local"), td::full({rank + 1}, rank + 1.0), "join keeps the rank's buffer");
  });
}

// The deterministic mode reduces through its own fixed tree and never calls a communication
// hook: registering one (PowerSGD, noop, a compression wrapper) was silently ignored, the
// gradients averaged exactly. It is refused, naming why.
TEST(DDPSemantics, DeterministicModeRefusesACommunicationHookInsteadOfIgnoringIt) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    DistributedDataParallel ddp(std::make_shared<Probe>(), group, DDPOptions{.deterministic = true});
    try {
      ddp.register_comm_hook(td::parallel::noop_hook);
      fail("register_comm_hook in deterministic mode was accepted");
    } catch (const td::ValueError& e) {
      const std::string msg = e.what();
      if (msg.find("deterministic mode") == std::string::npos || msg.find("deterministic=true") == std::string::npos) {
        fail("the error does not say why: " + msg);
      }
    }
  });
}

// noop_hook (torch's debugging hook): DDP's bookkeeping without the all-reduce, each rank keeps
// its own gradients.
TEST(DDPSemantics, NoopHookLeavesEveryRankItsOwnGradients) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Probe>();
    DistributedDataParallel ddp(model, group);
    ddp.register_comm_hook(td::parallel::noop_hook);
    auto reference = std::make_shared<Probe>();
    td::ops::sum(ddp.forward_with([&] { return model->run(probe_input(0, rank, 0), true); })).backward();
    td::ops::sum(reference->run(probe_input(0, rank, 0), true)).backward();
    expect_close(model->w1.grad(), reference->w1.grad(), "w1: the rank's own gradient");
    expect_close(model->w2.grad(), reference->w2.grad(), "w2: the rank's own gradient");
    expect_close(model->extra.grad(), reference->extra.grad(), "extra: the rank's own gradient");
  });
}

// ---------------------------------------------------------------------------------------------
// SyncBatchNorm over subgroups while DDP spans the world (torch's convert_sync_batchnorm(model,
// process_group=subgroup), the "BN group size" of detection training): 4 ranks, DDP over all of
// them, BatchNorm statistics over the pairs {0, 1} and {2, 3} (new_subgroups(2)). Every step
// equals a single process that runs each pair's concatenated batch through plain BatchNorm and
// averages the four ranks' losses; the running statistics follow pair 0's batches, since DDP
// broadcasts rank 0's buffers at every forward after a synchronized one.
// ---------------------------------------------------------------------------------------------

namespace {
std::shared_ptr<td::nn::Sequential> subgroup_bn_net() {
  td::manual_seed(9);
  auto net = std::make_shared<td::nn::Sequential>();
  net->push_back(std::make_shared<td::nn::Linear>(4, 3));
  net->push_back(std::make_shared<td::nn::BatchNorm1d>(3));
  net->push_back(std::make_shared<td::nn::Tanh>());
  net->push_back(std::make_shared<td::nn::Linear>(3, 2));
  return net;
}

// Rank r's batch at `step`: 3 samples, a different scale and offset per rank so the two pairs'
// statistics differ.
Tensor subgroup_bn_input(int step, int r) {
  td::Generator gen(static_cast<uint64_t>(500 + 10 * step + r));
  return td::ops::add(td::ops::mul(td::randn({3, 4}, td::kFloat32, &gen), 1.0 + r), 0.5 * r);
}

// Each rank's loss: the mean square of its outputs.
Tensor subgroup_bn_loss(const Tensor& out) { return td::ops::mean(td::ops::mul(out, out)); }
}  // namespace

TEST(DDPSemantics, SyncBatchNormOverSubgroupsUnderDDPOverTheWorld) {
  on_ranks(4, [&](std::shared_ptr<ProcessGroup> world) {
    const int rank = world->rank();
    auto pair = td::dist::new_subgroups(2);
    if (pair->size() != 2) fail("new_subgroups(2) gave a group of " + std::to_string(pair->size()));
    auto model = subgroup_bn_net();
    if (td::parallel::convert_sync_batchnorm(*model, pair) != 1) fail("expected one converted layer");
    DistributedDataParallel ddp(model, world);
    td::optim::SGD opt(model->parameters(), td::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});

    auto ref = subgroup_bn_net();
    td::optim::SGD ref_opt(ref->parameters(), td::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    auto ref_bn = std::dynamic_pointer_cast<td::nn::BatchNorm>((*ref)[1]);
    auto bn = std::dynamic_pointer_cast<td::nn::BatchNorm>((*model)[1]);

    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      subgroup_bn_loss(ddp(subgroup_bn_input(step, rank))).backward();

      // The reference: pair 1 first with its running-stat update undone, then pair 0's, which
      // stays (the buffers every rank holds after the next forward's broadcast).
      ref_opt.zero_grad();
      Tensor loss = td::zeros({});
      for (int p : {1, 0}) {
        Tensor mean0, var0, count0;
        {
          td::NoGradGuard no_grad;
          mean0 = ref_bn->running_mean.clone();
          var0 = ref_bn->running_var.clone();
          count0 = ref_bn->num_batches_tracked.clone();
        }
        Tensor out = ref->forward(td::ops::cat({subgroup_bn_input(step, 2 * p), subgroup_bn_input(step, 2 * p + 1)}, 0));
        for (int k = 0; k < 2; ++k) loss = td::ops::add(loss, subgroup_bn_loss(out.narrow(0, 3 * k, 3)));
        if (p == 1) {
          td::NoGradGuard no_grad;
          ref_bn->running_mean.copy_(mean0);
          ref_bn->running_var.copy_(var0);
          ref_bn->num_batches_tracked.copy_(count0);
        }
      }
      td::ops::mul(loss, 0.25).backward();
      const auto got = model->named_parameters(), want = ref->named_parameters();
      for (size_t i = 0; i < got.size(); ++i)
        expect_close(got[i].second.grad(), want[i].second.grad(), fmt::format("step {}: gradient of {}", step, got[i].first));
      opt.step();
      ref_opt.step();
      // Before the next forward's broadcast each pair holds its own statistics.
      if (rank < 2) {
        expect_close(bn->running_mean, ref_bn->running_mean, fmt::format("step {}: pair 0's running_mean", step));
        expect_close(bn->running_var, ref_bn->running_var, fmt::format("step {}: pair 0's running_var", step));
      } else if (td::testing::all_close(bn->running_mean, ref_bn->running_mean, kRtol, kAtol)) {
        fail(fmt::format("step {}: pair 1's running_mean equals pair 0's (were the statistics synced over the world?)", step));
      }
    }
    for (const auto& [name, p] : model->named_parameters())
      expect_close(p, td::testing::find_tensor(ref->state_dict(), name), "after 3 steps: " + name);
    ddp.eval();
    {
      td::NoGradGuard no_grad;
      ddp(td::ones({2, 4}));  // the first forward after a synchronized one: rank 0's buffers everywhere
    }
    expect_close(bn->running_mean, ref_bn->running_mean, "after the eval forward: running_mean");
    expect_close(bn->running_var, ref_bn->running_var, "after the eval forward: running_var");
  });
}

// Options that decide which collectives a rank issues must agree: a mismatch is an error at
// construction naming the option, the values and the ranks (otherwise the first backward fails
// with a bare collective mismatch, e.g. all_reduce of 18 elements against 6). The ignore list is
// compared as a set of names.
TEST(DDPSemantics, OptionsThatDifferAcrossRanksAreAnErrorNamingTheOption) {
  on_ranks(3, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    DDPOptions o;
    if (rank == 2) o.bucket_cap_mb = 1e-5;
    expect_value_error([&] { DistributedDataParallel(ignore_probe(0), group, o); },
                       {"the options differ across ranks (rank 2 differs from rank 0)", "rank 0 has bucket_cap_mb=25",
                        "rank 2 has bucket_cap_mb=1e-05", "Pass the same DDPOptions on every rank"},
                       "bucket_cap_mb on rank 2");
    o = DDPOptions{.params_and_buffers_to_ignore = {"0.weight"}};
    if (rank > 0) o.params_and_buffers_to_ignore = {"0.bias"};
    expect_value_error([&] { DistributedDataParallel(ignore_probe(0), group, o); },
                       {"(ranks 1, 2 differ from rank 0)", "rank 0 has params_and_buffers_to_ignore=[0.weight]",
                        "rank 1 has params_and_buffers_to_ignore=[0.bias]"},
                       "the ignore lists");
    // Same set in another order; rank-local options (gradient_as_bucket_view) may differ.
    o = DDPOptions{.gradient_as_bucket_view = rank == 1,
                   .params_and_buffers_to_ignore = rank == 0 ? std::vector<std::string>{"0.bias", "1.running_mean"}
                                                             : std::vector<std::string>{"1.running_mean", "0.bias"}};
    DistributedDataParallel ddp(ignore_probe(0), group, o);
    td::ops::sum(ddp(ignore_input(rank))).backward();
  });
}

// Evaluating through the wrapper on rank 0 only (a common mistake; PyTorch hangs in the buffer
// broadcast): rank 0's forward after a synchronized backward broadcasts the buffers, rank 1 has
// finished and left, and the error says what to do instead.
TEST(DDPSemantics, AForwardOnSomeRanksOnlyIsAnErrorThatSaysToCallTheWrappedModule) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = ignore_probe(0);
    DistributedDataParallel ddp(model, group);
    td::ops::sum(ddp(ignore_input(rank))).backward();
    if (rank != 0) return;  // done training: leaves the group
    ddp.eval();
    td::NoGradGuard no_grad;
    try {
      ddp(ignore_input(0));
    } catch (const td::dist::CommError& e) {
      const std::string msg = e.what();
      for (const char* needle : {"broadcasting rank 0's buffers at this forward failed",
                                 "call the wrapped module there (ddp.module()->forward)", "broadcast_buffers=false"}) {
        if (msg.find(needle) == std::string::npos) fail(std::string("the message lacks \"") + needle + "\": " + msg);
      }
      model->forward(ignore_input(0));  // what it says to do works alone
      return;
    }
    fail("an eval forward through DDP on rank 0 alone went through");
  });
}
