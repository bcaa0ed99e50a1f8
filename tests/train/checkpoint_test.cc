// Checkpoints: bitwise round trips (SGD, AdamW, amp O2 masters), keep_last, --resume auto's
// choice, refusals that change nothing (other model, truncated file), and a save killed with
// SIGKILL at random moments that never leaves a torn checkpoint behind.
#include "tandem/train/checkpoint.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "tandem/tandem.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

void expect_same_state(nn::Module& a, nn::Module& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(bitwise_equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
}

void expect_same_optimizer(const optim::Optimizer& a, const optim::Optimizer& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.state.size(), sb.state.size());
  EXPECT_EQ(sa.param_groups, sb.param_groups);
  for (size_t i = 0; i < sa.state.size(); ++i) {
    ASSERT_EQ(sa.state[i].size(), sb.state[i].size()) << "param " << i;
    for (const auto& [k, v] : sa.state[i]) {
      ASSERT_TRUE(sb.state[i].count(k)) << k;
      EXPECT_TRUE(bitwise_equal(v, sb.state[i].at(k))) << "param " << i << " " << k;
    }
  }
}

std::shared_ptr<nn::Sequential> small_mlp(uint64_t seed, std::vector<int64_t> hidden = {16}) {
  manual_seed(seed);
  return nn::models::mlp({.in_features = 8, .hidden = std::move(hidden), .num_classes = 4});
}

// A few training steps on fixed random data so that the optimizer has state.
void train_steps(nn::Module& model, optim::Optimizer& opt, int steps) {
  Generator g(123);
  const Tensor x = randn({6, 8}, kFloat32, &g);
  const Tensor y = tensor(std::vector<double>{0, 1, 2, 3, 0, 1}, {6}, kInt64);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    ops::cross_entropy(model(x), y).backward();
    opt.step();
  }
}

CheckpointState sample_state(int64_t step) {
  CheckpointState s;
  s.step = step;
  s.epoch = 2;
  s.batches_consumed = 17;
  s.scheduler_step = step;
  s.rng_seed = 42;
  s.rng_offset = 1234567;
  s.scaler = {{"scale", 32768.0}, {"_growth_tracker", 3}, {"growth_factor", 2.0}};
  s.config = {{"train_batch_size", 6}};
  s.extra = {{"skipped_steps", 1}};
  return s;
}

TEST(Checkpoint, SgdRoundTripIsBitwise) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*a, opt_a, 3);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, nullptr}, sample_state(3), 2);
  EXPECT_EQ(path, dir.path() + "/step_00000003");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
    EXPECT_TRUE(fs::exists(path + "/" + f)) << f;
  }
  EXPECT_FALSE(fs::exists(path + "/master_weights.safetensors"));

  auto b = small_mlp(2);
  optim::SGD opt_b(b->parameters(), {.lr = 0.5, .momentum = 0.9});
  const CheckpointState st = load_checkpoint(path, {b.get(), &opt_b, nullptr});
  expect_same_state(*a, *b);
  expect_same_optimizer(opt_a, opt_b);
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.epoch, 2);
  EXPECT_EQ(st.batches_consumed, 17);
  EXPECT_EQ(st.rng_offset, 1234567u);
  EXPECT_EQ(st.scaler.at("scale"), 32768.0);
  EXPECT_EQ(st.config, sample_state(3).config);
  EXPECT_EQ(st.extra.at("skipped_steps"), 1);
  // Continuing both gives the same weights: the state is complete.
  train_steps(*a, opt_a, 2);
  train_steps(*b, opt_b, 2);
  expect_same_state(*a, *b);
}

TEST(Checkpoint, AdamWRoundTripIsBitwise) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::AdamW opt_a(a->parameters(), {.lr = 1e-2});
  train_steps(*a, opt_a, 2);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, nullptr}, sample_state(2), 1);
  auto b = small_mlp(2);
  optim::AdamW opt_b(b->parameters(), {.lr = 1e-2});
  load_checkpoint(path, {b.get(), &opt_b, nullptr});
  expect_same_optimizer(opt_a, opt_b);
  train_steps(*a, opt_a, 2);
  train_steps(*b, opt_b, 2);
  expect_same_state(*a, *b);
  expect_same_optimizer(opt_a, opt_b);
}

TEST(Checkpoint, AmpO2SavesMastersAndScale) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto amp_a = amp::initialize(*a, opt_a, {.opt_level = "O2", .dtype = kBFloat16});
  const auto step = [](nn::Module& m, optim::Optimizer& opt, amp::Amp& amp) {
    Generator g(5);
    const Tensor x = amp.cast_input(randn({6, 8}, kFloat32, &g));
    const Tensor y = tensor(std::vector<double>{0, 1, 2, 3, 0, 1}, {6}, kInt64);
    opt.zero_grad();
    Tensor loss = ops::cross_entropy(m(x), y);
    {
      auto scaled = amp::scale_loss(loss, opt);
      scaled.backward();
    }
    opt.step();
  };
  step(*a, opt_a, *amp_a);
  step(*a, opt_a, *amp_a);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, amp_a.get()}, sample_state(2), 1);
  EXPECT_TRUE(fs::exists(path + "/master_weights.safetensors"));

  auto b = small_mlp(2);
  optim::SGD opt_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto amp_b = amp::initialize(*b, opt_b, {.opt_level = "O2", .dtype = kBFloat16});
  const CheckpointState st = load_checkpoint(path, {b.get(), &opt_b, amp_b.get()});
  EXPECT_EQ(st.scaler.at("scale"), amp_a->get_scale());
  EXPECT_EQ(amp_b->get_scale(), amp_a->get_scale());
  ASSERT_EQ(amp_a->master_params().size(), amp_b->master_params().size());
  for (size_t i = 0; i < amp_a->master_params().size(); ++i) {
    EXPECT_TRUE(bitwise_equal(amp_a->master_params()[i], amp_b->master_params()[i])) << i;
  }
  expect_same_state(*a, *b);
  step(*a, opt_a, *amp_a);
  step(*b, opt_b, *amp_b);
  expect_same_state(*a, *b);
  expect_same_optimizer(opt_a, opt_b);
}

TEST(Checkpoint, KeepLastAndResumeAutoPickTheNewestComplete) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt(a->parameters(), {.lr = 0.1});
  EXPECT_FALSE(latest_checkpoint(dir.path()).has_value());
  EXPECT_FALSE(latest_checkpoint(dir.path() + "/absent").has_value());
  for (int64_t s : {5, 10, 15, 20}) save_checkpoint(dir.path(), {a.get(), &opt, nullptr}, sample_state(s), 2);
  std::vector<std::string> all = list_checkpoints(dir.path());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], dir.path() + "/step_00000015");
  EXPECT_EQ(*latest_checkpoint(dir.path()), dir.path() + "/step_00000020");
  // Leftovers of a crashed save and a directory without its state file are not checkpoints.
  fs::create_directories(dir.path() + "/.tmp.step_00000025.999");
  fs::create_directories(dir.path() + "/step_00000030");
  std::ofstream(dir.path() + "/step_00000030/model.safetensors") << "partial";
  EXPECT_EQ(*latest_checkpoint(dir.path()), dir.path() + "/step_00000020");
  // A stray directory whose step number overflows int64 is not one of ours either (it used to
  // make every listing, so resume and every later save, throw "stoll").
  fs::create_directories(dir.path() + "/step_99999999999999999999");
  EXPECT_EQ(*latest_checkpoint(dir.path()), dir.path() + "/step_00000020");
  // Saving the same step again replaces it (the two directories exchanged in one rename, so
  // that a crash leaves one of them under the name); the next save sweeps the temporary away.
  CheckpointState again = sample_state(20);
  again.extra["marker"] = "second";
  save_checkpoint(dir.path(), {a.get(), &opt, nullptr}, again, 2);
  EXPECT_FALSE(fs::exists(dir.path() + "/.tmp.step_00000025.999"));
  EXPECT_EQ(*latest_checkpoint(dir.path()), dir.path() + "/step_00000020");
  EXPECT_EQ(load_checkpoint(dir.path() + "/step_00000020", {a.get(), &opt, nullptr}).extra.value("marker", ""), "second");
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().rfind(".old.", 0), std::string::npos) << e.path();
  }
}

TEST(Checkpoint, DifferentModelIsRefusedAndNothingChanges) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*a, opt_a, 1);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, nullptr}, sample_state(1), 1);

  auto b = small_mlp(2, {32});  // hidden 32 instead of 16
  optim::SGD opt_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*b, opt_b, 1);
  auto b_copy = small_mlp(2, {32});
  b_copy->load_state_dict(b->state_dict());
  const auto opt_before = opt_b.state_dict();
  try {
    load_checkpoint(path, {b.get(), &opt_b, nullptr});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("\"1.weight\" has shape [16, 8]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("but [32, 8] in this model"), std::string::npos) << msg;
  }
  expect_same_state(*b, *b_copy);
  const auto opt_after = opt_b.state_dict();
  for (size_t i = 0; i < opt_before.state.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(opt_before.state[i].at("momentum_buffer"), opt_after.state[i].at("momentum_buffer")));
  }

  // A model with an extra layer: the first tensor that differs is named.
  auto c = small_mlp(3, {16, 16});
  optim::SGD opt_c(c->parameters(), {.lr = 0.1});
  try {
    load_checkpoint(path, {c.get(), &opt_c, nullptr});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor \"3.weight\" has shape [4, 16]"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, TruncatedFileIsRefusedAndNothingChanges) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*a, opt_a, 1);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, nullptr}, sample_state(1), 1);
  auto b = small_mlp(2);
  optim::SGD opt_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto b_copy = small_mlp(2);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    SCOPED_TRACE(file);
    const std::string victim = path + "/" + file;
    const std::string backup = dir.path() + "/backup";
    fs::copy_file(victim, backup, fs::copy_options::overwrite_existing);
    fs::resize_file(victim, fs::file_size(victim) - 7);
    try {
      load_checkpoint(path, {b.get(), &opt_b, nullptr});
      FAIL() << "expected IOError";
    } catch (const IOError& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
    expect_same_state(*b, *b_copy);
    EXPECT_TRUE(opt_b.state_dict().state[0].empty());
    fs::copy_file(backup, victim, fs::copy_options::overwrite_existing);
  }
  fs::resize_file(path + "/trainer_state.json", 10);
  EXPECT_THROW(load_checkpoint(path, {b.get(), &opt_b, nullptr}), IOError);
  expect_same_state(*b, *b_copy);
}

// An optimizer file whose state does not fit this optimizer is refused before anything loads:
// a one-element momentum buffer for a larger parameter (it used to pass as a "step" count and the
// update ran off its end), a malformed parameter index (a bare "stoull" before, and "1x" read as
// 1), another optimizer's state. Each error names the file and the tensor or value.
TEST(Checkpoint, OptimizerStateThatDoesNotFitIsRefusedBeforeAnythingLoads) {
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*a, opt_a, 1);
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt_a, nullptr}, sample_state(1), 1);
  const std::string file = path + "/optimizer.safetensors";
  const SafetensorsFile good = load_safetensors(file);
  ASSERT_EQ(good.metadata.at("group_sizes"), "[4]");
  auto b = small_mlp(2);
  optim::SGD opt_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto b_copy = small_mlp(2);
  auto refused = [&](std::function<void(SafetensorsFile&)> edit, const std::string& needle) {
    SCOPED_TRACE(needle);
    SafetensorsFile f = good;
    edit(f);
    save_safetensors(file, f.tensors, f.metadata);
    try {
      load_checkpoint(path, {b.get(), &opt_b, nullptr});
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("optimizer.safetensors"), std::string::npos) << e.what();
    }
    expect_same_state(*b, *b_copy);
    EXPECT_TRUE(opt_b.state_dict().state[0].empty());
  };
  refused([](SafetensorsFile& f) { f.tensors[0].second = zeros({1}); }, "has shape [1], the parameter has [16, 8]");
  refused([](SafetensorsFile& f) { f.tensors[0].first = "state.x.momentum_buffer"; }, "\"x\" is not a parameter");
  refused([](SafetensorsFile& f) { f.tensors[1].first = "state.1x.momentum_buffer"; }, "\"1x\" is not a parameter");
  refused([](SafetensorsFile& f) { f.metadata["num_params"] = "four"; }, "num_params \"four\"");
  refused([](SafetensorsFile& f) { f.metadata["optimizer"] = "Adam"; }, "holds the state of a Adam optimizer");
  refused([](SafetensorsFile& f) { f.tensors[0].first = "state.0.exp_avg"; }, "\"exp_avg\", which SGD does not keep");
  refused([](SafetensorsFile& f) { f.metadata["group_sizes"] = "[3]"; }, "parameter group 0 holds 3 parameters");
  // The file as written loads.
  save_safetensors(file, good.tensors, good.metadata);
  load_checkpoint(path, {b.get(), &opt_b, nullptr});
  expect_same_optimizer(opt_a, opt_b);
}

// model.safetensors is what PyTorch's load_state_dict takes: the same names and shapes, strict.
TEST(Checkpoint, ModelFileLoadsIntoPyTorch) {
  const std::string py = std::string(TANDEM_SOURCE_DIR) + "/.venv-test/bin/python";
  if (!fs::exists(py)) GTEST_SKIP() << "needs " << py << " with torch and safetensors (scripts/install-deps.sh)";
  tandem::testing::TempDir dir;
  auto a = small_mlp(1);
  optim::SGD opt(a->parameters(), {.lr = 0.1});
  const std::string path = save_checkpoint(dir.path(), {a.get(), &opt, nullptr}, sample_state(1), 1);
  const std::string script = dir.path() + "/load.py";
  std::ofstream(script) << "import sys, torch, torch.nn as nn\n"
                           "from safetensors.torch import load_file\n"
                           "m = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
                           "r = m.load_state_dict(load_file(sys.argv[1]), strict=True)\n"
                           "print('ok', float(m[1].weight[0, 0]))\n";
  FILE* p = ::popen((py + " " + script + " " + path + "/model.safetensors 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = ::pclose(p);
  if (out.find("ModuleNotFoundError") != std::string::npos) {
    GTEST_SKIP() << py << " lacks torch or safetensors (scripts/install-deps.sh): " << out;
  }
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(out, fmt::format("ok {}\n", a->state_dict()[0].second.to_vector()[0])) << out;
}

// A child saves checkpoints of steps 1, 2, 3, ... (weights filled with the step number) until it
// is killed with SIGKILL at a random moment; the newest complete checkpoint must then load and
// hold exactly its step's values. Repeated with different kill delays.
TEST(Checkpoint, KilledDuringSaveLeavesTheLastCompleteOne) {
  for (int round = 0; round < 4; ++round) {
    tandem::testing::TempDir dir;
    auto model = small_mlp(1, {256, 256});  // ~70k parameters: a save takes long enough to be hit
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        for (int64_t s = 1;; ++s) {
          for (Tensor& p : model->parameters()) {
            NoGradGuard ng;
            p.fill_(static_cast<double>(s));
          }
          save_checkpoint(dir.path(), {model.get(), &opt, nullptr}, sample_state(s), 2);
        }
      } catch (...) {
      }
      ::_exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(30 + 17 * round));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child stopped by itself: status " << status;
    const auto latest = latest_checkpoint(dir.path());
    if (!latest) continue;  // killed before the first save completed: nothing to check
    auto fresh = small_mlp(2, {256, 256});
    optim::SGD opt2(fresh->parameters(), {.lr = 0.1});
    const CheckpointState st = load_checkpoint(*latest, {fresh.get(), &opt2, nullptr});
    EXPECT_EQ(*latest, dir.path() + "/" + checkpoint_name(st.step));
    for (const Tensor& p : fresh->parameters()) {
      const Tensor expected = full(p.shape(), static_cast<double>(st.step), p.dtype());
      EXPECT_TRUE(bitwise_equal(p, expected)) << "step " << st.step;
    }
  }
}


// Bitwise equality of two modules' states and two optimizers' states, for checks inside forked
// ranks (where a gtest assertion would not reach the parent).
bool same_replica(nn::Module& ma, const optim::Optimizer& oa, nn::Module& mb, const optim::Optimizer& ob) {
  const auto sa = ma.state_dict(), sb = mb.state_dict();
  if (sa.size() != sb.size()) return false;
  for (size_t i = 0; i < sa.size(); ++i)
    if (sa[i].first != sb[i].first || !bitwise_equal(sa[i].second, sb[i].second)) return false;
  const auto pa = oa.state_dict(), pb = ob.state_dict();
  if (pa.state.size() != pb.state.size()) return false;
  for (size_t i = 0; i < pa.state.size(); ++i) {
    if (pa.state[i].size() != pb.state[i].size()) return false;
    for (const auto& [k, v] : pa.state[i])
      if (!pb.state[i].count(k) || !bitwise_equal(v, pb.state[i].at(k))) return false;
  }
  return true;
}

// Ranks that trained apart (post-local SGD): gather_replicas brings ranks 1 and 2's model and
// optimizer state to rank 0, which saves them beside its own; each rank then loads its own
// replica back, bitwise, and not another's. Ranks whose optimizer states differ in structure
// (one never stepped) are refused on every rank, naming the sizes.
TEST(Checkpoint, GatheredReplicasComeBackToTheirOwnRanks) {
  tandem::testing::TempDir dir;
  const std::string root = dir.path() + "/ckpt";
  tandem::testing::on_ranks(
      3,
      [&](std::shared_ptr<dist::ProcessGroup> group) {
        const int rank = group->rank();
        auto model = small_mlp(10 + static_cast<uint64_t>(rank));  // other weights on every rank
        optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
        train_steps(*model, opt, 2 + rank);  // and other momenta
        const CheckpointTarget target{model.get(), &opt, nullptr};
        const std::vector<Replica> others = gather_replicas(target, *group);
        if (rank != 0 && !others.empty()) tandem::testing::fail("a rank other than 0 got replicas");
        if (rank == 0) {
          if (others.size() != 2) tandem::testing::fail(fmt::format("rank 0 got {} replicas", others.size()));
          save_checkpoint(root, target, sample_state(5), 1, others);
        }
        group->barrier()->wait();
        auto fresh = small_mlp(99);
        optim::SGD fresh_opt(fresh->parameters(), {.lr = 0.1, .momentum = 0.9});
        train_steps(*fresh, fresh_opt, 1);
        if (same_replica(*fresh, fresh_opt, *model, opt)) tandem::testing::fail("the fresh model starts equal");
        const CheckpointState st = load_checkpoint(root + "/step_00000005", {fresh.get(), &fresh_opt, nullptr}, rank, 3);
        if (st.extra.value("replicas", 0) != 3) tandem::testing::fail("extra.replicas is not 3");
        if (!same_replica(*fresh, fresh_opt, *model, opt))
          tandem::testing::fail(fmt::format("rank {} did not get its own replica back", rank));

        // One rank never stepped: no momentum buffers there.
        auto m2 = small_mlp(7);
        optim::SGD o2(m2->parameters(), {.lr = 0.1, .momentum = 0.9});
        if (rank != 1) train_steps(*m2, o2, 1);
        try {
          (void)gather_replicas({m2.get(), &o2, nullptr}, *group);
          tandem::testing::fail("replicas of different structure were gathered");
        } catch (const ValueError& e) {
          if (std::string(e.what()).find("rank 1's model and optimizer state take") == std::string::npos)
            tandem::testing::fail(e.what());
        }
      },
      std::chrono::seconds(60), std::chrono::seconds(30));
  // On disk: rank 0's files at the top, ranks 1 and 2 in their own directories.
  EXPECT_TRUE(fs::exists(root + "/step_00000005/rank_1/optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(root + "/step_00000005/rank_2/model.safetensors"));
  EXPECT_FALSE(fs::exists(root + "/step_00000005/rank_3"));
  EXPECT_FALSE(fs::exists(root + "/step_00000005/rank_0"));
}

}  // namespace
}  // namespace tandem::train
