// The training loop: 2N steps straight equal N steps, a stop (as if killed right after the
// checkpoint of step N), `--resume auto` and N more — bitwise, for weights, optimizer state,
// f32 masters, loss scale, RNG and data position — in fp32 SGD with gradient accumulation, fp16
// with a GradScaler that skips steps, bf16 amp O2, and a GPT whose epochs end mid-run. Plus what a
// run writes (JSONL fields, TensorBoard file, summary) and a resume into another model refused.
#include "tandem/train/trainer.h"

#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tandem/core/error.h"
#include "tandem/core/safetensors.h"
#include "tandem/data/idx.h"
#include "tandem/train/checkpoint.h"
#include "util/test_util.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

bool fashion_available() { return fs::exists(data::fashion_mnist_dir() + "/train-images-idx3-ubyte.gz") ||
                                  fs::exists(data::fashion_mnist_dir() + "/train-images-idx3-ubyte"); }

Config make(json j) {
  return parse_config(j, 1);
}

json mlp_config() {
  return json::parse(R"({
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "seed": 3,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "fashion_mnist", "eval_samples": 200},
    "train": {"steps": 8, "checkpoint_every": 4, "keep_last": 2},
    "log": {"progress": "none"}})");
}

json gpt_config() {
  return json::parse(R"({
    "train_batch_size": 4, "seed": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
    "model": {"name": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "context": 16},
    "data": {"name": "text", "samples_per_epoch": 20, "eval_samples": 8},
    "train": {"steps": 12, "checkpoint_every": 5, "keep_last": 2},
    "log": {"progress": "none"}})");
}

void expect_same_safetensors(const std::string& a, const std::string& b) {
  SCOPED_TRACE(a + " vs " + b);
  const SafetensorsFile fa = load_safetensors(a), fb = load_safetensors(b);
  ASSERT_EQ(fa.tensors.size(), fb.tensors.size());
  for (size_t i = 0; i < fa.tensors.size(); ++i) {
    EXPECT_EQ(fa.tensors[i].first, fb.tensors[i].first);
    const Tensor& ta = fa.tensors[i].second;
    const Tensor& tb = fb.at(fa.tensors[i].first);
    ASSERT_EQ(ta.shape(), tb.shape());
    ASSERT_EQ(ta.dtype(), tb.dtype());
    EXPECT_EQ(std::memcmp(ta.data_ptr(), tb.data_ptr(), ta.nbytes()), 0) << fa.tensors[i].first;
  }
  EXPECT_EQ(fa.metadata, fb.metadata);
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// Runs `cfg` straight, and again as N steps + stop + resume auto; compares the final checkpoints.
void expect_resume_is_exact(const Config& cfg, int64_t stop_after) {
  tandem::testing::TempDir dir;
  const std::string straight = dir.path() + "/straight", resumed = dir.path() + "/resumed";
  std::FILE* devnull = std::fopen("/dev/null", "w");
  const TrainSummary a = run_training(cfg, {.out_dir = straight, .out = devnull});
  const TrainSummary b1 = run_training(cfg, {.out_dir = resumed, .out = devnull, .stop_after = stop_after});
  EXPECT_TRUE(b1.interrupted);
  EXPECT_EQ(b1.steps, stop_after);
  EXPECT_EQ(*latest_checkpoint(resumed + "/checkpoints"), resumed + "/checkpoints/" + checkpoint_name(stop_after));
  const TrainSummary b2 = run_training(cfg, {.out_dir = resumed, .resume = "auto", .out = devnull});
  std::fclose(devnull);
  EXPECT_FALSE(b2.interrupted);
  EXPECT_EQ(a.steps, cfg.train.steps);
  EXPECT_EQ(b2.steps, cfg.train.steps);
  EXPECT_EQ(a.skipped_steps, b2.skipped_steps);
  EXPECT_EQ(a.loss_scale, b2.loss_scale);
  const std::string name = "/checkpoints/" + checkpoint_name(cfg.train.steps);
  expect_same_safetensors(straight + name + "/model.safetensors", resumed + name + "/model.safetensors");
  expect_same_safetensors(straight + name + "/optimizer.safetensors", resumed + name + "/optimizer.safetensors");
  if (fs::exists(straight + name + "/master_weights.safetensors")) {
    expect_same_safetensors(straight + name + "/master_weights.safetensors", resumed + name + "/master_weights.safetensors");
  }
  const json sa = read_json(straight + name + "/trainer_state.json"), sb = read_json(resumed + name + "/trainer_state.json");
  for (const char* k : {"step", "epoch", "batches_consumed", "scheduler_step", "rng", "scaler"}) {
    EXPECT_EQ(sa[k], sb[k]) << k;
  }
  EXPECT_EQ(sa["extra"]["skipped_steps"], sb["extra"]["skipped_steps"]);
  // The resumed run's log continues the interrupted one's: steps 1..N, then N+1..2N.
  std::ifstream log(resumed + "/metrics.jsonl");
  std::string line;
  int64_t expect_step = 1;
  while (std::getline(log, line)) {
    const json r = json::parse(line);
    if (!r.contains("loss")) continue;  // an evaluation record
    EXPECT_EQ(r["step"], expect_step);
    ++expect_step;
  }
  EXPECT_EQ(expect_step, cfg.train.steps + 1);
}

TEST(Trainer, ResumeIsBitwiseFp32SgdWithAccumulationAndClipping) {
  if (!fashion_available()) GTEST_SKIP() << "needs Fashion-MNIST (dataset-fashion-mnist) in " << data::fashion_mnist_dir();
  expect_resume_is_exact(make(mlp_config()), 4);
}

TEST(Trainer, ResumeIsBitwiseFp16GradScalerWithSkippedSteps) {
  if (!fashion_available()) GTEST_SKIP() << "needs Fashion-MNIST (dataset-fashion-mnist) in " << data::fashion_mnist_dir();
  json j = mlp_config();
  // 2^22 overflows f16 gradients: the first steps are skipped while the scale backs off.
  j["fp16"] = {{"enabled", true}, {"initial_scale_power", 22}, {"loss_scale_window", 3}, {"hysteresis", 1}};
  j["optimizer"] = {{"type", "Adam"}, {"params", {{"lr", 1e-3}}}};
  j["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 4}}}};
  const Config cfg = make(j);
  expect_resume_is_exact(cfg, 4);
  tandem::testing::TempDir dir;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  const TrainSummary s = run_training(cfg, {.out_dir = dir.path(), .out = devnull});
  std::fclose(devnull);
  EXPECT_GT(s.skipped_steps, 0);
  EXPECT_LT(s.skipped_steps, s.steps);  // and then it trains
  EXPECT_LT(s.loss_scale, std::ldexp(1.0, 22));
  // Skipped steps carry their provenance in the log.
  std::ifstream log(dir.path() + "/metrics.jsonl");
  std::string line;
  bool found = false;
  while (std::getline(log, line)) found |= json::parse(line).contains("overflow");
  EXPECT_TRUE(found);
}

TEST(Trainer, ResumeIsBitwiseBf16AmpO2) {
  if (!fashion_available()) GTEST_SKIP() << "needs Fashion-MNIST (dataset-fashion-mnist) in " << data::fashion_mnist_dir();
  json j = mlp_config();
  j["bf16"] = {{"enabled", true}};
  j["amp"] = {{"opt_level", "O2"}};
  expect_resume_is_exact(make(j), 4);
}

TEST(Trainer, ResumeIsBitwiseGptAcrossEpochBoundaries) {
  // 20 windows / batch 4 = 5 steps per epoch: the stop at step 5 lands exactly on an epoch's end
  // and the 12 steps span three epochs.
  expect_resume_is_exact(make(gpt_config()), 5);
}

TEST(Trainer, WritesJsonlTensorBoardAndSummary) {
  tandem::testing::TempDir dir;
  json j = gpt_config();
  j["train"]["eval_every"] = 4;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  const TrainSummary s = run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  std::fclose(devnull);
  std::ifstream log(dir.path() + "/metrics.jsonl");
  std::string line;
  int train_rows = 0, eval_rows = 0;
  while (std::getline(log, line)) {
    const json r = json::parse(line);
    if (r.contains("eval_loss")) {
      ++eval_rows;
      continue;
    }
    ++train_rows;
    for (const char* k : {"step", "loss", "lr", "loss_scale", "skipped_steps", "grad_norm", "samples_per_s", "tokens_per_s",
                          "peak_bytes", "data_wait_s", "step_s", "cpu_s"}) {
      EXPECT_TRUE(r.contains(k)) << k << " in " << line;
    }
    // Process CPU time of a step: positive, and on one thread at most its wall time (+ clock slack).
    EXPECT_GT(r["cpu_s"].get<double>(), 0.0) << line;
    EXPECT_LE(r["cpu_s"].get<double>(), r["step_s"].get<double>() * 1.05 + 2e-3) << line;
  }
  EXPECT_EQ(train_rows, 12);
  EXPECT_EQ(eval_rows, 3);  // steps 4, 8 and the end
  bool tb = false;
  for (const auto& e : fs::directory_iterator(dir.path() + "/tensorboard")) {
    tb |= e.path().filename().string().rfind("events.out.tfevents.", 0) == 0 && fs::file_size(e.path()) > 100;
  }
  EXPECT_TRUE(tb);
  const json sum = read_json(dir.path() + "/summary.json");
  for (const char* k : {"final_loss", "eval_loss", "tokens_per_s", "samples_per_s", "peak_bytes", "train_seconds", "steps",
                        "precision", "loss_scale"}) {
    EXPECT_TRUE(sum.contains(k)) << k;
  }
  EXPECT_EQ(sum["steps"], 12);
  EXPECT_GT(s.tokens_per_s, 0);
  EXPECT_GT(s.peak_bytes, 0);
  // The warmup-cosine schedule: linear warmup over 3 steps from 0.
  std::ifstream log2(dir.path() + "/metrics.jsonl");
  std::getline(log2, line);
  EXPECT_EQ(json::parse(line)["lr"], 0.0);
  std::getline(log2, line);
  EXPECT_DOUBLE_EQ(json::parse(line)["lr"].get<double>(), 0.003 / 3);
}

// Micro-batches carry across epochs, so E epochs are E * M / gas steps: with M = 10 micro-batches
// per epoch and gas 4, 10 epochs are 25 steps (per-epoch floor(10 / 4) = 2 steps gave 20: 8 epochs).
TEST(Trainer, EpochsWithAccumulationTrainEveryEpochAsked) {
  tandem::testing::TempDir dir;
  json j = gpt_config();
  j["train_batch_size"] = 8;
  j["train_micro_batch_size_per_gpu"] = 2;
  j["train"] = {{"epochs", 10}, {"keep_last", 1}};
  j["scheduler"]["params"]["warmup_num_steps"] = 2;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  const TrainSummary s = run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  std::fclose(devnull);
  EXPECT_EQ(s.steps, 25);
  EXPECT_EQ(s.epochs, 10);
}

// The log after a resume: records past the checkpoint's step (the steps the resumed run redoes)
// are dropped first, so each step is logged once; a fresh run starts an empty log.
TEST(Trainer, AResumedRunLogsEachStepOnceAndAFreshRunStartsItsOwnLog) {
  tandem::testing::TempDir dir;
  json j = gpt_config();
  j["train"]["steps"] = 6;
  j["train"]["checkpoint_every"] = 2;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  run_training(make(j), {.out_dir = dir.path(), .out = devnull, .stop_after = 4});
  // As if steps 5 and 6 had been logged before a crash that left the checkpoint of step 4 last.
  {
    std::ofstream log(dir.path() + "/metrics.jsonl", std::ios::app);
    log << R"({"step": 5, "loss": 9.0})" << "\n" << R"({"step": 6, "loss": 9.0})" << "\n";
  }
  run_training(make(j), {.out_dir = dir.path(), .resume = "auto", .out = devnull});
  std::vector<int64_t> steps;
  std::ifstream log(dir.path() + "/metrics.jsonl");
  for (std::string line; std::getline(log, line);) {
    const json r = json::parse(line);
    if (r.contains("loss")) {
      steps.push_back(r["step"].get<int64_t>());
      EXPECT_NE(r["loss"], 9.0);
    }
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  // A fresh run (its predecessor left a log but no checkpoint) does not append to that log.
  tandem::testing::TempDir fresh;
  {
    std::ofstream log(fresh.path() + "/metrics.jsonl");
    log << R"({"step": 999, "loss": 1.0})" << "\n";
  }
  j["train"]["steps"] = 2;
  run_training(make(j), {.out_dir = fresh.path(), .out = devnull});
  std::fclose(devnull);
  std::ifstream log2(fresh.path() + "/metrics.jsonl");
  std::string first;
  std::getline(log2, first);
  EXPECT_EQ(json::parse(first)["step"], 1);
}

TEST(Trainer, ResumeIntoAnotherModelIsRefused) {
  tandem::testing::TempDir dir;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  json j = gpt_config();
  j["train"]["steps"] = 2;
  run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  j["model"]["d_model"] = 16;
  try {
    run_training(make(j), {.out_dir = dir.path(), .resume = "auto", .out = devnull});
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    // Refused before anything is loaded, naming the key and both values (load_checkpoint's own
    // shape check, tested in checkpoint_test, would name the first tensor that differs).
    EXPECT_NE(std::string(e.what()).find("\"model.d_model\" is 32 in its config but 16 now"), std::string::npos) << e.what();
  }
  std::fclose(devnull);
}

// A fresh run (no --resume) into an --out that holds an earlier run's checkpoints used to mix its
// checkpoints with them, and keep_last deleted the new run's (lower-numbered) steps at once,
// keeping the old run's; a later --resume auto continued the old run. It is refused, naming the
// newest checkpoint and the two ways out, and the old checkpoints stay.
TEST(Trainer, AFreshRunIntoAnOutHoldingCheckpointsIsRefused) {
  tandem::testing::TempDir dir;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  json j = gpt_config();
  j["train"]["steps"] = 4;
  j["train"]["checkpoint_every"] = 2;
  run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  const auto before = list_checkpoints(dir.path() + "/checkpoints");
  ASSERT_EQ(before.size(), 2u);
  j["train"]["steps"] = 2;
  try {
    run_training(make(j), {.out_dir = dir.path(), .out = devnull});
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("already holds checkpoints of an earlier run (newest: " + before.back() + ")"), std::string::npos) << m;
    EXPECT_NE(m.find("--resume auto"), std::string::npos) << m;
  }
  EXPECT_EQ(list_checkpoints(dir.path() + "/checkpoints"), before);
  std::fclose(devnull);
}

// A resume from an earlier checkpoint (a rewind) into the --out that holds the later ones: its
// saves used to be deleted by keep_last as the oldest, and --resume auto then continued the
// abandoned run. Refused, naming the later checkpoints and the ways out; nothing is deleted.
TEST(Trainer, ARewindIntoAnOutHoldingLaterCheckpointsIsRefused) {
  tandem::testing::TempDir dir;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  json j = gpt_config();
  j["train"]["steps"] = 6;
  j["train"]["checkpoint_every"] = 2;
  j["train"]["keep_last"] = 3;
  run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  const auto before = list_checkpoints(dir.path() + "/checkpoints");
  ASSERT_EQ(before.size(), 3u);
  j["train"]["checkpoint_every"] = 1;
  j["train"]["keep_last"] = 1;
  try {
    run_training(make(j), {.out_dir = dir.path(), .resume = before.front(), .out = devnull});
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("holds 2 later checkpoint(s) (newest: " + before.back() + ")"), std::string::npos) << m;
    EXPECT_NE(m.find("another --out"), std::string::npos) << m;
  }
  EXPECT_EQ(list_checkpoints(dir.path() + "/checkpoints"), before);
  // The newest one resumes there as before.
  j["train"]["steps"] = 7;
  EXPECT_EQ(run_training(make(j), {.out_dir = dir.path(), .resume = before.back(), .out = devnull}).steps, 7);
  std::fclose(devnull);
}

// A resume whose config differs where the checkpoint's state depends on it: another seed (the
// epoch's order changes while the position in it is kept), another optimizer (AdamW's state would
// load into Adam), other optimizer options (the checkpoint's would win without a word). Each is
// refused naming the key and both values; a longer run (train.steps) resumes.
TEST(Trainer, ResumeWithAnotherSeedOrOptimizerIsRefusedNamingTheKey) {
  tandem::testing::TempDir dir;
  std::FILE* devnull = std::fopen("/dev/null", "w");
  json j = gpt_config();
  j["train"]["steps"] = 2;
  run_training(make(j), {.out_dir = dir.path(), .out = devnull});
  const std::vector<std::pair<std::string, std::function<void(json&)>>> changes = {
      {"\"seed\" is", [](json& c) { c["seed"] = 7; }},
      {"\"optimizer.type\" is", [](json& c) { c["optimizer"]["type"] = c["optimizer"]["type"] == "Adam" ? "AdamW" : "Adam"; }},
      {"\"optimizer.params.lr\" is", [](json& c) { c["optimizer"]["params"]["lr"] = 0.5; }},
  };
  for (const auto& [expect, change] : changes) {
    json k = j;
    change(k);
    try {
      run_training(make(k), {.out_dir = dir.path(), .resume = "auto", .out = devnull});
      ADD_FAILURE() << expect << ": expected ValueError";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  }
  // Values are compared as resolved: a default now given explicitly is no change.
  j["train"]["steps"] = 3;
  j["data"]["drop_last"] = false;
  j["optimizer"]["params"]["betas"] = json::array({0.9, 0.999});
  const TrainSummary s = run_training(make(j), {.out_dir = dir.path(), .resume = "auto", .out = devnull});
  EXPECT_EQ(s.steps, 3);
  std::fclose(devnull);
}

}  // namespace
}  // namespace tandem::train
