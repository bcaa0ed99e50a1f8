// `tandem train` as a user runs it: killed with SIGKILL mid-run, or stopped with SIGTERM (which
// checkpoints first), and resumed with --resume auto (bitwise equal to the uninterrupted run), on two processes under `tandem run` (resume bitwise,
// and a loss curve that matches the one-process run on the same global batch; the same with the
// PowerSGD hook, whose state the checkpoints carry), W2 with SyncBatchNorm against BatchNorm on
// the global batch, its argument and config errors, and ranks started with different configs,
// data or checkpoints (stopped at start-up, naming the difference).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tandem/core/safetensors.h"
#include "tandem/data/vision.h"
#include "tandem/dist/backends.h"
#include "tandem/train/checkpoint.h"
#include "util/test_util.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kCli = TANDEM_CLI_PATH;

// A tiny W3: 1 layer, d 32, context 16, AdamW with warmup-cosine, bf16 autocast.
std::string write_config(const std::string& dir, int64_t steps, int64_t checkpoint_every) {
  const std::string path = dir + "/tiny_gpt.json";
  std::ofstream(path) << json{{"train_batch_size", 8},
                              {"seed", 2},
                              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.003}}}}},
                              {"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"warmup_num_steps", 3}}}}},
                              {"bf16", {{"enabled", true}}},
                              {"model", {{"name", "gpt"}, {"n_layer", 1}, {"d_model", 32}, {"n_head", 2}, {"context", 16}}},
                              {"data", {{"name", "text"}, {"samples_per_epoch", 48}, {"eval_samples", 8}}},
                              {"train", {{"steps", steps}, {"checkpoint_every", checkpoint_every}, {"keep_last", 2}}},
                              {"dist", {{"timeout_s", 60}}},
                              {"log", {{"progress", "lines"}, {"tensorboard", false}}}}
                                 .dump();
  return path;
}

// Runs a shell command with TANDEM_NUM_THREADS=1; returns its exit code and fills `out`.
int run(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = ::popen(("TANDEM_NUM_THREADS=1 OMP_NUM_THREADS=1 " + cmd + " 2>&1").c_str(), "r");
  std::string text;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) text += buf;
  const int status = ::pclose(p);
  if (out) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// `same_world`: also the data position (per-rank micro-batches), which differs between world sizes.
void expect_same_checkpoint(const std::string& a, const std::string& b, bool same_world = true) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    SCOPED_TRACE(std::string(f) + ": " + a + " vs " + b);
    const SafetensorsFile fa = load_safetensors(a + "/" + f), fb = load_safetensors(b + "/" + f);
    ASSERT_EQ(fa.tensors.size(), fb.tensors.size());
    for (const auto& [name, t] : fa.tensors) {
      const Tensor& u = fb.at(name);
      ASSERT_EQ(t.shape(), u.shape()) << name;
      EXPECT_EQ(std::memcmp(t.data_ptr(), u.data_ptr(), t.nbytes()), 0) << name;
    }
  }
  std::ifstream fa(a + "/trainer_state.json"), fb(b + "/trainer_state.json");
  const json ja = json::parse(fa), jb = json::parse(fb);
  for (const char* k : {"step", "epoch", "batches_consumed", "scheduler_step", "rng", "scaler"}) {
    if (same_world || std::string(k) != "batches_consumed") EXPECT_EQ(ja[k], jb[k]) << k;
  }
}

// `tandem train --config cfg --out out_dir` in the background, one thread, output discarded: its
// pid (-1 when fork failed), for a test that signals it.
pid_t start_train(const std::string& cfg, const std::string& out_dir) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("TANDEM_NUM_THREADS", "1", 1);
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
    ::execl(kCli.c_str(), kCli.c_str(), "train", "--config", cfg.c_str(), "--out", out_dir.c_str(), nullptr);
    ::_exit(127);
  }
  return pid;
}

std::vector<double> losses(const std::string& run_dir) {
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::vector<double> out;
  std::string line;
  while (std::getline(f, line)) {
    const json r = json::parse(line);
    if (r.contains("loss")) out.push_back(r["loss"].get<double>());
  }
  return out;
}

TEST(TrainCli, KilledWithSigkillThenResumeAutoIsBitwise) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 30, 5);
  const std::string straight = dir.path() + "/straight", killed = dir.path() + "/killed";
  std::string out;
  ASSERT_EQ(run(kCli + " train --config " + cfg + " --out " + straight, &out), 0) << out;

  // The same run, killed with SIGKILL as soon as its first checkpoint is complete.
  const pid_t pid = start_train(cfg, killed);
  ASSERT_GE(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!latest_checkpoint(killed + "/checkpoints") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const auto at_kill = latest_checkpoint(killed + "/checkpoints");
  ASSERT_TRUE(at_kill.has_value());
  // Normally killed mid-run; if the machine was fast enough to finish first, the resume below
  // still has to reproduce the run (and the message says so).
  if (!WIFSIGNALED(status)) std::fprintf(stderr, "note: the run finished before SIGKILL reached it\n");
  ASSERT_EQ(run(kCli + " train --config " + cfg + " --out " + killed + " --resume auto", &out), 0) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  expect_same_checkpoint(straight + "/checkpoints/step_00000030", killed + "/checkpoints/step_00000030");
}

TEST(TrainCli, SigtermCheckpointsStopsAndResumesBitwise) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 60, 0);  // no periodic checkpoints: only the stop's
  const std::string straight = dir.path() + "/straight", stopped = dir.path() + "/stopped";
  std::string out;
  ASSERT_EQ(run(kCli + " train --config " + cfg + " --out " + straight, &out), 0) << out;
  const pid_t pid = start_train(cfg, stopped);
  ASSERT_GE(pid, 0);
  // Wait until it has trained a few steps, then ask it to stop.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream f(stopped + "/metrics.jsonl");
    std::string line;
    int lines = 0;
    while (std::getline(f, line)) ++lines;
    if (lines >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  const auto ckpt = latest_checkpoint(stopped + "/checkpoints");
  ASSERT_TRUE(ckpt.has_value());
  if (WEXITSTATUS(status) == 0) {
    std::fprintf(stderr, "note: the run finished before SIGTERM reached it\n");
  } else {
    EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
    EXPECT_NE(*ckpt, stopped + "/checkpoints/step_00000060");
  }
  ASSERT_EQ(run(kCli + " train --config " + cfg + " --out " + stopped + " --resume auto", &out), 0) << out;
  expect_same_checkpoint(straight + "/checkpoints/step_00000060", stopped + "/checkpoints/step_00000060");
}

// SIGTERM and SIGINT reach tandem train through a thread waiting in sigwait, never through a
// handler (tools/train.cc: a handler interrupting oneDNN's AVX-512 sgemm corrupted the heap): while
// it trains, no handler is installed for them and every thread but the waiting one blocks them.
TEST(TrainCli, StopSignalsAreTakenByAThreadNotAHandler) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 100000, 0), out = dir.path() + "/run";
  const pid_t pid = start_train(cfg, out);
  ASSERT_GE(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && !fs::exists(out + "/metrics.jsonl"))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const uint64_t stop_bits = (1ull << (SIGTERM - 1)) | (1ull << (SIGINT - 1));
  int threads = 0, open_to_them = 0;
  for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigBlk:", 0) == 0 && (std::stoull(line.substr(7), nullptr, 16) & stop_bits) != stop_bits) {
        ++open_to_them;  // (the waiter shows them unblocked while it sits in sigwait)
      }
      if (line.rfind("SigCgt:", 0) == 0) {
        EXPECT_EQ(std::stoull(line.substr(7), nullptr, 16) & stop_bits, 0u) << task.path() << " " << line;
      }
    }
    ++threads;
  }
  EXPECT_GE(threads, 2);  // the training thread and the one waiting for the signals
  EXPECT_EQ(open_to_them, 1) << "only the waiting thread may take SIGTERM / SIGINT";
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_TRUE(latest_checkpoint(out + "/checkpoints").has_value());
}

TEST(TrainCli, TwoProcessesResumeBitwiseAndMatchOneProcess) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 8, 4);
  const std::string launch = kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg;
  const std::string two = dir.path() + "/two", two_resumed = dir.path() + "/two_resumed", one = dir.path() + "/one";
  std::string out;
  ASSERT_EQ(run(launch + " --out " + two, &out), 0) << out;
  EXPECT_NE(out.find("2 x 4 micro-batch x 1 accumulation = batch 8"), std::string::npos) << out;
  ASSERT_EQ(run(launch + " --out " + two_resumed + " --stop-after 4", &out), 0) << out;
  ASSERT_EQ(run(launch + " --out " + two_resumed + " --resume auto", &out), 0) << out;
  expect_same_checkpoint(two + "/checkpoints/step_00000008", two_resumed + "/checkpoints/step_00000008");

  // One process on the same global batch of 8 (DistributedSampler: the 2 ranks' shares of step k
  // are the 8 samples one process takes at step k).
  ASSERT_EQ(run(kCli + " train --config " + cfg + " --out " + one, &out), 0) << out;
  const std::vector<double> l1 = losses(one), l2 = losses(two);
  ASSERT_EQ(l1.size(), 8u);
  ASSERT_EQ(l2.size(), 8u);
  // bf16 autocast rounds matmul inputs to 8 significant bits (relative 2^-8 = 0.4%); the two runs
  // differ only in how the batch is split across GEMMs and in the gradient all-reduce's order, so
  // their losses agree to a fraction of that: half a bf16 epsilon, 0.2% relative (measured: 2.3e-5).
  // Step 1 sees identical weights and batches: equal up to the mean's summation order.
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 2e-3 * std::abs(l1[i])) << "step " << i + 1;
  EXPECT_NEAR(l2[0], l1[0], 1e-6 * std::abs(l1[0]));
}

// ddp.fused_optimizer: the optimizer steps inside backward, bucket by bucket; the run's weights
// and optimizer state equal the plain run's bit for bit (bf16 autocast, AdamW with warmup-cosine,
// 2 micro-batches per step so that a no_sync backward comes first), and resuming it is bitwise.
TEST(TrainCli, FusedOptimizerTwoProcessesEqualThePlainRunBitwise) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 6, 3);
  const std::string launch = kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg +
                             " --set train_micro_batch_size_per_gpu=2 --set ddp.bucket_cap_mb=0.01";
  const std::string plain = dir.path() + "/plain", fused = dir.path() + "/fused", resumed = dir.path() + "/resumed";
  std::string out;
  ASSERT_EQ(run(launch + " --out " + plain, &out), 0) << out;
  ASSERT_EQ(run(launch + " --set ddp.fused_optimizer=true --out " + fused, &out), 0) << out;
  EXPECT_NE(out.find("optimizer fused into backward"), std::string::npos) << out;
  expect_same_checkpoint(plain + "/checkpoints/step_00000006", fused + "/checkpoints/step_00000006");
  ASSERT_EQ(run(launch + " --set ddp.fused_optimizer=true --out " + resumed + " --stop-after 3", &out), 0) << out;
  ASSERT_EQ(run(launch + " --set ddp.fused_optimizer=true --out " + resumed + " --resume auto", &out), 0) << out;
  expect_same_checkpoint(plain + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006");
}

// A checkpoint written by 2 processes resumes on 1 at the same sample of the epoch: micro-batch 2
// is 2 micro-batches per rank per step on 2 ranks and 4 on one, so the saved position (8 per-rank
// micro-batches after 4 steps) is converted through the sample count (32), not reused (which
// would replay 16 samples). In f32 the resumed curve is the 1-process run's: the ranks' split of a
// batch changes only the summation order (rel 1e-5; measured 1e-7).
TEST(TrainCli, ResumesOnAnotherWorldSizeAtTheSameSample) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 8, 4);
  const std::string f32 = " --set bf16.enabled=false --set train_micro_batch_size_per_gpu=2";
  const std::string one = dir.path() + "/one", mixed = dir.path() + "/mixed";
  std::string out;
  ASSERT_EQ(run(kCli + " train --config " + cfg + f32 + " --out " + one, &out), 0) << out;
  ASSERT_EQ(run(kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg + f32 + " --out " + mixed + " --stop-after 4",
                &out),
            0)
      << out;
  ASSERT_EQ(run(kCli + " train --config " + cfg + f32 + " --out " + mixed + " --resume auto", &out), 0) << out;
  EXPECT_NE(out.find("2 micro-batch x 4 accumulation = batch 8"), std::string::npos) << out;
  const std::vector<double> l1 = losses(one), lm = losses(mixed);
  ASSERT_EQ(l1.size(), 8u);
  ASSERT_EQ(lm.size(), 8u);
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(lm[i], l1[i], 1e-5 * std::abs(l1[i])) << "step " << i + 1;

  // 3 ranks x micro-batch 2 (batch 12) cannot start 16 samples into an epoch: refused, naming the
  // sizes, and the checkpoint stays as it was.
  const std::string last = mixed + "/checkpoints/step_00000008";
  EXPECT_NE(run(kCli + " run --nproc-per-node 3 " + kCli + " train --config " + cfg + f32 +
                    " --set train_batch_size=12 --set train.steps=12 --out " + mixed + " --resume auto",
                &out),
            0);
  EXPECT_NE(out.find("stopped 16 samples into epoch 1 (1 ranks x micro-batch 2); this run's 3 ranks x micro-batch 2 cannot "
                     "resume at that sample"),
            std::string::npos)
      << out;
  EXPECT_EQ(list_checkpoints(mixed + "/checkpoints").back(), last);
}

// "ddp.deterministic" through the main job: the tiny W3 (bf16 autocast, AdamW, warmup-cosine) with
// micro-batch 2 and batch 8 on 1, 2 and 4 processes (4, 2 and 1 micro-batches per rank) writes
// bitwise-identical weights and optimizer state after 8 steps (across an epoch boundary: 48
// windows are 6 steps); so does a run stopped on 2 processes at step 4 and resumed on 4, and 1 vs
// 2 processes with amp O2 (f32 masters too) and with fp16 + GradScaler.
TEST(TrainCli, DeterministicIsBitwiseOnOneTwoAndFourProcessesAndAcrossAResume) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 8, 4);
  const std::string det = " train --config " + cfg + " --set ddp.deterministic=true --set train_micro_batch_size_per_gpu=2";
  const auto on = [&](int n) { return n == 1 ? kCli + det : kCli + " run --nproc-per-node " + std::to_string(n) + " " + kCli + det; };
  std::string out;
  for (int n : {1, 2, 4}) {
    ASSERT_EQ(run(on(n) + " --out " + dir.path() + "/p" + std::to_string(n), &out), 0) << out;
    EXPECT_NE(out.find(n == 1 ? "DDP over one process, deterministic" : "DDP over shm, deterministic"), std::string::npos) << out;
  }
  ASSERT_EQ(run(on(2) + " --out " + dir.path() + "/mixed --stop-after 4", &out), 0) << out;
  ASSERT_EQ(run(on(4) + " --out " + dir.path() + "/mixed --resume auto", &out), 0) << out;
  const std::string ref = dir.path() + "/p1/checkpoints/step_00000008";
  for (const char* run_dir : {"/p2", "/p4", "/mixed"}) {
    expect_same_checkpoint(ref, dir.path() + run_dir + "/checkpoints/step_00000008", /*same_world=*/false);
  }
  // The same with amp O2 (bf16 weights, f32 masters: the tree sums in f32, rounds once to bf16)
  // and with fp16 autocast + GradScaler (the same scaled gradients everywhere, so the same skips).
  for (const std::string precision : {" --set amp.opt_level=O2", " --set bf16.enabled=false --set fp16.enabled=true"}) {
    SCOPED_TRACE(precision);
    const std::string one = dir.path() + "/o1", two = dir.path() + "/o2";
    fs::remove_all(one);
    fs::remove_all(two);
    ASSERT_EQ(run(on(1) + precision + " --out " + one, &out), 0) << out;
    ASSERT_EQ(run(on(2) + precision + " --out " + two, &out), 0) << out;
    expect_same_checkpoint(one + "/checkpoints/step_00000008", two + "/checkpoints/step_00000008", /*same_world=*/false);
    if (fs::exists(one + "/checkpoints/step_00000008/master_weights.safetensors")) {
      const SafetensorsFile m1 = load_safetensors(one + "/checkpoints/step_00000008/master_weights.safetensors"),
                            m2 = load_safetensors(two + "/checkpoints/step_00000008/master_weights.safetensors");
      for (const auto& [name, t] : m1.tensors) EXPECT_EQ(std::memcmp(t.data_ptr(), m2.at(name).data_ptr(), t.nbytes()), 0) << name;
    }
  }
  // Without the mode, 1 and 2 processes differ in the last bits (another summation order).
  ASSERT_EQ(run(kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg +
                    " --set train_micro_batch_size_per_gpu=2 --out " + dir.path() + "/plain",
                &out),
            0)
      << out;
  const SafetensorsFile a = load_safetensors(ref + "/model.safetensors"),
                        b = load_safetensors(dir.path() + "/plain/checkpoints/step_00000008/model.safetensors");
  bool differs = false;
  for (const auto& [name, t] : a.tensors) differs = differs || std::memcmp(t.data_ptr(), b.at(name).data_ptr(), t.nbytes()) != 0;
  EXPECT_TRUE(differs);
}

// "ddp.comm_hook": "power_sgd" on 2 processes: the hook's state (each rank's error feedback, the
// warm-start Qs, the counters) goes into the checkpoint, so a run stopped at step 4 and resumed
// ends bit for bit where the uninterrupted one does, hook state included. The compression is on
// (the losses leave the plain all-reduce's), "comm_wrapper": "bf16" sends its factors in bf16, and
// a resume with another world size (whose error feedback would be missing) is refused before
// anything is overwritten.
TEST(TrainCli, PowerSgdTwoProcessesResumeBitwise) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 8, 4);
  const std::string launch = kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg;
  const std::string psgd = " --set ddp.comm_hook=power_sgd --set ddp.comm_state_option.start_powerSGD_iter=2"
                           " --set ddp.comm_state_option.matrix_approximation_rank=2";
  const std::string straight = dir.path() + "/straight", stopped = dir.path() + "/stopped", plain = dir.path() + "/plain";
  std::string out;
  ASSERT_EQ(run(launch + psgd + " --out " + straight, &out), 0) << out;
  EXPECT_NE(out.find("DDP over shm with PowerSGD rank 2 from iteration 2"), std::string::npos) << out;
  ASSERT_EQ(run(launch + psgd + " --out " + stopped + " --stop-after 4", &out), 0) << out;
  ASSERT_EQ(run(launch + psgd + " --out " + stopped + " --resume auto", &out), 0) << out;
  const std::string a = straight + "/checkpoints/step_00000008", b = stopped + "/checkpoints/step_00000008";
  expect_same_checkpoint(a, b);
  const SafetensorsFile ha = load_safetensors(a + "/comm_hook.safetensors"), hb = load_safetensors(b + "/comm_hook.safetensors");
  ASSERT_EQ(ha.tensors.size(), hb.tensors.size());
  int qs = 0, errors0 = 0, errors1 = 0;
  for (const auto& [name, t] : ha.tensors) {
    const Tensor& u = hb.at(name);
    ASSERT_EQ(t.shape(), u.shape()) << name;
    EXPECT_EQ(std::memcmp(t.data_ptr(), u.data_ptr(), t.nbytes()), 0) << name;
    qs += name.rfind("q.", 0) == 0;
    errors0 += name.rfind("error.0.", 0) == 0;
    errors1 += name.rfind("error.1.", 0) == 0;
  }
  EXPECT_GT(qs, 0);  // the matrices worth compressing at rank 2
  EXPECT_GT(errors0, qs);  // every parameter of a compressed bucket, on each rank
  EXPECT_EQ(errors0, errors1);
  std::ifstream sa(a + "/trainer_state.json");
  EXPECT_EQ(json::parse(sa)["extra"]["comm_hook"]["iter"], 8);

  // The same run with the plain all-reduce: equal through step 2 (before start_powerSGD_iter the
  // hook is the plain average), then apart.
  ASSERT_EQ(run(launch + " --out " + plain, &out), 0) << out;
  const std::vector<double> lp = losses(plain), ls = losses(straight);
  ASSERT_EQ(lp.size(), 8u);
  ASSERT_EQ(ls.size(), 8u);
  EXPECT_EQ(lp[1], ls[1]);
  EXPECT_NE(lp.back(), ls.back());

  // PowerSGD's factors in bf16 (bf16_compress_wrapper): within bf16 rounding of the f32 factors'
  // run (0.2% relative, as the bf16 runs above), and not the same bits.
  ASSERT_EQ(run(launch + psgd + " --set ddp.comm_wrapper=bf16 --out " + dir.path() + "/wrapped", &out), 0) << out;
  EXPECT_NE(out.find("with PowerSGD rank 2 from iteration 2 in bf16"), std::string::npos) << out;
  const std::vector<double> lw = losses(dir.path() + "/wrapped");
  ASSERT_EQ(lw.size(), 8u);
  for (size_t i = 0; i < ls.size(); ++i) EXPECT_NEAR(lw[i], ls[i], 2e-3 * std::abs(ls[i])) << "step " << i + 1;
  EXPECT_NE(lw.back(), ls.back());

  // Resuming on 4 processes (batch 16, micro-batch 4: the saved position, 16 samples into the
  // epoch, is one step of theirs): refused, naming both world sizes; the checkpoints stay.
  EXPECT_NE(run(kCli + " run --nproc-per-node 4 " + kCli + " train --config " + cfg + psgd +
                    " --set train_batch_size=16 --set train.steps=12 --out " + stopped + " --resume auto",
                &out),
            0);
  EXPECT_NE(out.find("holds PowerSGD error feedback of 2 ranks, this run has 4; resume it with 2 processes"), std::string::npos)
      << out;
  expect_same_checkpoint(a, b);

  // A checkpoint whose hook file went missing is refused (not resumed with a fresh state).
  fs::remove(b + "/comm_hook.safetensors");
  EXPECT_NE(run(launch + psgd + " --set train.steps=12 --out " + stopped + " --resume auto", &out), 0);
  EXPECT_NE(out.find("should hold " + std::to_string(ha.tensors.size()) + " PowerSGD tensors in comm_hook.safetensors, found 0"),
            std::string::npos)
      << out;
}

// Whether two safetensors files hold the same names with the same shapes and bits.
bool same_tensors(const std::string& a, const std::string& b) {
  const SafetensorsFile fa = load_safetensors(a), fb = load_safetensors(b);
  if (fa.tensors.size() != fb.tensors.size()) return false;
  for (const auto& [name, t] : fa.tensors) {
    if (!fb.contains(name)) return false;
    const Tensor& u = fb.at(name);
    if (t.shape() != u.shape() || std::memcmp(t.data_ptr(), u.data_ptr(), t.nbytes()) != 0) return false;
  }
  return true;
}

// Post-local SGD in the main job (torch's post_localSGD_hook + PeriodicModelAverager): two plain
// DDP steps, then each rank steps on its own gradients and the parameters are averaged after
// steps 3 and 6 (warmup 2, period 3). Between averagings the replicas differ, so a checkpoint
// holds every rank's (rank_1/); stopped at step 4, where they differ, and resumed, the run equals
// the uninterrupted one bitwise, replicas included, in bf16 autocast and with amp O2 (whose f32
// masters are what is averaged). The losses follow plain DDP through step 3 and part after it.
// Subgroups of one are the same run; with groups of 2 among 4 processes (gradients averaged
// within a group) ranks 0 and 1 stay equal and ranks 0 and 2 do not; a hierarchy of averagings
// (HierarchicalModelAverager) resumes bitwise too. Continued as plain DDP, every rank starts from
// rank 0's replica. Resuming on another process count, or without rank 1's files,
// is refused with the reason.
TEST(TrainCli, PostLocalSgdResumesBitwiseWithEveryRanksReplica) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 8, 2);
  const std::string launch = kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg + " --set train.keep_last=4";
  const std::string pl = " --set ddp.comm_hook=post_local_sgd --set ddp.comm_state_option.start_localSGD_iter=2"
                         " --set ddp.comm_state_option.post_local_gradient_allreduce=false --set ddp.model_averaging.period=3";
  std::string out;
  for (const std::string amp : {"", " --set amp.opt_level=O2"}) {
    SCOPED_TRACE("amp:" + amp);
    const std::string straight = dir.path() + "/straight" + (amp.empty() ? "" : "_o2");
    const std::string stopped = dir.path() + "/stopped" + (amp.empty() ? "" : "_o2");
    ASSERT_EQ(run(launch + pl + amp + " --out " + straight, &out), 0) << out;
    EXPECT_NE(out.find("with post-local SGD from iteration 2 (each rank's own gradients; parameters averaged every 3 "
                       "steps from step 2)"),
              std::string::npos)
        << out;
    ASSERT_EQ(run(launch + pl + amp + " --out " + stopped + " --stop-after 4", &out), 0) << out;
    ASSERT_EQ(run(launch + pl + amp + " --out " + stopped + " --resume auto", &out), 0) << out;
    const std::string ck = straight + "/checkpoints/step_0000000";
    // Before local SGD starts (step 2) and right after an averaging (step 6) the parameters are
    // the same on both ranks; at steps 4 and 8 they are not.
    EXPECT_TRUE(same_tensors(ck + "2/model.safetensors", ck + "2/rank_1/model.safetensors"));
    EXPECT_FALSE(same_tensors(ck + "4/model.safetensors", ck + "4/rank_1/model.safetensors"));
    EXPECT_TRUE(same_tensors(ck + "6/model.safetensors", ck + "6/rank_1/model.safetensors"));
    EXPECT_FALSE(same_tensors(ck + "8/model.safetensors", ck + "8/rank_1/model.safetensors"));
    const std::string a = straight + "/checkpoints/step_00000008", b = stopped + "/checkpoints/step_00000008";
    expect_same_checkpoint(a, b);
    std::vector<std::string> files = {"rank_1/model.safetensors", "rank_1/optimizer.safetensors"};
    if (!amp.empty()) files.insert(files.end(), {"master_weights.safetensors", "rank_1/master_weights.safetensors"});
    for (const std::string& f : files) EXPECT_TRUE(same_tensors(a + "/" + f, b + "/" + f)) << f;
    std::ifstream sa(a + "/trainer_state.json");
    const json extra = json::parse(sa)["extra"];
    EXPECT_EQ(extra["replicas"], 2);
    EXPECT_EQ(extra["comm_hook"]["averager_step"], 8);
    EXPECT_EQ(extra["comm_hook"]["iter"], 2);
  }

  // Plain DDP: the same losses through step 3 (its forward still sees step 2's common
  // parameters), then apart.
  const std::string plain = dir.path() + "/plain";
  ASSERT_EQ(run(launch + " --out " + plain, &out), 0) << out;
  const std::vector<double> lp = losses(plain), ls = losses(dir.path() + "/straight");
  ASSERT_EQ(lp.size(), 8u);
  ASSERT_EQ(ls.size(), 8u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(lp[i], ls[i]) << "step " << i + 1;
  EXPECT_NE(lp[3], ls[3]);

  // Groups of one average nothing: the same run as post_local_gradient_allreduce false.
  const std::string ones = dir.path() + "/ones";
  ASSERT_EQ(run(launch + " --set ddp.comm_hook=post_local_sgd --set ddp.comm_state_option.start_localSGD_iter=2"
                         " --set ddp.comm_state_option.subgroup_size=1 --set ddp.model_averaging.period=3 --out " + ones,
                &out),
            0)
      << out;
  EXPECT_NE(out.find("(each rank's own gradients;"), std::string::npos) << out;
  expect_same_checkpoint(dir.path() + "/straight/checkpoints/step_00000008", ones + "/checkpoints/step_00000008");

  // Over gloo (which has no gather) too.
  if (dist::backend_available("gloo")) {
    const std::string gloo = dir.path() + "/gloo";
    ASSERT_EQ(run(launch + pl + " --set dist.backend=gloo --out " + gloo, &out), 0) << out;
    EXPECT_TRUE(fs::exists(gloo + "/checkpoints/step_00000008/rank_1/optimizer.safetensors"));
  }

  // Four processes in groups of two that average their gradients: 0 = 1, 2 = 3, 0 != 2.
  const std::string four = dir.path() + "/four";
  ASSERT_EQ(run(kCli + " run --nproc-per-node 4 " + kCli + " train --config " + cfg +
                    " --set ddp.comm_hook=post_local_sgd --set ddp.comm_state_option.start_localSGD_iter=2"
                    " --set ddp.comm_state_option.subgroup_size=2 --set ddp.model_averaging.period=3 --set train.steps=4"
                    " --out " + four,
                &out),
            0)
      << out;
  EXPECT_NE(out.find("(gradients averaged in groups of 2;"), std::string::npos) << out;
  const std::string f4 = four + "/checkpoints/step_00000004";
  EXPECT_TRUE(same_tensors(f4 + "/model.safetensors", f4 + "/rank_1/model.safetensors"));
  EXPECT_TRUE(same_tensors(f4 + "/rank_2/model.safetensors", f4 + "/rank_3/model.safetensors"));
  EXPECT_FALSE(same_tensors(f4 + "/model.safetensors", f4 + "/rank_2/model.safetensors"));

  // HierarchicalModelAverager (pairs every 2 steps, all 4 every 4; calls counted from 0, the
  // first one warm-up): pairs equal after step 3, everyone after step 5, and a run stopped at
  // step 4 (pairs apart) resumes to the uninterrupted run's bits on every rank.
  const std::string hier_launch = kCli + " run --nproc-per-node 4 " + kCli + " train --config " + cfg +
                                  " --set ddp.comm_hook=post_local_sgd --set ddp.comm_state_option.start_localSGD_iter=1"
                                  " --set ddp.comm_state_option.post_local_gradient_allreduce=false"
                                  " --set ddp.model_averaging.hierarchy=[[2,2],[4,4]] --set ddp.model_averaging.warmup_steps=1"
                                  " --set train.steps=6 --set train.checkpoint_every=1 --set train.keep_last=6";
  const std::string hs = dir.path() + "/hier_straight", hb = dir.path() + "/hier_stopped";
  ASSERT_EQ(run(hier_launch + " --out " + hs, &out), 0) << out;
  EXPECT_NE(out.find("parameters averaged every 2 steps in groups of 2, every 4 steps over all ranks from step 1"),
            std::string::npos)
      << out;
  const std::string h3 = hs + "/checkpoints/step_00000003", h4 = hs + "/checkpoints/step_00000004",
                    h5 = hs + "/checkpoints/step_00000005";
  EXPECT_TRUE(same_tensors(h3 + "/model.safetensors", h3 + "/rank_1/model.safetensors"));
  EXPECT_TRUE(same_tensors(h3 + "/rank_2/model.safetensors", h3 + "/rank_3/model.safetensors"));
  EXPECT_FALSE(same_tensors(h3 + "/model.safetensors", h3 + "/rank_2/model.safetensors"));
  EXPECT_FALSE(same_tensors(h4 + "/model.safetensors", h4 + "/rank_1/model.safetensors"));
  for (const char* r : {"/rank_1", "/rank_2", "/rank_3"})
    EXPECT_TRUE(same_tensors(h5 + "/model.safetensors", h5 + r + "/model.safetensors")) << r;
  ASSERT_EQ(run(hier_launch + " --out " + hb + " --stop-after 4", &out), 0) << out;
  ASSERT_EQ(run(hier_launch + " --out " + hb + " --resume auto", &out), 0) << out;
  for (const char* r : {"", "/rank_1", "/rank_2", "/rank_3"}) {
    for (const char* f : {"/model.safetensors", "/optimizer.safetensors"}) {
      EXPECT_TRUE(same_tensors(hs + "/checkpoints/step_00000006" + r + f, hb + "/checkpoints/step_00000006" + r + f))
          << r << f;
    }
  }

  // Continued as plain DDP, every rank starts from rank 0's replica: the replica check after
  // every step passes (it fails when each rank loads its own), and no replicas are saved.
  const std::string cont = dir.path() + "/continued";
  fs::create_directories(cont + "/checkpoints");
  fs::copy(dir.path() + "/stopped/checkpoints/step_00000008", cont + "/checkpoints/step_00000008",
           fs::copy_options::recursive);
  ASSERT_EQ(run(launch + " --set ddp.check_replicas_every=1 --set train.steps=10 --out " + cont + " --resume auto", &out),
            0)
      << out;
  EXPECT_TRUE(fs::exists(cont + "/checkpoints/step_00000010/model.safetensors"));
  EXPECT_FALSE(fs::exists(cont + "/checkpoints/step_00000010/rank_1"));

  // Another process count is refused before anything is loaded; so is a checkpoint without
  // rank 1's replica. The checkpoints stay.
  const std::string stopped = dir.path() + "/stopped", b = stopped + "/checkpoints/step_00000008";
  EXPECT_NE(run(kCli + " run --nproc-per-node 4 " + kCli + " train --config " + cfg + pl +
                    " --set train_batch_size=16 --set train.steps=12 --out " + stopped + " --resume auto",
                &out),
            0);
  EXPECT_NE(out.find("holds the replicas of 2 ranks (they trained apart), this run has 4; resume it with 2 processes"),
            std::string::npos)
      << out;
  EXPECT_NE(run(kCli + " train --config " + cfg + pl + " --set train_batch_size=4 --set train.steps=12 --out " + stopped +
                    " --resume auto",
                &out),
            0);
  EXPECT_NE(out.find("holds the replicas of 2 ranks (they trained apart), this run has 1"), std::string::npos) << out;
  expect_same_checkpoint(dir.path() + "/straight/checkpoints/step_00000008", b);
  fs::remove_all(b + "/rank_1");
  EXPECT_NE(run(launch + pl + " --set train.steps=12 --out " + stopped + " --resume auto", &out), 0);
  EXPECT_NE(out.find("has no rank_1/ (rank 1's replica); restore it or resume from another checkpoint"), std::string::npos)
      << out;
}

// The acceptance line of issue #8 on the shipped config itself: `tandem run --nproc-per-node 2
// tandem train --config configs/gpt_bf16.json` (W3, bf16 autocast, AdamW) follows the loss curve
// of the 1-process run on the same global batch of 8. Shrunk with --set to stay a few seconds:
// 1 layer, d 64, context 32, 12 steps; everything else (optimizer, lr, data, bf16) is the file's.
TEST(TrainCli, GptBf16ConfigTwoProcessesMatchOneProcess) {
  tandem::testing::TempDir dir;
  const std::string cfg = std::string(TANDEM_SOURCE_DIR) + "/configs/gpt_bf16.json";
  const std::string small =
      " --set model.n_layer=1 --set model.d_model=64 --set model.n_head=2 --set model.context=32"
      " --set train.steps=12 --set train.eval_every=0 --set train.checkpoint_every=0 --set data.eval_samples=4"
      " --set log.progress=lines --set log.tensorboard=false --set dist.timeout_s=60";
  const std::string one = dir.path() + "/one", two = dir.path() + "/two";
  std::string out;
  ASSERT_EQ(run(kCli + " run --nproc-per-node 2 " + kCli + " train --config " + cfg + small + " --out " + two, &out), 0) << out;
  EXPECT_NE(out.find("2 x 4 micro-batch x 1 accumulation = batch 8"), std::string::npos) << out;
  EXPECT_NE(out.find("bf16 autocast"), std::string::npos) << out;
  ASSERT_EQ(run(kCli + " train --config " + cfg + small + " --out " + one, &out), 0) << out;
  const std::vector<double> l1 = losses(one), l2 = losses(two);
  ASSERT_EQ(l1.size(), 12u);
  ASSERT_EQ(l2.size(), 12u);
  // Tolerance, from the dtype: bf16 keeps 8 significant bits (one epsilon, 2^-8 = 0.4% relative).
  // The two runs differ only in how the batch splits across GEMMs (f32 accumulation either way)
  // and in the all-reduce's summation order, so a bf16-rounded input may land one rounding the
  // other way now and then; the losses then agree to a fraction of an epsilon: half of one, 0.2%
  // relative, for every step (measured: at most 2.3e-5). Step 1 has the same weights and the same
  // 8 windows: equal up to the order of the f32 mean (measured 4e-8; bound 1e-5).
  EXPECT_NEAR(l2[0], l1[0], 1e-5 * std::abs(l1[0]));
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 2e-3 * std::abs(l1[i])) << "step " << i + 1;
  // The curve is a curve: 12 AdamW steps at 3e-4 lower the loss on byte text (from ~5.6 = ln 256).
  EXPECT_LT(l1.back(), l1.front());
}

bool fashion_available() {
  return fs::exists(data::fashion_mnist_dir() + "/train-images-idx3-ubyte.gz") ||
         fs::exists(data::fashion_mnist_dir() + "/train-images-idx3-ubyte");
}

// Issue #7's SyncBatchNorm line through the main job: configs/cnn_fp32.json (W2: three conv +
// BatchNorm + ReLU, AdamW) on 2 processes with "ddp.sync_batchnorm" equals 1 process on the same
// global batch of 64 (BatchNorm over all 64): losses, parameters and running statistics. Without
// the key each rank normalises its own 32 and the runs part; "communication_data_type": "bf16"
// sends the f32 gradients in bf16 and stays within bf16 rounding of the f32 wire.
TEST(TrainCli, CnnSyncBatchNormTwoProcessesMatchOneProcessBatchNorm) {
  if (!fashion_available()) GTEST_SKIP() << "needs Fashion-MNIST (dataset-fashion-mnist) in " << data::fashion_mnist_dir();
  tandem::testing::TempDir dir;
  const std::string cfg = std::string(TANDEM_SOURCE_DIR) + "/configs/cnn_fp32.json";
  const std::string args = " train --config " + cfg +
                           " --set train.steps=6 --set train.checkpoint_every=0 --set data.eval_samples=64"
                           " --set log.progress=lines --set log.tensorboard=false --set dist.timeout_s=60";
  const std::string two = kCli + " run --nproc-per-node 2 " + kCli + args;
  std::string out;
  ASSERT_EQ(run(kCli + args + " --out " + dir.path() + "/one", &out), 0) << out;
  ASSERT_EQ(run(two + " --set ddp.sync_batchnorm=true --out " + dir.path() + "/sync", &out), 0) << out;
  EXPECT_NE(out.find("DDP over shm, 3 SyncBatchNorm"), std::string::npos) << out;
  ASSERT_EQ(run(two + " --out " + dir.path() + "/local", &out), 0) << out;
  ASSERT_EQ(run(two + " --set ddp.sync_batchnorm=true --set communication_data_type=bf16 --out " + dir.path() + "/bf16wire", &out),
            0)
      << out;
  EXPECT_NE(out.find("DDP over shm with bf16 gradients on the wire, 3 SyncBatchNorm"), std::string::npos) << out;

  const std::vector<double> one = losses(dir.path() + "/one"), sync = losses(dir.path() + "/sync"),
                            local = losses(dir.path() + "/local"), wire = losses(dir.path() + "/bf16wire");
  ASSERT_EQ(one.size(), 6u);
  ASSERT_EQ(sync.size(), 6u);
  ASSERT_EQ(local.size(), 6u);
  ASSERT_EQ(wire.size(), 6u);
  // f32 throughout; the runs differ in the order of the statistics' and gradients' sums (two
  // halves of 32 combined vs one batch of 64): relative 1e-5 (f32 epsilon 6e-8, amplified a
  // hundredfold by BatchNorm's division by the batch std and six AdamW steps).
  double local_gap = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(sync[i], one[i], 1e-5 * std::abs(one[i])) << "step " << i + 1;
    local_gap = std::max(local_gap, std::abs(local[i] - one[i]) / std::abs(one[i]));
    // bf16 keeps 8 significant bits (2^-8 = 0.4% relative per gradient element); the loss moves by
    // a fraction of that through five updates of lr 1e-3: within 0.4%.
    EXPECT_NEAR(wire[i], sync[i], 4e-3 * std::abs(sync[i])) << "step " << i + 1;
  }
  // Per-rank statistics of 32 images instead of 64 change the losses by far more than rounding
  // (measured 5e-3).
  EXPECT_GT(local_gap, 1e-3);
  EXPECT_NE(wire.back(), sync.back());  // the wire dtype did change the gradients

  const SafetensorsFile m1 = load_safetensors(dir.path() + "/one/checkpoints/step_00000006/model.safetensors");
  const SafetensorsFile m2 = load_safetensors(dir.path() + "/sync/checkpoints/step_00000006/model.safetensors");
  ASSERT_EQ(m1.tensors.size(), m2.tensors.size());
  int running = 0;
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, t] : m1.tensors) {
    if (name.find("num_batches_tracked") != std::string::npos) continue;
    running += name.find("running_") != std::string::npos;
    const Tensor a = t.to(kFloat32).contiguous(), b = m2.at(name).to(kFloat32).contiguous();
    ASSERT_EQ(a.shape(), b.shape()) << name;
    double d2 = 0, n2 = 0, dmax = 0, nmax = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double x = a.data_ptr<float>()[i], y = b.data_ptr<float>()[i];
      d2 += (x - y) * (x - y), n2 += x * x;
      dmax = std::max(dmax, std::abs(x - y)), nmax = std::max(nmax, std::abs(x));
    }
    diff2 += d2, norm2 += n2;
    // Each tensor (parameters, running mean and var), as max |diff| / max |value|: 5e-3. Both
    // runs normalise with BatchNorm's f32 kernels (1-2 f32 ulps per value against an f64
    // reference), in other groupings; AdamW moves every coordinate by ~lr whatever its gradient's
    // size, so a coordinate whose gradient is near zero takes its direction from that rounding
    // noise. The BatchNorm biases (sums of dy, values ~5e-3 after six steps) and the small conv
    // weights show it: measured up to 1.1e-3 (features.6.weight: 5e-5 absolute, 5% of one lr
    // step), BatchNorm weights, running stats and fc <= 1.5e-5. Without synchronisation the same
    // tensors differ by 2e-4 to 0.44.
    EXPECT_LT(dmax / nmax, 5e-3) << name;
  }
  EXPECT_EQ(running, 6);  // three BatchNorms' running_mean and running_var were compared
  // The whole state as one vector: 5e-5 relative (measured 9.4e-6; the same rounding noise as
  // above; without synchronisation 1.2e-2).
  EXPECT_LT(std::sqrt(diff2 / norm2), 5e-5);
}

// Ranks launched with different configs (a script that passes per-rank --set) stop at start-up
// with one error naming the first key that differs, both values and the ranks, where before they
// failed later with a collective mismatch (train.steps) or, with a different lr, trained replicas
// that drifted apart without a word. The keys each rank may set for itself pass.
TEST(TrainCli, RanksWithDifferentConfigsStopAtStartNamingTheKey) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 2, 0);
  const std::string per_rank = kCli + " run --nproc-per-node 3 sh -c 'exec " + kCli + " train --config " + cfg +
                               " --out " + dir.path() + "/r$RANK --set train_batch_size=12 --set train.threads=$((RANK % 2 + 1))" +
                               " --set data.num_workers=$RANK --set log.progress=none";
  std::string out;
  ASSERT_EQ(run(per_rank + "'", &out), 0) << out;
  EXPECT_TRUE(fs::exists(dir.path() + "/r0/checkpoints/step_00000002")) << out;

  EXPECT_NE(run(per_rank + " --set optimizer.params.lr=0.00$((RANK + 1))'", &out), 0);
  EXPECT_NE(out.find("the config differs across ranks (ranks 1, 2 differ from rank 0): \"optimizer.params.lr\" is "
                     "0.001 on rank 0 and 0.002 on rank 1"),
            std::string::npos)
      << out;
  EXPECT_NE(run(per_rank + " --set seed=$((RANK / 2))'", &out), 0);
  EXPECT_NE(out.find("(rank 2 differs from rank 0): \"seed\" is 0 on rank 0 and 1 on rank 2"), std::string::npos) << out;
  EXPECT_EQ(out.find("collective mismatch"), std::string::npos) << out;
}

// data.path may differ per rank (node-local copies), but the data must not: ranks reading other
// files stop at start-up naming the dataset, what differs and both paths; identical copies train.
TEST(TrainCli, RanksReadingDifferentDataStopAtStartNamingThePaths) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 2, 0);
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + " of a small corpus for the data check\n";
  std::ofstream(dir.path() + "/copy0.txt") << text;
  std::ofstream(dir.path() + "/copy1.txt") << text;
  std::string other = text;  // the same size, other bytes everywhere (another version of the file)
  for (char& c : other) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  std::ofstream(dir.path() + "/other.txt") << text;
  std::ofstream(dir.path() + "/other1.txt") << other;
  const std::string launch = kCli + " run --nproc-per-node 2 sh -c 'exec " + kCli + " train --config " + cfg +
                             " --out " + dir.path() + "/r$RANK --set log.progress=none --set data.path=" + dir.path();
  std::string out;
  ASSERT_EQ(run(launch + "/copy$RANK.txt'", &out), 0) << out;
  // The same number of examples, other contents: told by the sampled examples.
  EXPECT_NE(run(launch + "/other$(test $RANK = 1 && echo 1).txt'", &out), 0);
  EXPECT_NE(out.find("the training data differs across ranks (rank 1 differs from rank 0): 48 examples on both, but "
                     "sampled examples differ between rank 0 and rank 1; data.path is \"" +
                     dir.path() + "/other.txt\" on rank 0 and \"" + dir.path() + "/other1.txt\" on rank 1"),
            std::string::npos)
      << out;
}

// --resume auto resolved per rank in a directory only that rank sees (node-local --out): rank 0
// finds its checkpoint, rank 1 none. Before, rank 0 trained from step 4 and rank 1 from step 0, rank
// 0 saved a step-6 checkpoint out of that mixture and left, and rank 1 failed with "rank 0 died".
// Now both stop at start-up naming both starts, and nothing new is saved.
TEST(TrainCli, RanksResumingFromDifferentCheckpointsStopAtStart) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 4, 2);
  const std::string launch = kCli + " run --nproc-per-node 2 sh -c 'exec " + kCli + " train --config " + cfg +
                             " --out " + dir.path() + "/r$RANK --set log.progress=none";
  std::string out;
  ASSERT_EQ(run(launch + "'", &out), 0) << out;
  ASSERT_TRUE(fs::exists(dir.path() + "/r0/checkpoints/step_00000004")) << out;
  ASSERT_FALSE(fs::exists(dir.path() + "/r1/checkpoints")) << out;  // rank 0 writes the checkpoints
  EXPECT_NE(run(launch + " --set train.steps=6 --resume auto'", &out), 0);
  EXPECT_NE(out.find("the ranks start from different checkpoints (rank 1 differs from rank 0): rank 0 resumes from " +
                     dir.path() + "/r0/checkpoints/step_00000004 at step 4, rank 1 starts fresh (no checkpoint)"),
            std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(dir.path() + "/r0/checkpoints/step_00000006")) << out;
}

TEST(TrainCli, ArgumentAndConfigErrors) {
  tandem::testing::TempDir dir;
  const std::string cfg = write_config(dir.path(), 2, 0);
  std::string out;
  EXPECT_EQ(run(kCli + " train --help", &out), 0);
  EXPECT_NE(out.find("usage: tandem train"), std::string::npos);
  EXPECT_NE(run(kCli + " train --bogus", &out), 0);
  EXPECT_NE(out.find("unknown argument \"--bogus\""), std::string::npos) << out;
  EXPECT_NE(run(kCli + " train --config " + cfg + " --set optimizer.params.lrate=1", &out), 0);
  EXPECT_NE(out.find("unknown key \"optimizer.params.lrate\" (did you mean \"optimizer.params.lr\"?)"), std::string::npos) << out;
  EXPECT_NE(run(kCli + " train --config " + cfg + " --set fp16.enabled=true", &out), 0);
  EXPECT_NE(out.find("both true"), std::string::npos) << out;
  EXPECT_NE(run(kCli + " train --config " + dir.path() + "/none.json", &out), 0);
  EXPECT_NE(out.find("cannot read"), std::string::npos) << out;
  EXPECT_EQ(run(kCli + " train --config " + cfg + " --print-config --set seed=9", &out), 0) << out;
  EXPECT_EQ(json::parse(out)["seed"], 9);
  // "2abc" was taken as 2.
  EXPECT_NE(run(kCli + " train --config " + cfg + " --stop-after 2abc", &out), 0);
  EXPECT_NE(out.find("--stop-after \"2abc\" is not a step number >= 1"), std::string::npos) << out;
  // A --summary-json that cannot be written is an error before training, not after it (no run
  // directory is made).
  EXPECT_NE(run(kCli + " train --config " + cfg + " --out " + dir.path() + "/never --summary-json " + dir.path() +
                    "/missing/dir/summary.json",
                &out),
            0);
  EXPECT_NE(out.find("--summary-json " + dir.path() + "/missing/dir/summary.json: cannot write"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/never"));
}

}  // namespace
}  // namespace tandem::train
