// Training checkpoints: one directory per saved step holding everything a run needs to resume
// exactly. Invariant: a directory named step_NNNNNNNN under the root is always complete — it is
// written under a temporary name, every file and the directory are fsync'ed, and only then is it
// renamed into place — so a crash at any moment leaves the previous checkpoint intact.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/amp/initialize.h"
#include "tandem/dist/process_group.h"
#include "tandem/nn/module.h"
#include "tandem/optim/optimizer.h"

namespace tandem::train {

// A checkpoint directory's files:
//   model.safetensors     module.state_dict() under PyTorch's names (torch's load_state_dict reads it)
//   optimizer.safetensors per-parameter state "state.<i>.<key>" (i over all groups' parameters, in
//                         order); metadata "param_groups" (JSON list of each group's options)
//   master_weights.safetensors  f32 master copies "master.<i>" (amp O2 only)
//   comm_hook.safetensors the DDP communication hook's tensors (PowerSGD: every rank's error
//                         feedback, the warm-start Qs), when it has state
//   rank_<r>/             rank r's replica (model, optimizer, master_weights files as above), for
//                         r = 1 .. world-1, when the ranks' replicas may differ (post-local SGD);
//                         the files above are rank 0's
//   trainer_state.json    step, sampler epoch and position, scheduler step, RNG (seed, offset),
//                         loss-scaler state, the config, and free-form extras
struct CheckpointState {
  int64_t step = 0;              // optimizer steps done
  int64_t epoch = 0;             // the data loader's epoch
  int64_t batches_consumed = 0;  // micro-batches of that epoch already taken
  int64_t scheduler_step = 0;
  uint64_t rng_seed = 0, rng_offset = 0;  // the training thread's default generator
  std::map<std::string, double> scaler;   // GradScaler / amp loss-scale state; empty: none
  nlohmann::json config;                  // the validated config of the run
  nlohmann::json extra = nlohmann::json::object();  // e.g. skipped-step counts, metrics
  // comm_hook.safetensors (written when not empty; read when present). Its scalars go in `extra`.
  std::vector<std::pair<std::string, Tensor>> comm_hook;
};

// The live objects a checkpoint is taken from and restored into. `amp` (optional) takes over the
// optimizer state, the f32 masters and the loss scale when it manages the optimizer.
struct CheckpointTarget {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  amp::Amp* amp = nullptr;
};

// What one rank holds when the ranks train apart (post-local SGD between averagings): its model
// state, its optimizer's per-parameter state and (amp O2) its f32 masters.
struct Replica {
  nn::StateDict model;
  optim::OptimizerState optimizer;
  std::vector<Tensor> masters;
};
// The live replica of `target` (tensors shared with the model; optimizer state and masters copied).
Replica replica_of(const CheckpointTarget& target);

// Every rank's replica on rank 0, for a checkpoint of ranks that trained apart: ranks 1..world-1
// in order there, empty elsewhere. A collective every rank of `group` makes. Each rank sends its
// replica as raw bytes in one fixed order (model, optimizer state by parameter then key, masters)
// through an all_gather (so every rank briefly holds world x its replica's bytes), read back on
// rank 0 into tensors shaped like its own; ranks whose replicas differ in size are
// refused (ValueError naming the rank and both sizes, on every rank): their optimizer states
// differ in structure.
std::vector<Replica> gather_replicas(const CheckpointTarget& target, dist::ProcessGroup& group);

// "step_00000012".
std::string checkpoint_name(int64_t step);
// "rank_3": the subdirectory of rank 3's replica.
std::string replica_name(int rank);

// Writes a checkpoint of `target` and `state` to root/checkpoint_name(state.step), atomically
// (temporary directory ".tmp.<name>.<pid>", files and directory fsync'ed, rename, root fsync'ed),
// then deletes all but the newest `keep_last` checkpoints and any temporary left by a crashed save.
// An existing checkpoint of the same step is replaced by exchanging the two directories in one
// rename (RENAME_EXCHANGE; where the file system cannot, it is moved aside first). Blocks until durable; returns the directory. Throws IOError naming the path and
// the OS error; on failure the temporary is removed and existing checkpoints are untouched.
// Call from one process only (rank 0): the checkpoint holds one replica of the model, plus
// `other_ranks[i]` as rank i+1's replica (in rank_<i+1>/, inside the same atomic directory) when
// the ranks' replicas differ; then trainer_state.json's extra "replicas" counts them.
std::string save_checkpoint(const std::string& root, const CheckpointTarget& target, const CheckpointState& state,
                            int64_t keep_last, const std::vector<Replica>& other_ranks = {});

// The complete checkpoints under `root`, oldest first (directories named step_N holding a
// readable trainer_state.json; temporaries are ignored). Empty when root does not exist.
std::vector<std::string> list_checkpoints(const std::string& root);
// The newest complete checkpoint under `root` (`--resume auto`), or nullopt.
std::optional<std::string> latest_checkpoint(const std::string& root);
// The config the checkpoint in `dir` was saved with (trainer_state.json's "config"). Throws IOError
// naming the file when it is missing or unreadable.
nlohmann::json checkpoint_config(const std::string& dir);
// The optimizer step the checkpoint in `dir` was saved at (trainer_state.json's "step"). Throws
// IOError as checkpoint_config.
int64_t checkpoint_step(const std::string& dir);

// Reads every file of the checkpoint in `dir`, checks it against `target` (every model tensor
// name and shape, the optimizer's parameter count and state shapes, the masters), and only then
// copies the values in. Returns the saved CheckpointState. Throws IOError for a missing or
// truncated file (naming it) and ValueError naming the tensor and both shapes for a model that
// differs; in every error case nothing in `target` has changed. A checkpoint saved with the ranks'
// replicas (extra "replicas": their count) gives rank `rank` of `world` its own (rank_<rank>/ for
// rank > 0), and is refused, naming both counts, when `world` differs (a rank would lack one, or
// replicas would be dropped). world = 0 asks for rank 0's replica on every rank instead (a run
// that continues with identical replicas). Without replicas every rank loads the one.
CheckpointState load_checkpoint(const std::string& dir, const CheckpointTarget& target, int rank = 0, int world = 0);

}  // namespace tandem::train
