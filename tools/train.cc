// tandem train: the config-driven training job (src/tandem/train/trainer.h). Runs alone or under
// `tandem run` / mpirun / srun (the launch environment gives the world size). Only argument
// parsing lives here; errors become a message and an exit code.
#include <pthread.h>
#include <unistd.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/dist/process_group.h"
#include "tandem/train/config.h"
#include "tandem/train/trainer.h"
#include "tools/commands.h"

namespace tandem::tools {
namespace {

constexpr const char* kUsage =
    "usage: tandem train [--config FILE.json] [--set key.path=value ...] [--resume auto|DIR] [--out DIR]\n"
    "                    [--summary-json PATH] [--print-config]\n"
    "\n"
    "Trains the model a JSON config describes (DeepSpeed's keys: train_batch_size,\n"
    "train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping, optimizer,\n"
    "scheduler, fp16, bf16, zero_optimization, communication_data_type, steps_per_print, seed;\n"
    "Tandem's: model, data, train, amp, dist, ddp, log). Without --config: W1, the 784-1024-1024-10\n"
    "MLP on Fashion-MNIST for one epoch (SGD momentum 0.9, lr 0.05 decaying linearly to 0, batch 128;\n"
    "`--print-config` shows it all). Under `tandem run --nproc-per-node N` each process trains its\n"
    "share with DDP; the ddp section sets its options (bucket_cap_mb, find_unused_parameters,\n"
    "static_graph, comm_hook no|fp16|bf16|power_sgd|post_local_sgd, model_averaging.period|hierarchy,\n"
    "sync_batchnorm, deterministic, ...).\n"
    "\n"
    "  --config FILE     the JSON config (configs/ has W1-W3 in fp32, bf16 and fp16)\n"
    "  --set K=V         override one key, e.g. --set optimizer.params.lr=0.01 (V is JSON or a string)\n"
    "  --resume auto     continue from the newest complete checkpoint under OUT/checkpoints (fresh if none)\n"
    "  --resume DIR      continue from that checkpoint directory\n"
    "  --out DIR         run directory: checkpoints/, metrics.jsonl, tensorboard/, summary.json\n"
    "                    (default runs/<config name>, or runs/default)\n"
    "  --summary-json P  also write the final summary to P\n"
    "  --print-config    print the validated config and exit\n"
    "  --stop-after N    testing aid: stop after step N (and its checkpoint), as if killed there\n"
    "\n"
    "SIGTERM or SIGINT (Ctrl-C) checkpoints after the current step and exits with 128 + the signal;\n"
    "a second one kills at once.\n";

// SIGTERM / SIGINT: the first asks the trainer to checkpoint and stop after the current step; a
// second one terminates the process (the default action). They are taken by a thread of their own
// with sigwait(), never by a handler: a handler runs on the stack of whichever thread the signal
// interrupts, and Debian's oneDNN 2.6 AVX-512 sgemm keeps data below its stack pointer, so a
// signal landing inside dnnl_sgemm corrupted the heap ("corrupted size vs. prev_size": 1 stop in
// ~10 of a widened-bf16 run; a loop of sgemm calls under a 37 us timer aborts at once, and runs
// clean with the handler on an alternate stack or with oneDNN held to AVX2).
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

// Blocks SIGTERM and SIGINT in the calling thread, so in every thread started after it (call it
// before any), and starts the thread that waits for them.
void take_stop_signals_on_a_thread() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (g_stop.exchange(true)) {
        ::signal(sig, SIG_DFL);
        pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
        ::raise(sig);
        return;
      }
      g_signal.store(sig);
    }
  }).detach();
}

std::string stem(const std::string& path) {
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  const size_t dot = base.rfind('.');
  return dot == std::string::npos ? base : base.substr(0, dot);
}

}  // namespace

int train_main(int argc, char** argv) try {
  take_stop_signals_on_a_thread();  // first: before any other thread starts
  std::string config_path, out_dir, summary_path;
  std::vector<std::string> sets;
  train::TrainerOptions opts;
  bool print_config = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ValueError(fmt::format("tandem train: {} needs a value (see `tandem train --help`)", a));
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::printf("%s", kUsage);
      return 0;
    } else if (a == "--config") {
      config_path = value();
    } else if (a == "--set") {
      sets.push_back(value());
    } else if (a == "--resume") {
      opts.resume = value();
    } else if (a == "--out") {
      out_dir = value();
    } else if (a == "--summary-json") {
      summary_path = value();
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--stop-after") {
      const std::string v = value();
      int64_t n = 0;
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
      if (ec != std::errc() || end != v.data() + v.size() || n < 1) {  // "2abc" was taken as 2
        throw ValueError(fmt::format("tandem train: --stop-after \"{}\" is not a step number >= 1", v));
      }
      opts.stop_after = n;
    } else {
      throw ValueError(fmt::format("tandem train: unknown argument \"{}\" (see `tandem train --help`)", a));
    }
  }
  const dist::LaunchEnv env = dist::read_launch_env();
  const train::Config cfg = train::load_config(config_path, sets, std::max(1, env.world_size));
  if (print_config) {
    std::printf("%s\n", cfg.source.dump(2).c_str());
    return 0;
  }
  opts.out_dir = !out_dir.empty() ? out_dir : "runs/" + (config_path.empty() ? std::string("default") : stem(config_path));
  opts.stop_requested = &g_stop;
  const bool writes_summary = !summary_path.empty() && std::max(0, env.rank) == 0;
  if (writes_summary) {
    // Before training, not after it: a directory the summary cannot be written into (it goes
    // through a temporary file there) is an error now.
    const std::filesystem::path p(summary_path);
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec))
      throw IOError(fmt::format("tandem train: --summary-json {} is a directory; give a file name (e.g. {}/summary.json)",
                                summary_path, summary_path));
    const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
    if (access(dir.c_str(), W_OK) != 0) {
      throw IOError(fmt::format("tandem train: --summary-json {}: cannot write {}: {}", summary_path, dir,
                                std::strerror(errno)));
    }
  }
  const train::TrainSummary s = train::run_training(cfg, opts);
  if (writes_summary) train::write_text_atomically(summary_path, s.to_json().dump(2) + "\n");
  // Stopped by a signal: the shell's code for it (130 SIGINT, 143 SIGTERM), after the checkpoint.
  if (s.interrupted && g_signal.load() != 0) return 128 + g_signal.load();
  return 0;
} catch (const std::exception& e) {
  return report(e);
}

}  // namespace tandem::tools
