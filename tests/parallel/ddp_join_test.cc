// DistributedDataParallel::join (torch's `with ddp.join():`): ranks with different numbers of
// batches. A rank whose loop ended answers the others' collectives until every loop has ended;
// then every rank holds the model of the rank(s) that trained longest. Each case compares with a
// single-process reference computed in the same rank, in which step s averages the gradients of
// the ranks that still had a batch s. Ranks are forked over shm (dist::spawn); a missing or
// mismatched collective in the joined rank's answers shows up as a timeout, so the group timeout
// is short and the whole run has a deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/ranges.h>

#include "tandem/autograd/grad_mode.h"
#include "tandem/dist/backends.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/spawn.h"
#include "tandem/nn/norm.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/reduce.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/powersgd.h"
#include "tandem/parallel/sync_batch_norm.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::dist::ProcessGroup;
using td::parallel::DDPOptions;
using td::parallel::DistributedDataParallel;
using td::parallel::JoinOptions;

namespace {

void on_ranks(int n, const td::testing::RankFn& fn) {
  td::testing::on_ranks(n, fn, std::chrono::seconds(120), std::chrono::seconds(15));
}
using td::testing::fail;
using td::testing::same_everywhere;

// x -> linear(w1, b1) [-> BatchNorm1d] -> tanh -> linear(w2) [+ extra]. Seeded, so every rank and
// the reference start from the same values. `hidden` and `out` size the layers (the default is
// tiny: every collective runs inline; 4096 x 6 makes w1 and w2 96 KiB each, which shm hands to
// its progress thread).
struct Net : td::nn::Module {
  explicit Net(bool batch_norm, int64_t hidden = 8, int64_t out = 3) : Module("Net") {
    td::Generator gen(11);
    const double scale = 0.4 * std::sqrt(8.0 / static_cast<double>(hidden));
    w1 = register_parameter("w1", td::ops::mul(td::randn({hidden, 6}, td::kFloat32, &gen), 0.4));
    b1 = register_parameter("b1", td::ops::mul(td::randn({hidden}, td::kFloat32, &gen), 0.1));
    w2 = register_parameter("w2", td::ops::mul(td::randn({out, hidden}, td::kFloat32, &gen), scale));
    extra = register_parameter("extra", td::ops::mul(td::randn({out}, td::kFloat32, &gen), 0.1));
    if (batch_norm) bn = register_module("bn", std::make_shared<td::nn::BatchNorm1d>(hidden));
  }
  Tensor run(const Tensor& x, bool use_extra) {
    Tensor h = td::ops::linear(x, w1, b1);
    if (bn) h = bn->forward(h);
    Tensor out = td::ops::linear(td::ops::tanh(h), w2);
    return use_extra ? td::ops::add(out, extra) : out;
  }
  Tensor w1, b1, w2, extra;
  std::shared_ptr<td::nn::BatchNorm1d> bn;
};

// Mean of squares: the per-rank loss (a mean over the rank's batch, as with cross entropy).
Tensor loss_of(const Tensor& out) { return td::ops::mul(td::ops::sum(td::ops::mul(out, out)), 1.0 / out.numel()); }

Tensor batch(int step, int rank) {
  td::Generator gen(static_cast<uint64_t>(500 + 37 * step + rank));
  return td::randn({5, 6}, td::kFloat32, &gen);
}

// Each parameter's norm-wise relative difference from the reference's.
void expect_params_close(const td::nn::Module& got, const td::nn::Module& want, double rel, const std::string& what) {
  auto g = got.named_parameters(), w = want.named_parameters();
  for (size_t i = 0; i < g.size(); ++i) {
    const double r = td::testing::rel_diff(g[i].second, w[i].second);
    if (!(r <= rel)) fail(fmt::format("{}: parameter '{}' differs from the reference by rel {:.3g} (limit {:.1g})", what, g[i].first, r, rel));
  }
}

struct Case {
  std::vector<int> batches;  // per rank
  DDPOptions ddp;
  JoinOptions join;
  bool batch_norm = false;
  bool bf16_wire = false;
  // PowerSGD at full rank (exact average; its P and Q all-reduces run inside the hook's `then`).
  bool powersgd = false;
  // Step s uses `extra` only when s is even (find_unused_parameters cases).
  bool extra_on_even_steps = false;
  // Micro-batches per step, all but the last under no_sync (gradient accumulation).
  int micro = 1;
  // The optimizer steps inside backward (register_fused_optimizer): a joined rank does not step.
  bool fused_optimizer = false;
  int64_t hidden = 8, out = 3;  // Net's sizes
};

// Trains with join on this rank's batches and checks the result against the reference.
void run_case(ProcessGroup& group, std::shared_ptr<ProcessGroup> shared, const Case& c, double rel) {
  const int world = group.size(), rank = group.rank();
  const std::string what = fmt::format(
      "batches [{}] divide_by_initial={} bucket_view={} find_unused={} bn={} bf16_wire={} powersgd={} micro={} fused={}",
      fmt::join(c.batches, ","), c.join.divide_by_initial_world_size, c.ddp.gradient_as_bucket_view,
      c.ddp.find_unused_parameters, c.batch_norm, c.bf16_wire, c.powersgd, c.micro, c.fused_optimizer);
  auto uses_extra = [&](int s) { return !c.extra_on_even_steps || s % 2 == 0; };
  auto model = std::make_shared<Net>(c.batch_norm, c.hidden, c.out);
  DistributedDataParallel ddp(model, shared, c.ddp);
  if (c.bf16_wire) ddp.register_comm_hook(td::parallel::bf16_compress_hook);
  if (c.powersgd) {
    ddp.register_comm_hook(td::parallel::powerSGD_hook(std::make_shared<td::parallel::PowerSGDState>(
        td::parallel::PowerSGDOptions{.matrix_approximation_rank = 8,
                                      .start_powerSGD_iter = 0,
                                      .min_compression_rate = 0,
                                      .use_error_feedback = false,
                                      .warm_start = false})));
  }
  auto opt_ptr = std::make_shared<td::optim::SGD>(model->parameters(), td::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  td::optim::SGD& opt = *opt_ptr;
  if (c.fused_optimizer) ddp.register_fused_optimizer(opt_ptr);
  ddp.join(
      [&] {
        for (int s = 0; s < c.batches[rank]; ++s) {
          opt.zero_grad();
          for (int m = 0; m < c.micro; ++m) {
            auto loss = [&] {
              Tensor out = ddp.forward_with([&] { return model->run(batch(10 * s + m, rank), uses_extra(s)); });
              return td::ops::mul(loss_of(out), 1.0 / c.micro);
            };
            if (m + 1 < c.micro) {
              auto no_sync = ddp.no_sync();
              loss().backward();
            } else {
              loss().backward();
            }
          }
          if (!c.fused_optimizer) opt.step();
        }
      },
      c.join);

  // The reference: step s averages the gradients of the ranks that had a batch s, over the world
  // (divide_by_initial_world_size) or over those ranks.
  auto reference = std::make_shared<Net>(c.batch_norm, c.hidden, c.out);
  td::optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
  const int steps = *std::max_element(c.batches.begin(), c.batches.end());
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    std::vector<int> active;
    for (int r = 0; r < world; ++r) {
      if (c.batches[r] > s) active.push_back(r);
    }
    const double divisor = c.join.divide_by_initial_world_size ? world : static_cast<double>(active.size());
    for (int r : active) {
      for (int m = 0; m < c.micro; ++m) {
        td::ops::mul(loss_of(reference->run(batch(10 * s + m, r), uses_extra(s))), 1.0 / (divisor * c.micro)).backward();
      }
    }
    ref_opt.step();
  }
  expect_params_close(*model, *reference, rel, fmt::format("rank {}: {}", rank, what));
  for (const auto& [name, t] : model->named_parameters()) {
    if (!same_everywhere(group, t)) fail(fmt::format("rank {}: {}: parameter '{}' differs across ranks after join", rank, what, name));
  }
  for (const auto& [name, t] : model->named_buffers()) {
    if (!same_everywhere(group, t)) fail(fmt::format("rank {}: {}: buffer '{}' differs across ranks after join", rank, what, name));
  }
  // The collectives stay aligned after join: a synchronized backward with every rank active gives
  // every rank the same averaged gradients. (Stepping on would not keep the replicas equal: a
  // joined rank's optimizer state, here its momentum, missed the steps it sat out, as in PyTorch.)
  opt.zero_grad();
  loss_of(ddp.forward_with([&] { return model->run(batch(100, rank), true); })).backward();
  for (const auto& [name, t] : model->named_parameters()) {
    if (!same_everywhere(group, t.grad())) fail(fmt::format("rank {}: {}: the gradient of '{}' after join differs across ranks", rank, what, name));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// f32, the default hook: equal to the reference within f32 summation-order error (the reference
// sums the ranks' gradients in another order; a few ulps over 6 steps), bitwise equal across ranks
// after join. Covers: the last rank to finish holding the model; a rank with no batch at all
// (rank 0 of 3, which is also the root of the bucket rebuild its peers' first iteration triggers);
// one bucket per parameter (tiny bucket caps); bucket views; both divisors; gradient accumulation
// (the first of two micro-batches under no_sync, which a joined rank must not answer);
// static_graph and delay_allreduce.
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, UnevenInputsEqualTheReferenceThatAveragesTheRanksStillTraining) {
  for (const std::vector<int>& batches : {std::vector<int>{4, 2}, std::vector<int>{0, 3, 2}}) {
    on_ranks(static_cast<int>(batches.size()), [&](std::shared_ptr<ProcessGroup> group) {
      for (bool divide_by_initial : {true, false}) {
        for (bool view : {false, true}) {
          for (int micro : {1, 2}) {
            Case c;
            c.batches = batches;
            c.ddp = DDPOptions{.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4, .gradient_as_bucket_view = view};
            c.join.divide_by_initial_world_size = divide_by_initial;
            c.micro = micro;
            run_case(*group, group, c, 1e-5);
          }
        }
      }
      // Buckets large enough for shm's progress thread (96 KiB): the joined rank's collectives
      // run after the calls that issued them returned.
      {
        Case c;
        c.batches = batches;
        c.ddp = DDPOptions{.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4};
        c.hidden = 4096;
        c.out = 6;
        run_case(*group, group, c, 1e-5);
      }
      // static_graph (its unused-parameter map is all-reduced every iteration) and
      // delay_allreduce (every bucket launched after backward).
      for (const DDPOptions& o : {DDPOptions{.static_graph = true}, DDPOptions{.delay_allreduce = true}}) {
        Case c;
        c.batches = batches;
        c.ddp = o;
        run_case(*group, group, c, 1e-5);
      }
      // The optimizer fused into backward: the ranks still training step bucket by bucket (after
      // the rescale to the ranks still training), a joined rank does not step.
      for (bool divide_by_initial : {true, false}) {
        Case c;
        c.batches = batches;
        c.ddp = DDPOptions{.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4};
        c.join.divide_by_initial_world_size = divide_by_initial;
        c.micro = 2;
        c.fused_optimizer = true;
        run_case(*group, group, c, 1e-5);
      }
    });
  }
}

// A joined rank's stand-in zeros are what its collectives read and write until they complete
// (shm's progress thread does so after the call returned): every bucket's buffer must still be
// alive when the next bucket is issued. Seen from a hook that keeps weak references to the
// buffers of one backward (the training ranks' are the buckets themselves, always alive).
TEST(DDPJoin, AJoinedRanksStandInBuffersLiveUntilTheirCollectivesComplete) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Net>(false);
    DistributedDataParallel ddp(model, group, DDPOptions{.bucket_cap_mb = 1e-5, .first_bucket_mb = 1e-5});
    std::vector<std::weak_ptr<td::Storage>> issued;  // this backward's bucket buffers, in order
    int64_t checks = 0;
    ddp.register_comm_hook([&](ProcessGroup& g, td::parallel::GradBucket& b) {
      if (b.index == 0) issued.clear();
      for (size_t i = 0; i < issued.size(); ++i) {
        if (issued[i].expired()) fail(fmt::format("rank {}: bucket {}'s buffer was freed before bucket {} was issued", rank, i, b.index));
        ++checks;
      }
      issued.push_back(b.buffer.storage());
      return td::parallel::allreduce_hook(g, b);
    });
    td::optim::SGD opt(model->parameters(), {.lr = 0.1});
    ddp.join([&] {
      for (int s = 0; s < (rank == 0 ? 3 : 1); ++s) {
        opt.zero_grad();
        loss_of(ddp.forward_with([&] { return model->run(batch(s, rank), true); })).backward();
        opt.step();
      }
    });
    if (ddp.reducer().bucket_indices().size() < 3) fail("the model should make at least 3 buckets");
    if (checks == 0) fail("the hook checked nothing");
  });
}

// Inside join a forward with gradients announces a synchronized backward to the joined ranks;
// skipping that backward puts the ranks out of step: every rank ends with an error that says so
// (shm detects the mismatched collectives), not a hang or a bare "collective mismatch".
TEST(DDPJoin, ASkippedBackwardInsideJoinEndsEveryRankWithAnErrorThatSaysWhy) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Net>(false);
    DistributedDataParallel ddp(model, group);
    try {
      ddp.join([&] {
        for (int s = 0; s < (rank == 0 ? 3 : 1); ++s) {
          Tensor out = ddp.forward_with([&] { return model->run(batch(s, rank), true); });
          if (s == 1) continue;  // rank 0 skips this batch after its forward
          loss_of(out).backward();
        }
      });
      fail(fmt::format("rank {}: join returned", rank));
    } catch (const td::dist::CommError& e) {
      if (std::string(e.what()).find("fell out of step") == std::string::npos)
        fail(fmt::format("rank {}: the error does not say why: {}", rank, e.what()));
    }
  });
}

// The same over gloo (another backend's collectives; no collective-mismatch detection there, so a
// wrong answer would show as a timeout or a wrong result).
TEST(DDPJoin, UnevenInputsOverGloo) {
  if (!td::dist::backend_available("gloo")) GTEST_SKIP() << "built without gloo (libgloo-dev)";
  td::testing::on_ranks(
      3,
      [&](std::shared_ptr<ProcessGroup> group) {
        for (bool divide_by_initial : {true, false}) {
          Case c;
          c.batches = {2, 0, 3};
          c.ddp = DDPOptions{.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4};
          c.join.divide_by_initial_world_size = divide_by_initial;
          c.micro = 2;
          run_case(*group, group, c, 1e-5);
        }
      },
      std::chrono::seconds(120), std::chrono::seconds(15), "gloo");
}

// ---------------------------------------------------------------------------------------------
// What a joined rank must also answer: buffer broadcasts (BatchNorm running statistics, from the
// highest rank still training), the unused-parameter map (find_unused_parameters, `extra` unused
// on odd steps), and communication hooks whose collectives differ from the default (bf16 wire;
// PowerSGD, which issues two more all-reduces per bucket after the first one completes).
// A missing or mismatched answer times out. With the bf16 wire every averaged gradient is rounded
// to bf16 (8 significant bits, rel 2^-9) on the wire: the parameters agree with the f32 reference
// within rel 1e-2 after 6 steps, and bitwise across ranks.
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, JoinedRanksAnswerBufferBroadcastsUnusedMapsAndHooks) {
  for (const std::vector<int>& batches : {std::vector<int>{2, 5}, std::vector<int>{3, 1, 2}}) {
    on_ranks(static_cast<int>(batches.size()), [&](std::shared_ptr<ProcessGroup> group) {
      for (int hook : {0, 1, 2}) {
        Case c;
        c.batches = batches;
        c.ddp = DDPOptions{.find_unused_parameters = true};
        c.batch_norm = true;
        c.bf16_wire = hook == 1;
        c.powersgd = hook == 2;
        c.extra_on_even_steps = true;
        // bf16 wire: see above; PowerSGD at full rank: f32 rounding amplified by the
        // orthogonalisation (ddp_powersgd_test.cc), 1e-4.
        run_case(*group, group, c, hook == 1 ? 1e-2 : hook == 2 ? 1e-4 : 1e-5);
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// check_replicas_every under join: skipped in iterations some rank sits out (its replica is
// stale), and after join every rank counts the same forwards, so the checks of the training that
// follows line up (plain SGD, no optimizer state to drift: the replicas stay equal).
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, ReplicaChecksLineUpAfterJoin) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Net>(false);
    DistributedDataParallel ddp(model, group, DDPOptions{.check_replicas_every = 2});
    td::optim::SGD opt(model->parameters(), {.lr = 0.1});
    auto step = [&](int s) {
      opt.zero_grad();
      loss_of(ddp.forward_with([&] { return model->run(batch(s, rank), true); })).backward();
      opt.step();
    };
    ddp.join([&] {
      for (int s = 0; s < (rank == 0 ? 1 : 4); ++s) step(s);
    });
    for (int s = 10; s < 15; ++s) step(s);
    ddp.check_replicas();
  });
}

// ---------------------------------------------------------------------------------------------
// throw_on_early_termination: every rank throws at the first iteration in which some rank is out
// of inputs (the one that ran out, and the ones that would go on), naming the option. Also with
// SyncBatchNorm (torch asks for this option there): the ranks stop before its collective.
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, ThrowOnEarlyTerminationStopsEveryRankAlsoWithSyncBatchNorm) {
  for (const bool sync_bn : {false, true}) on_ranks(3, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    const std::vector<int> batches{3, 1, 3};
    auto model = std::make_shared<Net>(sync_bn);
    if (sync_bn && td::parallel::convert_sync_batchnorm(*model, group) != 1) fail("convert_sync_batchnorm converted no layer");
    DistributedDataParallel ddp(model, group);
    td::optim::SGD opt(model->parameters(), {.lr = 0.1});
    int done = 0;
    try {
      ddp.join(
          [&] {
            for (int s = 0; s < batches[rank]; ++s) {
              opt.zero_grad();
              loss_of(ddp.forward_with([&] { return model->run(batch(s, rank), true); })).backward();
              opt.step();
              ++done;
            }
          },
          {.throw_on_early_termination = true});
      fail(fmt::format("rank {}: join returned; it should have thrown", rank));
    } catch (const td::ValueError& e) {
      const std::string msg = e.what();
      if (msg.find("throw_on_early_termination") == std::string::npos)
        fail(fmt::format("rank {}: the error does not name the option: {}", rank, msg));
    }
    if (done != 1) fail(fmt::format("rank {}: ran {} iterations before the stop, want 1", rank, done));
    // The ranks are still aligned: a collective goes through.
    ddp.check_replicas();
  });
}

// ---------------------------------------------------------------------------------------------
// Modes join cannot serve are refused before anything runs; enable=false runs the loop as it is.
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, RefusesDeterministicModeSyncBatchNormAndNestingAndCanBeDisabled) {
  on_ranks(1, [&](std::shared_ptr<ProcessGroup> group) {
    auto expect_refused = [](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
      } catch (const td::ValueError& e) {
        if (std::string(e.what()).find(needle) == std::string::npos) fail(fmt::format("error without '{}': {}", needle, e.what()));
        return;
      }
      fail("join accepted what it should refuse (" + needle + ")");
    };
    bool ran = false;
    {
      DistributedDataParallel ddp(std::make_shared<Net>(false), group, DDPOptions{.deterministic = true});
      expect_refused([&] { ddp.join([&] { ran = true; }); }, "deterministic");
      ddp.join([&] { ran = true; }, {.enable = false});
      if (!ran) fail("join with enable=false did not run the loop");
    }
    {
      auto model = std::make_shared<Net>(true);
      td::parallel::convert_sync_batchnorm(*model, group);
      DistributedDataParallel ddp(model, group);
      expect_refused([&] { ddp.join([] {}); }, "SyncBatchNorm");
    }
    {
      DistributedDataParallel ddp(std::make_shared<Net>(false), group);
      expect_refused([&] { ddp.join([&] { ddp.join([] {}); }); }, "nest");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Without join, uneven inputs end in an error on the rank left waiting (not a hang), which says
// what to do.
// ---------------------------------------------------------------------------------------------

TEST(DDPJoin, WithoutJoinUnevenInputsEndInAnErrorThatPointsToJoin) {
  on_ranks(2, [&](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto model = std::make_shared<Net>(false);
    DistributedDataParallel ddp(model, group);
    td::optim::SGD opt(model->parameters(), {.lr = 0.1});
    try {
      for (int s = 0; s < (rank == 0 ? 1 : 3); ++s) {
        opt.zero_grad();
        loss_of(ddp.forward_with([&] { return model->run(batch(s, rank), true); })).backward();
        opt.step();
      }
      if (rank == 1) fail("rank 1 trained on after rank 0 stopped; its gradient all-reduce should have failed");
    } catch (const td::dist::CommError& e) {
      // Rank 0 returned (and exited) after one step; rank 1's second backward finds it gone (or,
      // were rank 0 still there, issuing other collectives).
      const std::string msg = e.what();
      if (rank != 1 || msg.find("DistributedDataParallel::join") == std::string::npos)
        fail(fmt::format("rank {}: unexpected error: {}", rank, msg));
    }
  });
}
