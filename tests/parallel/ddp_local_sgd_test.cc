// Post-local SGD (parallel/local_sgd.h) on 2 forked ranks over shm: the hook is the plain
// average before start_localSGD_iter and each rank's own gradients after it (or the average
// again with post_local_gradient_allreduce); the averager averages at warmup_steps, then every
// period-th call, per dtype; and local SGD that averages after every plain-SGD step is DDP (the
// update is linear in the gradient), up to f32 rounding.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "tandem/autograd/grad_mode.h"
#include "tandem/dist/process_group.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/reduce.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/local_sgd.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::dist::ProcessGroup;
using td::parallel::DistributedDataParallel;
using td::parallel::HierarchicalModelAverager;
using td::parallel::PeriodicModelAverager;
using td::parallel::PostLocalSGDOptimizer;
using td::parallel::PostLocalSGDOptions;
using td::parallel::PostLocalSGDState;

namespace {

void on_ranks(int n, const td::testing::RankFn& fn) {
  td::testing::on_ranks(n, fn, std::chrono::seconds(120), std::chrono::seconds(20));
}
using td::testing::bitwise_equal;
using td::testing::fail;
using td::testing::rel_diff;
using td::testing::same_everywhere;

// x (6 x 8) -> linear(w1 10x8, b1) -> tanh -> linear(w2 3x10).
struct Net : td::nn::Module {
  Net() : Module("Net") {
    td::Generator gen(3);
    w1 = register_parameter("w1", td::ops::mul(td::randn({10, 8}, td::kFloat32, &gen), 0.4));
    b1 = register_parameter("b1", td::ops::mul(td::randn({10}, td::kFloat32, &gen), 0.1));
    w2 = register_parameter("w2", td::ops::mul(td::randn({3, 10}, td::kFloat32, &gen), 0.4));
  }
  Tensor forward(const Tensor& x) override { return td::ops::linear(td::ops::tanh(td::ops::linear(x, w1, b1)), w2); }
  Tensor w1, b1, w2;
};

Tensor batch(int step, int rank) {
  td::Generator gen(static_cast<uint64_t>(70 + 13 * step + rank));
  return td::randn({6, 8}, td::kFloat32, &gen);
}
Tensor loss_of(const Tensor& out) { return td::ops::sum(td::ops::mul(out, out)); }


// Four backwards (no optimizer) of a DDP model with post_localSGD_hook (start 2) next to one with
// the plain average and to the bare model on this rank's data alone; checks every gradient.
void expect_hook_switches_at_start(std::shared_ptr<ProcessGroup> group, bool post_local_allreduce) {
  const int rank = group->rank();
  auto hooked = std::make_shared<Net>(), plain = std::make_shared<Net>(), local = std::make_shared<Net>();
  DistributedDataParallel with(hooked, group), without(plain, group);
  auto state = std::make_shared<PostLocalSGDState>(
      PostLocalSGDOptions{.start_localSGD_iter = 2, .post_local_gradient_allreduce = post_local_allreduce});
  with.register_comm_hook(td::parallel::post_localSGD_hook(state));
  for (int s = 0; s < 4; ++s) {
    for (Net* m : {hooked.get(), plain.get(), local.get()}) m->zero_grad();
    const Tensor x = batch(s, rank);
    loss_of(with(x)).backward();
    loss_of(without(x)).backward();
    loss_of(local->forward(x)).backward();
    const bool averaged = s < 2 || post_local_allreduce;
    auto gh = hooked->named_parameters(), gp = plain->named_parameters(), gl = local->named_parameters();
    for (size_t i = 0; i < gh.size(); ++i) {
      const Tensor& want = averaged ? gp[i].second.grad() : gl[i].second.grad();
      if (!bitwise_equal(gh[i].second.grad(), want)) {
        fail(fmt::format("step {} (post_local_gradient_allreduce {}): '{}' is not the {} gradient", s, post_local_allreduce,
                         gh[i].first, averaged ? "averaged" : "local"));
      }
      if (!averaged && same_everywhere(*group, gh[i].second.grad())) {
        fail(fmt::format("step {}: '{}' is the same on both ranks after the start", s, gh[i].first));
      }
    }
  }
  if (state->iter() != 2) fail(fmt::format("iter {} after the start, want 2 (counting stops there)", state->iter()));
}

}  // namespace

TEST(PostLocalSGD, PlainAverageBeforeTheStartThenLocalGradients) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> group) {
    expect_hook_switches_at_start(group, /*post_local_allreduce=*/false);
    expect_hook_switches_at_start(group, /*post_local_allreduce=*/true);
  });
}

// warmup 2, period 3: the calls numbered 2 and 5 average (0-based), the others leave the
// parameters alone; an f32 and a bf16 parameter (one all-reduce each), different on the two
// ranks before each call.
TEST(PeriodicModelAverager, AveragesAtWarmupThenEveryPeriodPerDtype) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    PeriodicModelAverager averager(3, 2, group);
    Tensor a = td::zeros({5}, td::kFloat32), b = td::zeros({4}, td::kBFloat16);
    for (int call = 0; call < 7; ++call) {
      {
        td::NoGradGuard no_grad;
        td::Generator gen(static_cast<uint64_t>(10 * call + rank));
        a.add_(td::randn({5}, td::kFloat32, &gen));
        b.copy_(td::ops::add(b.to(td::kFloat32), td::randn({4}, td::kFloat32, &gen)).to(td::kBFloat16));
      }
      const Tensor a0 = a.clone(), b0 = b.clone();
      const bool averaged = averager.average_parameters({a, b});
      const bool want = call == 2 || call == 5;
      if (averaged != want) fail(fmt::format("call {}: averaged {}, want {}", call, averaged, want));
      if (averager.step() != call + 1) fail(fmt::format("step {} after call {}", averager.step(), call));
      if (!want) {
        if (!bitwise_equal(a, a0) || !bitwise_equal(b, b0)) fail(fmt::format("call {} changed the parameters", call));
        continue;
      }
      if (!same_everywhere(*group, a) || !same_everywhere(*group, b)) fail(fmt::format("call {}: ranks differ", call));
      // The mean of the two ranks' values: f32 within rounding, bf16 within its half-ulp (2^-9).
      for (auto [now, before, tol] : {std::tuple{a, a0, 1e-6}, std::tuple{b, b0, 4e-3}}) {
        Tensor sum = before.to(td::kFloat32).clone();
        group->all_reduce(sum, td::dist::ReduceOp::SUM)->wait();
        const double d = rel_diff(now.to(td::kFloat32), td::ops::mul(sum, 0.5));
        if (!(d <= tol)) fail(fmt::format("call {}: not the mean (rel {:.3g})", call, d));
      }
    }
  });
}

// A restored step count (torch's PostLocalSGDOptimizer.load_state_dict) continues the schedule:
// an averager of (period 3, warmup 2) set to step 4 (calls 0..3 done) averages at calls 5 and 8,
// as the one that made calls 0..3 itself; negative counts are refused. The
// hook's iteration count is restored the same way.
TEST(PeriodicModelAverager, RestoredStepContinuesTheSchedule) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> group) {
    PeriodicModelAverager averager(3, 2, group);
    averager.set_step(4);
    Tensor a = td::full({3}, static_cast<double>(group->rank()), td::kFloat32);
    std::vector<int> averaged_at;
    for (int call = 4; call < 10; ++call)
      if (averager.average_parameters({a})) averaged_at.push_back(call);
    if (averaged_at != std::vector<int>{5, 8}) fail(fmt::format("averaged at {}", fmt::join(averaged_at, ",")));
    if (!same_everywhere(*group, a)) fail("ranks differ after the averagings");
    try {
      averager.set_step(-1);
      fail("set_step(-1) accepted");
    } catch (const td::ValueError& e) {
      if (std::string(e.what()).find("step must be >= 0, got -1") == std::string::npos) fail(e.what());
    }
    PostLocalSGDState state(PostLocalSGDOptions{.start_localSGD_iter = 5});
    state.set_iter(3);
    if (state.iter() != 3) fail("set_iter");
  });
}

// torch's HierarchicalModelAverager on 4 ranks with {(2, 2), (4, 4)} and warmup 1: no averaging at
// call 0 (warm-up), pairs {0,1} {2,3} at calls 2 and 6, everyone at calls 4 and 8 (the longest
// period that divides the call wins), nothing in between; each average is the mean of the group's
// values (f32 rounding). A restored step continues the schedule. Bad hierarchies are refused.
TEST(HierarchicalModelAverager, AveragesInPairsThenEveryoneByPeriod) {
  on_ranks(4, [](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    HierarchicalModelAverager averager({{2, 2}, {4, 4}}, /*warmup_steps=*/1);
    Tensor p = td::zeros({6}, td::kFloat32);
    // All four ranks' values, for the expected means.
    auto gathered = [&](const Tensor& t) {
      Tensor all = td::empty({4 * 6}, td::kFloat32);
      group->all_gather(td::dist::as_buffer(all), td::dist::as_buffer(t.contiguous()))->wait();
      return all;
    };
    const std::vector<int64_t> want = {0, 0, 2, 0, 4, 0, 2, 0, 4};
    for (int call = 0; call < 9; ++call) {
      {
        td::NoGradGuard no_grad;
        td::Generator gen(static_cast<uint64_t>(100 * call + rank));
        p.add_(td::randn({6}, td::kFloat32, &gen));
      }
      const Tensor before = gathered(p);
      const Tensor mine = p.clone();
      const bool averaged = averager.average_parameters({p});
      const int64_t size = averager.last_group_size();
      if (averaged != (size > 0) || size != want[static_cast<size_t>(call)])
        fail(fmt::format("call {}: averaged in groups of {}, want {}", call, size, want[static_cast<size_t>(call)]));
      if (size == 0) {
        if (!bitwise_equal(p, mine)) fail(fmt::format("call {} changed the parameters", call));
        continue;
      }
      const int first = rank / static_cast<int>(size) * static_cast<int>(size);
      Tensor mean = td::zeros({6}, td::kFloat64);
      for (int r = first; r < first + size; ++r) mean = td::ops::add(mean, before.narrow(0, 6 * r, 6).to(td::kFloat64));
      mean = td::ops::mul(mean, 1.0 / static_cast<double>(size));
      const double d = rel_diff(p, mean);
      if (!(d <= 1e-6)) fail(fmt::format("call {}: not the mean of ranks {}..{} (rel {:.3g})", call, first, first + size - 1, d));
      const Tensor after = gathered(p);
      const bool pair_equal = bitwise_equal(after.narrow(0, 0, 6), after.narrow(0, 6, 6));
      const bool across = bitwise_equal(after.narrow(0, 0, 6), after.narrow(0, 12, 6));
      if (!pair_equal || across != (size == 4)) fail(fmt::format("call {}: wrong ranks equal after averaging", call));
    }
    averager.set_step(3);
    if (averager.average_parameters({p}) || !averager.average_parameters({p}) || averager.last_group_size() != 4)
      fail("set_step(3)");

    try {
      (void)td::dist::new_subgroups(3);
      fail("new_subgroups(3) accepted on 4 ranks");
    } catch (const td::ValueError& e) {
      if (std::string(e.what()).find("group size 3 does not divide the 4 ranks") == std::string::npos) fail(e.what());
    }
    for (const auto& [levels, msg] : std::vector<std::pair<std::vector<std::pair<int64_t, int64_t>>, std::string>>{
             {{}, "period_group_sizes is empty"},
             {{{4, 2}, {2, 4}}, "periods must be >= 1 and increasing, got 2 after 4"},
             {{{2, 3}, {4, 4}}, "group size 3 (period 2) does not divide the 4 ranks"},
             {{{2, 2}}, "the longest period (2) must average over all 4 ranks, not groups of 2"}}) {
      try {
        HierarchicalModelAverager bad(levels);
        fail("accepted: " + msg);
      } catch (const td::ValueError& e) {
        if (std::string(e.what()).find(msg) == std::string::npos) fail(e.what());
      }
    }
  });
}

// torch's PostLocalSGDOptimizer: SGD with momentum on each rank's own gradients, wrapped, is
// bitwise the optimizer's step followed by the averager by hand (period 2, warmup 1: averaging
// after steps 2, 4 and 6), and its state_dict (momenta plus the averager's count) taken after
// step 3 and loaded into a fresh wrapper continues to the same bits. Without the count the
// resumed run averages at other steps and differs.
TEST(PostLocalSGDOptimizer, IsStepThenAverageAndResumesFromItsStateDict) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto train = [&](Net& net, const std::function<void()>& step, int from, int to) {
      for (int s = from; s < to; ++s) {
        for (auto& p : net.parameters()) p.set_grad(Tensor());
        loss_of(net(batch(s, rank))).backward();
        step();
      }
    };
    const td::optim::SGDOptions o{.lr = 0.02, .momentum = 0.9};
    Net wrapped_net, manual_net;
    td::optim::SGD wrapped_sgd(wrapped_net.parameters(), o), manual_sgd(manual_net.parameters(), o);
    PostLocalSGDOptimizer wrapped(wrapped_sgd, std::make_shared<PeriodicModelAverager>(2, 1, group));
    PeriodicModelAverager manual_averager(2, 1, group);
    std::vector<int> averaged;
    int calls = 0;
    train(wrapped_net, [&] { if (wrapped.step()) averaged.push_back(calls); ++calls; }, 0, 6);
    train(manual_net, [&] { manual_sgd.step(); manual_averager.average_parameters(manual_net.parameters()); }, 0, 6);
    if (averaged != std::vector<int>{1, 3, 5}) fail(fmt::format("averaged at calls {}", fmt::join(averaged, ",")));
    auto pw = wrapped_net.parameters(), pm = manual_net.parameters();
    for (size_t i = 0; i < pw.size(); ++i)
      if (!bitwise_equal(pw[i], pm[i])) fail(fmt::format("parameter {} differs from step + average", i));
    if (!same_everywhere(*group, pw[0])) fail("the replicas differ after step 6's averaging");

    // Stop after step 3, resume in a fresh wrapper around a fresh optimizer.
    for (bool restore_step : {true, false}) {
      Net a, b;
      td::optim::SGD sa(a.parameters(), o), sb(b.parameters(), o);
      PostLocalSGDOptimizer first(sa, std::make_shared<PeriodicModelAverager>(2, 1, group));
      train(a, [&] { first.step(); }, 0, 3);
      PostLocalSGDOptimizer::State st = first.state_dict();
      if (st.step != 3) fail(fmt::format("state step {}", st.step));
      if (!restore_step) st.step = 0;
      {
        td::NoGradGuard no_grad;
        auto from = a.parameters(), to = b.parameters();
        for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
      }
      PostLocalSGDOptimizer second(sb, std::make_shared<PeriodicModelAverager>(2, 1, group));
      second.load_state_dict(st);
      train(b, [&] { second.step(); }, 3, 6);
      bool same = true;
      auto pb = b.parameters();
      for (size_t i = 0; i < pb.size(); ++i) same = same && bitwise_equal(pb[i], pw[i]);
      if (same != restore_step)
        fail(restore_step ? "the resumed run differs from the uninterrupted one" : "the count made no difference");
    }
  });
}

// Local SGD with an average after every plain-SGD step (start 0, no gradient all-reduce, period 1)
// is DDP: mean(p - lr g_r) = p - lr mean(g_r). 6 steps, parameters within rel 1e-6 (the two sum
// in another order: f32 rounding, 6e-8 per step; measured 8.7e-8). With period 2 the replicas
// differ between the averagings and the result is not DDP's (measured rel 0.17).
TEST(PostLocalSGD, AveragingAfterEveryPlainSgdStepIsDdp) {
  on_ranks(2, [](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    for (int64_t period : {1, 2}) {
      auto local = std::make_shared<Net>(), reference = std::make_shared<Net>();
      DistributedDataParallel ddp_local(local, group), ddp(reference, group);
      ddp_local.register_comm_hook(td::parallel::post_localSGD_hook(std::make_shared<PostLocalSGDState>(
          PostLocalSGDOptions{.start_localSGD_iter = 0, .post_local_gradient_allreduce = false})));
      PeriodicModelAverager averager(period, 0, group);
      td::optim::SGD opt_local(local->parameters(), {.lr = 0.05}), opt(reference->parameters(), {.lr = 0.05});
      for (int s = 0; s < 6; ++s) {
        const Tensor x = batch(s, rank);
        opt_local.zero_grad();
        loss_of(ddp_local(x)).backward();
        opt_local.step();
        averager.average_parameters(local->parameters());
        opt.zero_grad();
        loss_of(ddp(x)).backward();
        opt.step();
      }
      double worst = 0;
      auto pl = local->parameters(), pr = reference->parameters();
      for (size_t i = 0; i < pl.size(); ++i) worst = std::max(worst, rel_diff(pl[i], pr[i]));
      if (period == 1 && !(worst <= 1e-6)) fail(fmt::format("period 1: rel {:.3g} from DDP", worst));
      if (period == 2 && !(worst > 1e-4)) fail(fmt::format("period 2: within rel {:.3g} of DDP, expected apart", worst));
    }
  });
}

TEST(PostLocalSGD, RejectsOptionsItCannotServe) {
  EXPECT_THROW(PostLocalSGDState(PostLocalSGDOptions{.start_localSGD_iter = -1}), td::ValueError);
  EXPECT_THROW(td::parallel::post_localSGD_hook(nullptr), td::ValueError);
  EXPECT_THROW(PeriodicModelAverager(0), td::ValueError);
  EXPECT_THROW(PeriodicModelAverager(2, -1), td::ValueError);
}
