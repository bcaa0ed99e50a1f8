// The `tandem train` configuration: a JSON file with DeepSpeed's keys where DeepSpeed has one
// (train_batch_size, optimizer, scheduler, fp16, bf16, zero_optimization, ...) plus Tandem's own
// sections (model, data, train, amp, dist, log). Invariant: a Config only exists validated —
// every key known, every value of the right type and range, the batch triple consistent with the
// world size — so the trainer never re-checks a value.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/parallel/ddp.h"
#include "tandem/parallel/local_sgd.h"
#include "tandem/parallel/powersgd.h"

namespace tandem::train {

struct OptimizerConfig {
  std::string type = "SGD";  // SGD | Adam | AdamW
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;  // AdamW without the key: PyTorch's 1e-2
  double momentum = 0.0;      // SGD only
  bool nesterov = false;      // SGD only
};

// DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py), stepped once per optimizer step:
//   WarmupLR:       lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps
//                   (warmup_type "log": min + (max - min) * log(step + 1) / log(warmup_num_steps);
//                   "linear": proportional to step), then stays at warmup_max_lr.
//   WarmupDecayLR:  WarmupLR, then linear decay to 0 at total_num_steps.
//   WarmupCosineLR: ratio of the optimizer's lr: warmup from warmup_min_ratio to 1 over
//                   warmup_num_steps, then cosine down to cos_min_ratio at total_num_steps.
struct SchedulerConfig {
  std::string type;  // "" = constant lr
  double warmup_min_lr = 0.0;
  double warmup_max_lr = -1.0;  // < 0: the optimizer's lr
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // log | linear
  int64_t total_num_steps = 0;      // 0: the run's total steps
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  // The lr after `step` optimizer steps, for an optimizer lr `base` and a run of `total` steps.
  double lr_at(int64_t step, double base, int64_t total) const;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0: dynamic; > 0: static scale
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double min_loss_scale = 1.0;
};

struct ModelConfig {
  std::string name = "mlp";  // mlp | cnn | gpt | resnet18
  std::vector<int64_t> hidden = {1024, 1024};  // mlp
  int64_t num_classes = 10;                     // mlp, cnn, resnet18
  int64_t vocab_size = 256, context = 128, n_layer = 4, d_model = 256, n_head = 4;  // gpt
};

struct DataConfig {
  std::string name = "fashion_mnist";  // fashion_mnist | cifar10 | text | tokens
  std::string path;                    // "" = the dataset's default location
  int64_t num_workers = 0;             // DataLoader threads
  int64_t samples_per_epoch = 0;       // text/tokens: windows per epoch (0 = disjoint windows)
  int64_t eval_samples = 0;            // held-out examples evaluated (0 = all; text: 64 windows)
  // Drop each epoch's last, partial micro-batch (PyTorch's DataLoader drop_last). false, as
  // PyTorch's default and the examples: every training example is seen once per epoch.
  bool drop_last = false;
};

struct TrainLoopConfig {
  int64_t steps = 0;   // optimizer steps; 0 = epochs * micro-batches per epoch / accumulation steps
  int64_t epochs = 1;
  int64_t eval_every = 0;        // 0: only at the end
  int64_t checkpoint_every = 0;  // 0: only at the end
  int64_t keep_last = 3;
  int64_t threads = 1;
};

struct DistConfig {
  std::string backend = "shm";  // shm | gloo | mpi | nccl
  double timeout_s = 300;
};

// DistributedDataParallel on more than one process (zero_optimization.stage 0), and on one in
// deterministic mode; otherwise ignored on one process.
struct DdpConfig {
  // PyTorch's DDP arguments by name (bucket_cap_mb, broadcast_buffers, find_unused_parameters,
  // gradient_as_bucket_view, static_graph), Apex's delay_allreduce, and Tandem's
  // check_replicas_every and deterministic.
  // deterministic (also on one process): each rank's micro-batches are consecutive pieces of the
  // step's global batch (DistributedSampler block), summed in one fixed binary tree, so 1, 2, 4,
  // ... processes on the same train_batch_size and micro-batch size train bitwise-identical
  // weights. It needs a power-of-two accumulation count and a model without BatchNorm (mlp, gpt);
  // each epoch drops its last partial global batch.
  parallel::DDPOptions options;
  // "no" (f32 all-reduce), "fp16" or "bf16" (torch's fp16/bf16_compress_hook: f32 gradients sent
  // in 16 bits, accumulated in f32, cast back), "power_sgd" (powerSGD_hook with `power_sgd`'s
  // options, Accelerate's comm_state_option; its state goes into checkpoints) or
  // "post_local_sgd" (below). DeepSpeed's
  // top-level communication_data_type (fp32 | fp16 | bf16) sets the same wire dtype.
  std::string comm_hook = "no";
  // power_sgd only: "fp16" / "bf16" runs it through fp16/bf16_compress_wrapper (its factors and
  // small gradients sent in 16 bits); communication_data_type sets the same.
  std::string comm_wrapper = "no";
  parallel::PowerSGDOptions power_sgd;
  // "post_local_sgd": torch's post_localSGD_hook with these options (its subgroup: consecutive
  // groups of subgroup_size ranks, torch's new_subgroups; 0: the processes of one node,
  // LOCAL_WORLD_SIZE) and a PeriodicModelAverager(averaging_period, averaging_warmup_steps) (or a
  // HierarchicalModelAverager) after every optimizer step; checkpoints hold every rank's replica.
  parallel::PostLocalSGDOptions post_local;
  int64_t subgroup_size = 0;
  int64_t averaging_period = 0;
  // Instead of a period: HierarchicalModelAverager's (period, group size) pairs.
  std::vector<std::pair<int64_t, int64_t>> averaging_hierarchy;
  int64_t averaging_warmup_steps = 0;
  bool sync_batchnorm = false;  // convert_sync_batchnorm on the model (W2's BatchNorms)
  // DistributedDataParallel::register_fused_optimizer: the optimizer steps each bucket's
  // parameters inside backward as soon as its all-reduce completed (the same weights, bit for
  // bit). Not with gradient_clipping, fp16 or an amp.opt_level (they need every gradient before
  // the step); on one process (no DDP) the step runs after backward as usual.
  bool fused_optimizer = false;
};

struct LogConfig {
  bool jsonl = true;
  bool tensorboard = true;
  std::string progress = "auto";  // auto (bar on a TTY, lines otherwise) | bar | lines | none
};

struct Config {
  // ---- DeepSpeed's keys ----
  int64_t train_batch_size = 0;  // = micro * accumulation * world_size after resolution
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  double gradient_clipping = 0.0;  // 0: off
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  bool bf16 = false;
  int64_t zero_stage = 0;
  int64_t steps_per_print = 10;
  uint64_t seed = 0;
  // ---- Tandem's ----
  ModelConfig model;
  DataConfig data;
  TrainLoopConfig train;
  std::string opt_level;  // amp.opt_level: "" (autocast + GradScaler) or O0..O3
  DistConfig dist;
  DdpConfig ddp;
  LogConfig log;
  // The validated JSON this was built from (saved in checkpoints), and the world size the batch
  // triple was resolved for.
  nlohmann::json source;
  int world_size = 1;
};

// The embedded default: W1 on Fashion-MNIST, fp32, one thread. The recipe of
// examples/fashion_mnist_mlp (784-1024-1024-10 MLP, default init at seed 0, pixels standardised
// with the training set's mean 0.2860 and std 0.3530, SGD momentum 0.9, lr 0.05, batch 128, one
// epoch of all 60000 images in a shuffled order including the last partial batch, the full test
// set) plus one addition: the lr decays linearly from 0.05 to 0 over the epoch (WarmupDecayLR, no
// warmup). At a constant lr the last iterate's test accuracy swings by ~3 points from one
// evaluation to the next (82.7-85.5% over steps 350-468 at seed 0; the example's 85.75% is one
// draw of the same lottery with another shuffle); the decay lands at 86.5-86.8% for seeds 0-2.
// configs/mlp_{fp32,bf16,fp16}.json carry the same recipe.
nlohmann::json default_config_json();

// Applies one `--set key.path=value` to `j`: value is parsed as JSON when it is valid JSON
// (numbers, true/false, [..], "..") and taken as a string otherwise; missing objects on the path
// are created. Throws ValueError for a malformed override (no '=', empty key) naming it. The key
// itself is checked later by parse_config, like a key from the file.
void apply_override(nlohmann::json& j, const std::string& assignment);

// Validates `j` and builds the Config for `world_size` processes. Throws ValueError:
//  * unknown key: `config: unknown key "optimizer.parms" (did you mean "optimizer.params"?)`;
//  * wrong type or range: names the key, the value and what is expected;
//  * fp16.enabled and bf16.enabled both true;
//  * zero_optimization.stage 1-3: not implemented yet;
//  * ddp.comm_hook batched_power_sgd (not resumable), comm_state_option or comm_wrapper without
//    power_sgd, a communication_data_type that contradicts ddp.comm_hook / comm_wrapper, or
//    another wire dtype than the parameters' with amp O2/O3 (whose gradients are 16-bit);
//  * an inconsistent batch triple, showing the arithmetic
//    (train_batch_size 100 != micro 16 * accumulation 2 * world size 2 = 64).
Config parse_config(const nlohmann::json& j, int world_size = 1);

// Reads `path` (or the embedded default when empty), applies `overrides` in order, validates.
// Throws IOError for an unreadable file or invalid JSON (naming the path and the parser's
// message), ValueError as parse_config.
Config load_config(const std::string& path, const std::vector<std::string>& overrides, int world_size = 1);

// Whether every rank may set `key` for itself: where it reads its data (data.path: node-local
// copies), its loader workers and compute threads, its store timeout, its progress display. Every
// other key decides what the ranks compute together, so they must agree on it.
bool is_rank_local_key(const std::string& key);
const std::vector<std::string>& rank_local_keys();

// What the ranks of one training job must agree on: one line per key of the table that is not
// rank-local, in the table's order, "key = value" or "key = unset" (not given, or null). Numbers
// are written by value (4 and 4.0 read the same). `tandem train` compares these across ranks at
// start-up, where a rank launched with another config or --set would otherwise fail later with a
// collective mismatch, or (a different lr, seed, clipping) silently train other replicas.
std::vector<std::string> shared_config_lines(const nlohmann::json& source);

// Levenshtein distance (exposed for tests).
int64_t edit_distance(const std::string& a, const std::string& b);

}  // namespace tandem::train
