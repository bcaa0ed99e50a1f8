// Checkpoint directories: write under a temporary name, fsync, rename; load by validating
// everything before copying anything.
#include "tandem/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tandem/core/error.h"
#include "tandem/core/safetensors.h"
#include "tandem/dist/process_group.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kMasterFile = "master_weights.safetensors";
constexpr const char* kCommHookFile = "comm_hook.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kPrefix = "step_";

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, IOError, "checkpoint: cannot open {} to fsync it: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TANDEM_CHECK(rc == 0, IOError, "checkpoint: fsync {} failed: {}", path, std::strerror(err));
}

void write_file_durable(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TANDEM_CHECK(fd >= 0, IOError, "checkpoint: cannot create {}: {}", path, std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      throw IOError(fmt::format("checkpoint: writing {} failed: {}", path, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TANDEM_CHECK(rc == 0, IOError, "checkpoint: fsync {} failed: {}", path, std::strerror(err));
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  TANDEM_CHECK(f.good(), IOError, "checkpoint: cannot read {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    throw IOError(fmt::format("checkpoint: {} is not valid JSON (truncated?): {}", path, e.what()));
  }
}

// The step of a directory named step_N, or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0 || name.size() == std::strlen(kPrefix)) return -1;
  const std::string digits = name.substr(std::strlen(kPrefix));
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return -1;
  if (digits.size() > 18) return -1;  // not one of ours (and beyond int64): ignored like any stray directory
  return std::stoll(digits);
}

json state_to_json(const CheckpointState& s) {
  return {{"step", s.step},
          {"epoch", s.epoch},
          {"batches_consumed", s.batches_consumed},
          {"scheduler_step", s.scheduler_step},
          {"rng", {{"seed", s.rng_seed}, {"offset", s.rng_offset}}},
          {"scaler", s.scaler},
          {"config", s.config},
          {"extra", s.extra},
          {"format", "tandem-checkpoint-1"}};
}

CheckpointState state_from_json(const json& j, const std::string& path) {
  CheckpointState s;
  try {
    s.step = j.at("step").get<int64_t>();
    s.epoch = j.at("epoch").get<int64_t>();
    s.batches_consumed = j.at("batches_consumed").get<int64_t>();
    s.scheduler_step = j.at("scheduler_step").get<int64_t>();
    s.rng_seed = j.at("rng").at("seed").get<uint64_t>();
    s.rng_offset = j.at("rng").at("offset").get<uint64_t>();
    s.scaler = j.at("scaler").get<std::map<std::string, double>>();
    s.config = j.at("config");
    s.extra = j.value("extra", json::object());
  } catch (const json::exception& e) {
    throw IOError(fmt::format("checkpoint: {} lacks a field or has a wrong type: {}", path, e.what()));
  }
  return s;
}

// The optimizer state to save: amp's (for the f32 masters) when amp manages the optimizer.
optim::OptimizerState optimizer_state(const CheckpointTarget& t, std::vector<Tensor>* masters,
                                      std::map<std::string, double>* scaler) {
  if (t.amp) {
    amp::Amp::State s = t.amp->state_dict();
    *masters = std::move(s.master_params);
    *scaler = std::move(s.scaler);
    return std::move(s.optimizer);
  }
  return t.optimizer->state_dict();
}

std::vector<Tensor> optimizer_params(const optim::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& g : opt.param_groups()) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

// The target's replica, and amp's loss-scale state into `scaler` when amp manages the optimizer.
Replica replica_and_scaler(const CheckpointTarget& t, std::map<std::string, double>* scaler) {
  Replica r;
  r.model = t.model->state_dict();
  r.optimizer = optimizer_state(t, &r.masters, scaler);
  return r;
}

// Every tensor of a replica, in one fixed order (model, optimizer state by parameter then key,
// masters): the same shapes and dtypes on every rank, which trained the same model with the same
// optimizer.
std::vector<Tensor*> replica_tensors(Replica& r) {
  std::vector<Tensor*> out;
  for (auto& [name, t] : r.model) out.push_back(&t);
  for (auto& per_param : r.optimizer.state)
    for (auto& [key, t] : per_param) out.push_back(&t);
  for (Tensor& t : r.masters) out.push_back(&t);
  return out;
}

// A replica's three files into `dir`.
void write_replica(const std::string& dir, const Replica& r, const std::string& optimizer_name) {
  save_safetensors(dir + "/" + kModelFile, r.model);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < r.optimizer.state.size(); ++i) {
    for (const auto& [k, v] : r.optimizer.state[i]) tensors.emplace_back(fmt::format("state.{}.{}", i, k), v);
  }
  json groups = json::array();
  for (const auto& g : r.optimizer.param_groups) groups.push_back(g);
  json sizes = json::array();
  for (size_t n : r.optimizer.group_sizes) sizes.push_back(n);
  save_safetensors(dir + "/" + kOptimizerFile, tensors,
                   {{"param_groups", groups.dump()}, {"num_params", std::to_string(r.optimizer.state.size())},
                    {"group_sizes", sizes.dump()}, {"optimizer", optimizer_name}});
  if (!r.masters.empty()) {
    std::vector<std::pair<std::string, Tensor>> m;
    for (size_t i = 0; i < r.masters.size(); ++i) m.emplace_back(fmt::format("master.{}", i), r.masters[i]);
    save_safetensors(dir + "/" + kMasterFile, m);
  }
}

}  // namespace

Replica replica_of(const CheckpointTarget& target) {
  TANDEM_CHECK(target.model && target.optimizer, ValueError, "replica_of: the target needs a model and an optimizer");
  std::map<std::string, double> scaler;
  return replica_and_scaler(target, &scaler);
}

std::string replica_name(int rank) { return fmt::format("rank_{}", rank); }

std::vector<Replica> gather_replicas(const CheckpointTarget& target, dist::ProcessGroup& pg) {
  Replica mine = replica_of(target);
  const std::vector<Tensor*> parts = replica_tensors(mine);
  int64_t bytes = 0;
  for (const Tensor* t : parts) bytes += static_cast<int64_t>(t->nbytes());
  Tensor packed = empty({bytes}, kUInt8);
  auto* p = static_cast<uint8_t*>(packed.data_ptr());
  for (const Tensor* t : parts) {
    const Tensor c = t->contiguous();
    std::memcpy(p, c.data_ptr(), c.nbytes());
    p += c.nbytes();
  }
  const int world = pg.size();
  // The same structure everywhere, or the bytes would be cut in the wrong places: compare sizes
  // first (a parameter that got no gradient on one rank has no optimizer state there).
  Tensor sizes = empty({world}, kInt64), mine_size = full({1}, static_cast<double>(bytes), kInt64);
  pg.all_gather(dist::as_buffer(sizes), dist::as_buffer(mine_size))->wait();
  for (int r = 0; r < world; ++r) {
    const int64_t b = sizes.data_ptr<int64_t>()[r];
    TANDEM_CHECK(b == sizes.data_ptr<int64_t>()[0], ValueError,
                 "gather_replicas: rank {}'s model and optimizer state take {} bytes, rank 0's {}; their optimizer "
                 "states differ in structure (a parameter that got no gradient on some rank has no state there)",
                 r, b, sizes.data_ptr<int64_t>()[0]);
  }
  // all_gather (every backend has it; gloo has no gather): each rank briefly holds all replicas.
  Tensor all = empty({bytes * world}, kUInt8);
  pg.all_gather(dist::as_buffer(all), dist::as_buffer(packed))->wait();
  std::vector<Replica> others;
  if (pg.rank() != 0) return others;
  const auto* src = static_cast<const uint8_t*>(all.data_ptr());
  for (int r = 1; r < world; ++r) {
    Replica copy = mine;  // the structure; every tensor is replaced below
    const uint8_t* q = src + static_cast<size_t>(r) * static_cast<size_t>(bytes);
    for (Tensor* t : replica_tensors(copy)) {
      Tensor fresh = empty(t->shape(), t->dtype());
      std::memcpy(fresh.data_ptr(), q, fresh.nbytes());
      q += fresh.nbytes();
      *t = fresh;
    }
    others.push_back(std::move(copy));
  }
  return others;
}

std::string checkpoint_name(int64_t step) { return fmt::format("{}{:08d}", kPrefix, step); }

std::string save_checkpoint(const std::string& root, const CheckpointTarget& target, const CheckpointState& state,
                            int64_t keep_last, const std::vector<Replica>& other_ranks) {
  TANDEM_CHECK(target.model && target.optimizer, ValueError, "save_checkpoint: the target needs a model and an optimizer");
  TANDEM_CHECK(keep_last >= 1, ValueError, "save_checkpoint: keep_last is {}, expected >= 1", keep_last);
  std::error_code ec;
  fs::create_directories(root, ec);
  TANDEM_CHECK(!ec, IOError, "checkpoint: cannot create {}: {}", root, ec.message());
  const std::string name = checkpoint_name(state.step);
  const std::string final_dir = root + "/" + name;
  const std::string tmp = fmt::format("{}/.tmp.{}.{}", root, name, ::getpid());
  fs::remove_all(tmp, ec);
  bool exchanged = false;
  fs::create_directory(tmp, ec);
  TANDEM_CHECK(!ec, IOError, "checkpoint: cannot create {}: {}", tmp, ec.message());
  try {
    // ---- the files (each save_safetensors is itself fsync'ed) ----
    CheckpointState st = state;
    std::map<std::string, double> amp_scaler;
    const Replica mine = replica_and_scaler(target, &amp_scaler);
    if (target.amp) st.scaler = amp_scaler;
    write_replica(tmp, mine, target.optimizer->name());
    for (size_t i = 0; i < other_ranks.size(); ++i) {
      const std::string sub = tmp + "/" + replica_name(static_cast<int>(i) + 1);
      fs::create_directory(sub, ec);
      TANDEM_CHECK(!ec, IOError, "checkpoint: cannot create {}: {}", sub, ec.message());
      write_replica(sub, other_ranks[i], target.optimizer->name());
      fsync_path(sub, true);
    }
    if (!other_ranks.empty()) st.extra["replicas"] = other_ranks.size() + 1;
    if (!state.comm_hook.empty()) save_safetensors(tmp + "/" + kCommHookFile, state.comm_hook);
    write_file_durable(tmp + "/" + kStateFile, state_to_json(st).dump(1) + "\n");
    fsync_path(tmp, true);
    // ---- publish ----
    std::string aside;
    if (fs::exists(final_dir)) {
      // A checkpoint of this step exists: swap the two directories in one step (renameat2
      // RENAME_EXCHANGE), so that a crash leaves one of them under the name, never neither;
      // the old one, now under the temporary name, goes below. Where the file system cannot
      // exchange, move it aside first (a crash in between leaves it under .old.*).
      if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
        aside = tmp;
        exchanged = true;  // tmp holds the old checkpoint now: a failure below leaves it to the sweep
      } else {
        aside = fmt::format("{}/.old.{}.{}", root, name, ::getpid());
        fs::remove_all(aside, ec);
        fs::rename(final_dir, aside, ec);
        TANDEM_CHECK(!ec, IOError, "checkpoint: cannot move {} aside: {}", final_dir, ec.message());
      }
    }
    if (aside != tmp) {
      fs::rename(tmp, final_dir, ec);
      TANDEM_CHECK(!ec, IOError, "checkpoint: cannot rename {} to {}: {}", tmp, final_dir, ec.message());
    }
    fsync_path(root, true);
    if (!aside.empty()) fs::remove_all(aside, ec);
  } catch (...) {
    if (!exchanged) fs::remove_all(tmp, ec);
    throw;
  }
  // ---- retention: newest keep_last, and no leftovers of crashed saves ----
  std::vector<std::string> complete = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < complete.size(); ++i) fs::remove_all(complete[i], ec);
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp.", 0) == 0 || n.rfind(".old.", 0) == 0) fs::remove_all(e.path(), ec);
  }
  return final_dir;
}

nlohmann::json checkpoint_config(const std::string& dir) {
  const std::string path = dir + "/" + kStateFile;
  return state_from_json(read_json(path), path).config;
}

int64_t checkpoint_step(const std::string& dir) {
  const std::string path = dir + "/" + kStateFile;
  return state_from_json(read_json(path), path).step;
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step < 0 || !e.is_directory(ec)) continue;
    const std::string state_path = e.path().string() + "/" + kStateFile;
    try {
      (void)state_from_json(read_json(state_path), state_path);
    } catch (const Error&) {
      continue;  // not a checkpoint this code wrote completely
    }
    found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, p] : found) out.push_back(std::move(p));
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  std::vector<std::string> all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

CheckpointState load_checkpoint(const std::string& top, const CheckpointTarget& target, int rank, int world) {
  TANDEM_CHECK(target.model && target.optimizer, ValueError, "load_checkpoint: the target needs a model and an optimizer");
  // ---- read everything ----
  const std::string state_path = top + "/" + kStateFile;
  CheckpointState st = state_from_json(read_json(state_path), state_path);
  // This rank's files: rank 0's at the top, another rank's replica in its subdirectory.
  const int64_t replicas = st.extra.value("replicas", int64_t{0});
  const bool own = world > 0;  // each rank its own replica, or rank 0's everywhere
  TANDEM_CHECK(replicas == 0 || !own || (replicas == world && rank < world), ValueError,
               "load_checkpoint: {} holds the replicas of {} ranks (they trained apart), this run has {}; resume it with {} "
               "processes (or start a new run directory)",
               top, replicas, world, replicas);
  const std::string dir = replicas > 0 && own && rank > 0 ? top + "/" + replica_name(rank) : top;
  TANDEM_CHECK(fs::is_directory(dir), IOError,
               "load_checkpoint: {} has no {}/ (rank {}'s replica); restore it or resume from another checkpoint", top,
               replica_name(rank), rank);
  const SafetensorsFile model_file = load_safetensors(dir + "/" + kModelFile);
  const SafetensorsFile opt_file = load_safetensors(dir + "/" + kOptimizerFile);
  std::optional<SafetensorsFile> master_file;
  const bool want_masters = target.amp && !target.amp->master_params().empty();
  if (want_masters) master_file = load_safetensors(dir + "/" + kMasterFile);
  if (fs::exists(top + "/" + kCommHookFile)) {
    const SafetensorsFile hook_file = load_safetensors(top + "/" + kCommHookFile);
    for (const auto& [name, t] : hook_file.tensors) st.comm_hook.emplace_back(name, t);
  }

  // ---- check the model: every name both ways, every shape ----
  const nn::StateDict live = target.model->state_dict();
  for (const auto& [name, t] : live) {
    TANDEM_CHECK(model_file.contains(name), ValueError,
                 "load_checkpoint: {}/{} has no tensor \"{}\" (shape {}) that this model has; the checkpoint is of a "
                 "different model",
                 dir, kModelFile, name, shape_str(t.shape()));
    const Tensor& saved = model_file.at(name);
    TANDEM_CHECK(saved.shape() == t.shape(), ValueError,
                 "load_checkpoint: tensor \"{}\" has shape {} in {}/{}, but {} in this model; the checkpoint is of a "
                 "different model",
                 name, shape_str(saved.shape()), dir, kModelFile, shape_str(t.shape()));
  }
  for (const auto& [name, t] : model_file.tensors) {
    const bool known = std::any_of(live.begin(), live.end(), [&](const auto& p) { return p.first == name; });
    TANDEM_CHECK(known, ValueError,
                 "load_checkpoint: {}/{} holds tensor \"{}\" (shape {}) that this model does not have; the checkpoint "
                 "is of a different model",
                 dir, kModelFile, name, shape_str(t.shape()));
  }

  // ---- check the optimizer state against the optimizer's parameters ----
  const std::vector<Tensor> params = optimizer_params(*target.optimizer);
  optim::OptimizerState os;
  // A whole non-negative decimal number, or an IOError naming the file and what held it.
  auto index = [&](const std::string& text, const std::string& what) -> size_t {
    size_t v = 0;
    const char* end = text.data() + text.size();
    auto [ptr, err] = std::from_chars(text.data(), end, v);
    TANDEM_CHECK(!text.empty() && err == std::errc() && ptr == end, IOError,
                 "load_checkpoint: {}/{}: {} \"{}\" is not a parameter count or index; the file is not one this "
                 "code wrote",
                 dir, kOptimizerFile, what, text);
    return v;
  };
  const auto meta = [&](const char* key) -> const std::string& {
    auto it = opt_file.metadata.find(key);
    TANDEM_CHECK(it != opt_file.metadata.end(), IOError, "load_checkpoint: {}/{} lacks the \"{}\" metadata", dir,
                 kOptimizerFile, key);
    return it->second;
  };
  try {
    const json groups = json::parse(meta("param_groups"));
    for (const json& g : groups) os.param_groups.push_back(g.get<optim::Options>());
    if (auto it = opt_file.metadata.find("group_sizes"); it != opt_file.metadata.end()) {
      os.group_sizes = json::parse(it->second).get<std::vector<size_t>>();
    }
  } catch (const json::exception& e) {
    throw IOError(fmt::format("load_checkpoint: {}/{}: bad param_groups/group_sizes metadata: {}", dir, kOptimizerFile,
                              e.what()));
  }
  const size_t n = index(meta("num_params"), "num_params");
  TANDEM_CHECK(n == params.size(), ValueError,
               "load_checkpoint: {}/{} holds state for {} parameters, this optimizer has {}", dir, kOptimizerFile, n,
               params.size());
  if (auto it = opt_file.metadata.find("optimizer"); it != opt_file.metadata.end()) {
    TANDEM_CHECK(it->second == target.optimizer->name(), ValueError,
                 "load_checkpoint: {}/{} holds the state of a {} optimizer, this run's optimizer is {}; resume with "
                 "the optimizer that saved it",
                 dir, kOptimizerFile, it->second, target.optimizer->name());
  }
  TANDEM_CHECK(os.param_groups.size() == target.optimizer->param_groups().size(), ValueError,
               "load_checkpoint: {}/{} has {} parameter groups, this optimizer has {}", dir, kOptimizerFile,
               os.param_groups.size(), target.optimizer->param_groups().size());
  os.state.resize(params.size());
  for (const auto& [name, t] : opt_file.tensors) {
    // "state.<i>.<key>"
    const size_t d1 = name.find('.'), d2 = name.find('.', d1 + 1);
    TANDEM_CHECK(name.rfind("state.", 0) == 0 && d2 != std::string::npos, IOError,
                 "load_checkpoint: {}/{}: unexpected tensor \"{}\"", dir, kOptimizerFile, name);
    const size_t i = index(name.substr(d1 + 1, d2 - d1 - 1), "tensor " + name + "'s parameter index");
    TANDEM_CHECK(i < params.size(), ValueError, "load_checkpoint: {}/{}: tensor \"{}\" is for parameter {} of {}", dir,
                 kOptimizerFile, name, i, params.size());
    os.state[i][name.substr(d2 + 1)] = t;
  }
  // Shapes, dtypes, names and completeness of the state, as load_state_dict will check them.
  try {
    target.optimizer->check_state_dict(os);
  } catch (const Error& e) {
    throw ValueError(fmt::format("load_checkpoint: {}/{}: {}", dir, kOptimizerFile, e.what()));
  }
  amp::Amp::State amp_state;
  if (target.amp) {
    if (want_masters) {
      const auto& masters = target.amp->master_params();
      TANDEM_CHECK(master_file->tensors.size() == masters.size(), ValueError,
                   "load_checkpoint: {}/{} holds {} master weights, this run has {}", dir, kMasterFile,
                   master_file->tensors.size(), masters.size());
      for (size_t i = 0; i < masters.size(); ++i) {
        const Tensor& m = master_file->at(fmt::format("master.{}", i));
        TANDEM_CHECK(m.shape() == masters[i].shape(), ValueError,
                     "load_checkpoint: master weight \"master.{}\" has shape {} in {}/{}, but {} here", i,
                     shape_str(m.shape()), dir, kMasterFile, shape_str(masters[i].shape()));
        amp_state.master_params.push_back(m);
      }
    }
    for (const char* k : {"scale", "_growth_tracker", "_hysteresis_left"}) {
      TANDEM_CHECK(st.scaler.count(k), ValueError, "load_checkpoint: {}/{} has no amp loss-scale \"{}\"", top, kStateFile, k);
    }
    amp_state.scaler = st.scaler;
  }

  // The loss scale (amp's or the trainer's GradScaler's) must be usable before anything loads:
  // a NaN, zero or negative one would be refused only after the model was replaced.
  if (auto it = st.scaler.find("scale"); it != st.scaler.end()) {
    TANDEM_CHECK(std::isfinite(it->second) && it->second > 0, ValueError,
                 "load_checkpoint: {}/{} holds loss scale {}; a loss scale must be finite and positive", top,
                 kStateFile, it->second);
  }

  // ---- everything checked: copy in ----
  target.model->load_state_dict(model_file.tensors, /*strict=*/true);
  if (target.amp) {
    amp_state.optimizer = std::move(os);
    target.amp->load_state_dict(amp_state);
  } else {
    target.optimizer->load_state_dict(os);
  }
  return st;
}

}  // namespace tandem::train
