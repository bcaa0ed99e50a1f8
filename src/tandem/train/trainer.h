// The training loop behind `tandem train`: builds the model, data, optimizer, schedule and
// precision from a Config, joins the process group when launched with WORLD_SIZE > 1, trains with
// DDP, logs, evaluates, checkpoints and resumes. Invariant: a run resumed from a checkpoint takes
// exactly the steps the uninterrupted run would have taken — same batches, same RNG, same
// optimizer, scheduler and loss-scale state — so its weights are bitwise equal.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "tandem/train/config.h"

namespace tandem::train {

struct TrainerOptions {
  std::string out_dir = "runs/train";  // checkpoints/, metrics.jsonl, tensorboard/, summary.json
  // "" (fresh run), "auto" (the newest complete checkpoint under out_dir/checkpoints, or a fresh
  // run when there is none), or a checkpoint directory.
  std::string resume;
  std::FILE* out = stdout;  // progress and messages (rank 0)
  // Testing aid: return right after step `stop_after` (and its checkpoint, when one is due), as if
  // the process had been killed there. -1: run to the end.
  int64_t stop_after = -1;
  // Set (e.g. by a SIGTERM/SIGINT handler) to stop gracefully: all ranks agree on it after the
  // current step (one small all-reduce per step), save a checkpoint and return with interrupted.
  // Null: never checked.
  const std::atomic<bool>* stop_requested = nullptr;
};

// What a run reports (summary.json): the examples' --summary-json fields plus the run's own.
struct TrainSummary {
  int64_t steps = 0;              // optimizer steps done in total (including before a resume)
  int64_t skipped_steps = 0;      // steps skipped for inf/nan gradients
  double final_loss = 0;          // mean training loss (all-reduced) of the last min(50, steps) steps
  double eval_loss = -1;          // last evaluation's mean loss; -1 when none ran
  double test_accuracy = -1;      // classifiers: last evaluation's accuracy; -1 otherwise
  double samples_per_s = 0;       // global samples per second over this process's steps
  double tokens_per_s = 0;        // gpt only
  int64_t context = 0;            // gpt only: tokens per sample
  int64_t peak_bytes = 0;         // the CPU allocator's peak during training (this rank)
  double train_seconds = 0;
  double loss_scale = 1;
  std::string precision;          // "fp32", "bf16 autocast", "fp16 autocast + GradScaler", "bf16 amp O2", ...
  int world_size = 1;
  int64_t batch_size = 0;         // train_batch_size (global)
  int64_t epochs = 0;             // epochs started
  int threads = 1;
  bool interrupted = false;       // stopped by stop_after or stop_requested
  std::string last_checkpoint;
  nlohmann::json to_json() const;
};

// Runs the training `config` describes (config.world_size must equal the launch's world size).
// Blocks until done. Rank 0 writes out_dir; every rank trains. Throws tandem::Error subclasses for
// bad data paths, a checkpoint that does not fit, communication failures (dist errors).
TrainSummary run_training(const Config& config, const TrainerOptions& options = {});

// Writes `text` to path.tmp, checking every write (a full disk is an IOError naming the file),
// then renames it to `path`: readers see the old file or the whole new one.
void write_text_atomically(const std::string& path, const std::string& text);

}  // namespace tandem::train
