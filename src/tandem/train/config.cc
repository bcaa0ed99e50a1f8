// Config validation works from one table of every valid key (kSpecs): the walk over the user's
// JSON checks each key against it, so a key added to the table is known, typed and range-checked
// at once, and the "did you mean" suggestion searches the same table.
#include "tandem/train/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numbers>
#include <set>
#include <sstream>

#include <fmt/ranges.h>

#include "tandem/core/error.h"

namespace tandem::train {
namespace {

using nlohmann::json;

enum class Kind { Int, Number, Bool, String, Enum, IntList, IntPairs, Betas, Object };

struct Spec {
  const char* path;
  Kind kind;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices = {};
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// Every leaf key. Objects are implied by the dotted prefixes. `scheduler.params` holds the union
// of the three schedules' parameters.
const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"train_batch_size", Kind::Int, 1, kInf},
      {"train_micro_batch_size_per_gpu", Kind::Int, 1, kInf},
      {"gradient_accumulation_steps", Kind::Int, 1, kInf},
      {"gradient_clipping", Kind::Number, 0, kInf},
      {"steps_per_print", Kind::Int, 1, kInf},
      {"seed", Kind::Int, 0, 9007199254740992.0},
      {"optimizer.type", Kind::Enum, 0, 0, {"SGD", "Adam", "AdamW"}},
      {"optimizer.params.lr", Kind::Number, 0, kInf},
      {"optimizer.params.betas", Kind::Betas},
      {"optimizer.params.eps", Kind::Number, 0, kInf},
      {"optimizer.params.weight_decay", Kind::Number, 0, kInf},
      {"optimizer.params.momentum", Kind::Number, 0, 1},
      {"optimizer.params.nesterov", Kind::Bool},
      {"scheduler.type", Kind::Enum, 0, 0, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}},
      {"scheduler.params.warmup_min_lr", Kind::Number, 0, kInf},
      {"scheduler.params.warmup_max_lr", Kind::Number, 0, kInf},
      {"scheduler.params.warmup_num_steps", Kind::Int, 0, kInf},
      {"scheduler.params.warmup_type", Kind::Enum, 0, 0, {"log", "linear"}},
      {"scheduler.params.total_num_steps", Kind::Int, 0, kInf},
      {"scheduler.params.warmup_min_ratio", Kind::Number, 0, 1},
      {"scheduler.params.cos_min_ratio", Kind::Number, 0, 1},
      {"fp16.enabled", Kind::Bool},
      {"fp16.loss_scale", Kind::Number, 0, kInf},
      {"fp16.initial_scale_power", Kind::Int, 0, 100},
      {"fp16.loss_scale_window", Kind::Int, 1, kInf},
      {"fp16.hysteresis", Kind::Int, 1, kInf},
      {"fp16.min_loss_scale", Kind::Number, 0, kInf},
      {"bf16.enabled", Kind::Bool},
      {"zero_optimization.stage", Kind::Int, 0, 3},
      {"communication_data_type", Kind::Enum, 0, 0, {"fp32", "fp16", "bf16", "bfp16"}},
      {"model.name", Kind::Enum, 0, 0, {"mlp", "cnn", "gpt", "resnet18"}},
      {"model.hidden", Kind::IntList, 1, kInf},
      {"model.num_classes", Kind::Int, 1, kInf},
      {"model.vocab_size", Kind::Int, 1, kInf},
      {"model.context", Kind::Int, 1, kInf},
      {"model.n_layer", Kind::Int, 1, kInf},
      {"model.d_model", Kind::Int, 1, kInf},
      {"model.n_head", Kind::Int, 1, kInf},
      {"data.name", Kind::Enum, 0, 0, {"fashion_mnist", "cifar10", "text", "tokens"}},
      {"data.path", Kind::String},
      {"data.num_workers", Kind::Int, 0, 256},
      {"data.samples_per_epoch", Kind::Int, 0, kInf},
      {"data.eval_samples", Kind::Int, 0, kInf},
      {"data.drop_last", Kind::Bool},
      {"train.steps", Kind::Int, 0, kInf},
      {"train.epochs", Kind::Int, 0, kInf},
      {"train.eval_every", Kind::Int, 0, kInf},
      {"train.checkpoint_every", Kind::Int, 0, kInf},
      {"train.keep_last", Kind::Int, 1, kInf},
      {"train.threads", Kind::Int, 1, 1024},
      {"amp.opt_level", Kind::Enum, 0, 0, {"", "O0", "O1", "O2", "O3"}},
      {"dist.backend", Kind::Enum, 0, 0, {"shm", "gloo", "mpi", "nccl"}},
      {"dist.timeout_s", Kind::Number, 0.001, 1e6},  // at most 11.6 days: deadlines in ms must not overflow
      {"ddp.bucket_cap_mb", Kind::Number, 1e-6, kInf},
      {"ddp.broadcast_buffers", Kind::Bool},
      {"ddp.find_unused_parameters", Kind::Bool},
      {"ddp.gradient_as_bucket_view", Kind::Bool},
      {"ddp.static_graph", Kind::Bool},
      {"ddp.delay_allreduce", Kind::Bool},
      {"ddp.fused_optimizer", Kind::Bool},
      {"ddp.comm_hook", Kind::Enum, 0, 0, {"no", "fp16", "bf16", "power_sgd", "batched_power_sgd", "post_local_sgd"}},
      {"ddp.comm_wrapper", Kind::Enum, 0, 0, {"no", "fp16", "bf16"}},
      {"ddp.comm_state_option.matrix_approximation_rank", Kind::Int, 1, kInf},
      {"ddp.comm_state_option.start_powerSGD_iter", Kind::Int, 0, kInf},
      {"ddp.comm_state_option.min_compression_rate", Kind::Number, 0, kInf},
      {"ddp.comm_state_option.use_error_feedback", Kind::Bool},
      {"ddp.comm_state_option.warm_start", Kind::Bool},
      {"ddp.comm_state_option.orthogonalization_epsilon", Kind::Number, 0, kInf},
      {"ddp.comm_state_option.random_seed", Kind::Int, 0, 9007199254740992.0},
      {"ddp.comm_state_option.start_localSGD_iter", Kind::Int, 0, kInf},
      {"ddp.comm_state_option.post_local_gradient_allreduce", Kind::Bool},
      {"ddp.comm_state_option.subgroup_size", Kind::Int, 1, kInf},
      {"ddp.model_averaging.period", Kind::Int, 1, kInf},
      {"ddp.model_averaging.warmup_steps", Kind::Int, 0, kInf},
      {"ddp.model_averaging.hierarchy", Kind::IntPairs},
      {"ddp.sync_batchnorm", Kind::Bool},
      {"ddp.deterministic", Kind::Bool},
      {"ddp.check_replicas_every", Kind::Int, 0, kInf},
      {"log.jsonl", Kind::Bool},
      {"log.tensorboard", Kind::Bool},
      {"log.progress", Kind::Enum, 0, 0, {"auto", "bar", "lines", "none"}},
  };
  return s;
}

const Spec* find_spec(const std::string& path) {
  for (const Spec& s : specs()) {
    if (path == s.path) return &s;
  }
  return nullptr;
}

bool is_object_path(const std::string& path) {
  const std::string prefix = path + ".";
  return std::any_of(specs().begin(), specs().end(),
                     [&](const Spec& s) { return std::string(s.path).rfind(prefix, 0) == 0; });
}

// The valid names directly under `parent` ("" = top level).
std::vector<std::string> children_of(const std::string& parent) {
  std::vector<std::string> out;
  const std::string prefix = parent.empty() ? "" : parent + ".";
  for (const Spec& s : specs()) {
    const std::string p = s.path;
    if (p.rfind(prefix, 0) != 0) continue;
    const std::string rest = p.substr(prefix.size());
    const std::string name = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

std::string join_path(const std::string& parent, const std::string& key) { return parent.empty() ? key : parent + "." + key; }

// The nearest valid key to an unknown `parent.key`: a sibling within a few edits, else any key in
// the table whose last component is within a few edits (a key put in the wrong section).
std::string suggestion(const std::string& parent, const std::string& key) {
  const auto close = [&](int64_t d) { return d <= std::max<int64_t>(2, static_cast<int64_t>(key.size()) / 3); };
  std::string best;
  int64_t best_d = std::numeric_limits<int64_t>::max();
  for (const std::string& c : children_of(parent)) {
    const int64_t d = edit_distance(key, c);
    if (d < best_d) best_d = d, best = join_path(parent, c);
  }
  // An exact sibling, else a key elsewhere that is exactly this name ("lr" is
  // "optimizer.params.lr", not the sibling "log" two edits away), else a close sibling.
  if (best_d == 0) return best;
  for (const Spec& s : specs()) {
    const std::string path = s.path;
    const size_t dot = path.rfind('.');
    if (path.substr(dot == std::string::npos ? 0 : dot + 1) == key) return path;
  }
  if (close(best_d)) return best;
  std::string any;
  int64_t any_d = std::numeric_limits<int64_t>::max();
  for (const Spec& s : specs()) {
    std::string p = s.path;
    // Every component of the path, so "params" finds "optimizer.params".
    size_t start = 0;
    while (true) {
      const size_t dot = p.find('.', start);
      const std::string comp = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      const int64_t d = edit_distance(key, comp);
      if (d < any_d) any_d = d, any = p.substr(0, dot);
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  }
  if (close(any_d)) return any;
  return best;  // nothing close: still name the nearest sibling
}

// The largest integer a config holds: JSON numbers are doubles, exact up to 2^53 (and a larger
// one would overflow int64 when converted, or mean nothing as a count).
constexpr double kMaxInt = 9007199254740992.0;

std::string kind_text(const Spec& s) {
  const auto range = [&](const char* what) {
    std::string t = what;
    if (s.min > -kInf && s.max < kInf) return t + fmt::format(" in [{}, {}]", s.min, s.max);
    if (s.min > -kInf) return t + fmt::format(" >= {}", s.min);
    return t;
  };
  switch (s.kind) {
    case Kind::Int: return range("an integer");
    case Kind::Number: return range("a number");
    case Kind::Bool: return "true or false";
    case Kind::String: return "a string";
    case Kind::Enum: {
      std::string t = "one of";
      for (size_t i = 0; i < s.choices.size(); ++i) t += fmt::format("{} \"{}\"", i ? "," : "", s.choices[i]);
      return t;
    }
    case Kind::IntList: return "a non-empty list of integers >= 1";
    case Kind::IntPairs: return "a non-empty list of [integer >= 1, integer >= 1] pairs";
    case Kind::Betas: return "a list of two numbers in [0, 1)";
    case Kind::Object: return "an object";
  }
  return "";
}

[[noreturn]] void bad_value(const std::string& path, const json& v, const Spec& s) {
  throw ValueError(fmt::format("config: \"{}\" is {}, expected {}", path, v.dump(), kind_text(s)));
}

bool is_integer(const json& v) {
  if (v.is_number_integer()) return true;
  if (v.is_number_float()) {
    const double d = v.get<double>();
    return std::isfinite(d) && d == std::floor(d);
  }
  return false;
}

void check_value(const std::string& path, const json& v, const Spec& s) {
  switch (s.kind) {
    case Kind::Int: {
      if (!is_integer(v)) bad_value(path, v, s);
      const double d = v.get<double>();
      if (d < s.min || d > s.max) bad_value(path, v, s);
      if (d > kMaxInt) {
        throw ValueError(fmt::format("config: \"{}\" is {}, expected {} and at most 2^53", path, v.dump(), kind_text(s)));
      }
      return;
    }
    case Kind::Number: {
      if (!v.is_number()) bad_value(path, v, s);
      const double d = v.get<double>();
      if (!std::isfinite(d) || d < s.min || d > s.max) bad_value(path, v, s);
      return;
    }
    case Kind::Bool:
      if (!v.is_boolean()) bad_value(path, v, s);
      return;
    case Kind::String:
      if (!v.is_string()) bad_value(path, v, s);
      return;
    case Kind::Enum:
      if (!v.is_string() || std::find(s.choices.begin(), s.choices.end(), v.get<std::string>()) == s.choices.end()) {
        bad_value(path, v, s);
      }
      return;
    case Kind::IntList:
      if (!v.is_array() || v.empty()) bad_value(path, v, s);
      for (const json& e : v) {
        if (!is_integer(e) || e.get<double>() < 1 || e.get<double>() > kMaxInt) bad_value(path, v, s);
      }
      return;
    case Kind::IntPairs:
      if (!v.is_array() || v.empty()) bad_value(path, v, s);
      for (const json& e : v) {
        if (!e.is_array() || e.size() != 2) bad_value(path, v, s);
        for (const json& x : e)
          if (!is_integer(x) || x.get<double>() < 1 || x.get<double>() > kMaxInt) bad_value(path, v, s);
      }
      return;
    case Kind::Betas:
      if (!v.is_array() || v.size() != 2) bad_value(path, v, s);
      for (const json& e : v) {
        if (!e.is_number() || !(e.get<double>() >= 0 && e.get<double>() < 1)) bad_value(path, v, s);
      }
      return;
    case Kind::Object: return;
  }
}

// Walks `j` (the object at `parent`), checking every key against the table.
void validate(const json& j, const std::string& parent) {
  if (!j.is_object()) {
    throw ValueError(fmt::format("config: \"{}\" is {}, expected an object with keys: {}", parent.empty() ? "<top>" : parent,
                                 j.dump(), fmt::join(children_of(parent), ", ")));
  }
  for (const auto& [key, value] : j.items()) {
    const std::string path = join_path(parent, key);
    if (value.is_null()) continue;  // null = not given
    if (const Spec* s = find_spec(path)) {
      check_value(path, value, *s);
    } else if (is_object_path(path)) {
      validate(value, path);
    } else {
      throw ValueError(fmt::format("config: unknown key \"{}\" (did you mean \"{}\"?)", path, suggestion(parent, key)));
    }
  }
}

// The value at a dotted path, or nullptr when absent or null.
const json* at(const json& j, const std::string& path) {
  const json* cur = &j;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end() || it->is_null()) return nullptr;
    cur = &*it;
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

template <class T>
void get(const json& j, const std::string& path, T& out) {
  if (const json* v = at(j, path)) out = v->get<T>();
}
void get_int(const json& j, const std::string& path, int64_t& out) {
  if (const json* v = at(j, path)) out = static_cast<int64_t>(v->get<double>());
}

// a * b, or a ValueError naming the batch keys when it overflows int64 (values up to 2^53 pass
// validation; their product wrapped, and an inconsistent batch passed the check).
int64_t batch_product(int64_t a, int64_t b) {
  int64_t r = 0;
  TANDEM_CHECK(!__builtin_mul_overflow(a, b, &r), ValueError,
               "config: batch sizes too large: {} * {} overflows (train_micro_batch_size_per_gpu * "
               "gradient_accumulation_steps * world size must stay below 2^63)",
               a, b);
  return r;
}

// DeepSpeed's rule: train_batch_size = micro * accumulation * world_size; any two determine the
// third, one alone takes accumulation 1.
void resolve_batch(Config& c, const json& j) {
  const json* tbs = at(j, "train_batch_size");
  const json* mb = at(j, "train_micro_batch_size_per_gpu");
  const json* gas = at(j, "gradient_accumulation_steps");
  const int64_t w = c.world_size;
  const auto num = [](const json* v) { return static_cast<int64_t>(v->get<double>()); };
  if (tbs && mb && gas) {
    c.train_batch_size = num(tbs), c.train_micro_batch_size_per_gpu = num(mb), c.gradient_accumulation_steps = num(gas);
    const int64_t product = batch_product(batch_product(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps), w);
    TANDEM_CHECK(c.train_batch_size == product, ValueError,
                 "config: inconsistent batch sizes: train_batch_size {} != train_micro_batch_size_per_gpu {} * "
                 "gradient_accumulation_steps {} * world size {} = {}; drop one of the three keys to have it derived",
                 c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, w, product);
  } else if (tbs && mb) {
    c.train_batch_size = num(tbs), c.train_micro_batch_size_per_gpu = num(mb);
    TANDEM_CHECK(c.train_batch_size % batch_product(c.train_micro_batch_size_per_gpu, w) == 0, ValueError,
                 "config: inconsistent batch sizes: train_batch_size {} is not a multiple of "
                 "train_micro_batch_size_per_gpu {} * world size {} = {}",
                 c.train_batch_size, c.train_micro_batch_size_per_gpu, w, c.train_micro_batch_size_per_gpu * w);
    c.gradient_accumulation_steps = c.train_batch_size / (c.train_micro_batch_size_per_gpu * w);
  } else if (tbs && gas) {
    c.train_batch_size = num(tbs), c.gradient_accumulation_steps = num(gas);
    TANDEM_CHECK(c.train_batch_size % batch_product(c.gradient_accumulation_steps, w) == 0, ValueError,
                 "config: inconsistent batch sizes: train_batch_size {} is not a multiple of "
                 "gradient_accumulation_steps {} * world size {} = {}",
                 c.train_batch_size, c.gradient_accumulation_steps, w, c.gradient_accumulation_steps * w);
    c.train_micro_batch_size_per_gpu = c.train_batch_size / (c.gradient_accumulation_steps * w);
  } else if (mb) {
    c.train_micro_batch_size_per_gpu = num(mb);
    c.gradient_accumulation_steps = gas ? num(gas) : 1;
    c.train_batch_size = batch_product(batch_product(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps), w);
  } else if (tbs) {
    c.train_batch_size = num(tbs);
    c.gradient_accumulation_steps = 1;
    TANDEM_CHECK(c.train_batch_size % w == 0, ValueError,
                 "config: inconsistent batch sizes: train_batch_size {} is not a multiple of world size {}; "
                 "give train_micro_batch_size_per_gpu instead",
                 c.train_batch_size, w);
    c.train_micro_batch_size_per_gpu = c.train_batch_size / w;
  } else {
    throw ValueError(
        "config: no batch size: give train_batch_size or train_micro_batch_size_per_gpu (or both, with "
        "gradient_accumulation_steps)");
  }
}

}  // namespace

int64_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<int64_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int64_t>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

double SchedulerConfig::lr_at(int64_t step, double base, int64_t total) const {
  if (type.empty()) return base;
  const int64_t total_steps = total_num_steps > 0 ? total_num_steps : total;
  const double s = static_cast<double>(step);
  const double warm = static_cast<double>(warmup_num_steps);
  // The warmup fraction in [0, 1) while step < warmup_num_steps.
  const auto gamma = [&]() {
    if (warmup_type == "log") return warmup_num_steps > 1 ? std::log(s + 1.0) / std::log(warm) : 1.0;
    return s / warm;
  };
  if (type == "WarmupCosineLR") {
    double ratio;
    if (step < warmup_num_steps) {
      ratio = warmup_min_ratio + (1.0 - warmup_min_ratio) * gamma();
    } else {
      const double span = std::max<double>(1.0, static_cast<double>(total_steps) - warm);
      const double t = std::min(1.0, (s - warm) / span);
      ratio = cos_min_ratio + (1.0 - cos_min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * t));
    }
    return base * ratio;
  }
  const double max_lr = warmup_max_lr >= 0 ? warmup_max_lr : base;
  if (step < warmup_num_steps) return warmup_min_lr + (max_lr - warmup_min_lr) * gamma();
  if (type == "WarmupDecayLR") {
    // DeepSpeed's: from warmup_max_lr down to warmup_min_lr (not to 0) at total_num_steps.
    const double span = std::max<double>(1.0, static_cast<double>(total_steps) - warm);
    return warmup_min_lr + (max_lr - warmup_min_lr) * std::max(0.0, (static_cast<double>(total_steps) - s) / span);
  }
  return max_lr;
}

nlohmann::json default_config_json() {
  return json::parse(R"({
  "train_batch_size": 128,
  "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0}},
  "steps_per_print": 100,
  "seed": 0,
  "model": {"name": "mlp", "hidden": [1024, 1024]},
  "data": {"name": "fashion_mnist"},
  "train": {"epochs": 1, "keep_last": 2}
})");
}

void apply_override(nlohmann::json& j, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  TANDEM_CHECK(eq != std::string::npos && eq > 0, ValueError,
               "--set \"{}\": expected key.path=value, e.g. --set optimizer.params.lr=0.01", assignment);
  const std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = text;  // a bare word: a string
  json* cur = &j;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    TANDEM_CHECK(!part.empty(), ValueError, "--set \"{}\": empty component in key \"{}\"", assignment, key);
    if (!cur->is_object()) *cur = json::object();
    if (dot == std::string::npos) {
      (*cur)[part] = value;
      return;
    }
    cur = &(*cur)[part];
    start = dot + 1;
  }
}

// ddp.comm_hook "post_local_sgd": torch's PostLocalSGDState arguments under comm_state_option
// (start_localSGD_iter, post_local_gradient_allreduce, and subgroup_size for torch's
// new_subgroups) and PeriodicModelAverager's under model_averaging (period, warmup_steps).
void parse_post_local_sgd(Config& c, const json& j) {
  DdpConfig& d = c.ddp;
  const bool on = d.comm_hook == "post_local_sgd";
  for (const char* k : {"comm_state_option.start_localSGD_iter", "comm_state_option.post_local_gradient_allreduce",
                        "comm_state_option.subgroup_size", "model_averaging"}) {
    TANDEM_CHECK(on || !at(j, std::string("ddp.") + k), ValueError,
                 "config: \"ddp.{}\" configures post-local SGD, but \"ddp.comm_hook\" is \"{}\"; set it to "
                 "\"post_local_sgd\" or drop the option",
                 k, d.comm_hook);
  }
  if (!on) return;
  get_int(j, "ddp.comm_state_option.start_localSGD_iter", d.post_local.start_localSGD_iter);
  get(j, "ddp.comm_state_option.post_local_gradient_allreduce", d.post_local.post_local_gradient_allreduce);
  get_int(j, "ddp.comm_state_option.subgroup_size", d.subgroup_size);
  TANDEM_CHECK(d.subgroup_size == 0 || c.world_size % d.subgroup_size == 0, ValueError,
               "config: \"ddp.comm_state_option.subgroup_size\" {} does not divide the {} processes into equal groups; "
               "pick a divisor of {}",
               d.subgroup_size, c.world_size, c.world_size);
  const json* hierarchy = at(j, "ddp.model_averaging.hierarchy");
  TANDEM_CHECK((at(j, "ddp.model_averaging.period") != nullptr) != (hierarchy != nullptr), ValueError,
               "config: \"ddp.comm_hook\" \"post_local_sgd\" needs one of \"ddp.model_averaging.period\" (the optimizer "
               "steps between two averagings of the parameters: PeriodicModelAverager's period; torch's examples use 4) "
               "and \"ddp.model_averaging.hierarchy\" ([[period, group size], ...]: HierarchicalModelAverager's), {}",
               hierarchy ? "not both" : "got neither");
  get_int(j, "ddp.model_averaging.period", d.averaging_period);
  if (hierarchy) {
    for (const json& e : *hierarchy) {
      const auto period = static_cast<int64_t>(e[0].get<double>()), size = static_cast<int64_t>(e[1].get<double>());
      TANDEM_CHECK(d.averaging_hierarchy.empty() || period > d.averaging_hierarchy.back().first, ValueError,
                   "config: \"ddp.model_averaging.hierarchy\" {}: the periods must increase", hierarchy->dump());
      TANDEM_CHECK(c.world_size % size == 0, ValueError,
                   "config: \"ddp.model_averaging.hierarchy\" {}: group size {} does not divide the {} processes",
                   hierarchy->dump(), size, c.world_size);
      d.averaging_hierarchy.emplace_back(period, size);
    }
    TANDEM_CHECK(d.averaging_hierarchy.back().second == c.world_size, ValueError,
                 "config: \"ddp.model_averaging.hierarchy\" {}: the last (longest) period must average over all {} "
                 "processes (torch's rule); end it with [period, {}]",
                 hierarchy->dump(), c.world_size, c.world_size);
  }
  // torch's advice: start averaging when local SGD starts.
  d.averaging_warmup_steps = d.post_local.start_localSGD_iter;
  get_int(j, "ddp.model_averaging.warmup_steps", d.averaging_warmup_steps);
  TANDEM_CHECK(d.options.check_replicas_every == 0, ValueError,
               "config: \"ddp.check_replicas_every\" {} with \"ddp.comm_hook\" \"post_local_sgd\": between averagings "
               "the ranks' replicas differ on purpose, so the check would fail; drop it",
               d.options.check_replicas_every);
  TANDEM_CHECK(!at(j, "communication_data_type") || at(j, "communication_data_type")->get<std::string>() == "fp32",
               ValueError,
               "config: \"communication_data_type\" \"{}\" with \"ddp.comm_hook\" \"post_local_sgd\": its all-reduces "
               "send the gradients as they are (torch's hook has no 16-bit form); drop the key",
               at(j, "communication_data_type") ? at(j, "communication_data_type")->get<std::string>() : "");
}

// The ddp section and DeepSpeed's communication_data_type (the wire dtype of f32 gradients: the
// same setting as comm_hook fp16/bf16). Needs c.opt_level, c.fp16 and c.bf16 parsed.
void parse_ddp(Config& c, const json& j) {
  DdpConfig& d = c.ddp;
  parallel::DDPOptions& o = d.options;
  get(j, "ddp.bucket_cap_mb", o.bucket_cap_mb);
  get(j, "ddp.broadcast_buffers", o.broadcast_buffers);
  get(j, "ddp.find_unused_parameters", o.find_unused_parameters);
  get(j, "ddp.gradient_as_bucket_view", o.gradient_as_bucket_view);
  get(j, "ddp.static_graph", o.static_graph);
  get(j, "ddp.delay_allreduce", o.delay_allreduce);
  get(j, "ddp.fused_optimizer", d.fused_optimizer);
  if (d.fused_optimizer) {
    // The optimizer steps inside backward, bucket by bucket: nothing can see every gradient first.
    TANDEM_CHECK(c.gradient_clipping == 0, ValueError,
                 "config: \"ddp.fused_optimizer\" steps the optimizer inside backward, before \"gradient_clipping\" {} "
                 "could clip the gradients; drop one of the two",
                 c.gradient_clipping);
    TANDEM_CHECK(!c.fp16.enabled, ValueError,
                 "config: \"ddp.fused_optimizer\" steps the optimizer inside backward, before fp16's loss scaler could "
                 "unscale the gradients and skip a step on inf/nan; use it with bf16 or fp32, or drop it");
    TANDEM_CHECK(c.opt_level.empty() || c.opt_level == "O0", ValueError,
                 "config: \"ddp.fused_optimizer\" with amp.opt_level {}: amp steps the optimizer itself (f32 master "
                 "weights, loss scaling); use bf16 autocast (no amp.opt_level) or fp32, or drop it",
                 c.opt_level);
  }
  get_int(j, "ddp.check_replicas_every", o.check_replicas_every);
  get(j, "ddp.deterministic", o.deterministic);
  get(j, "ddp.comm_hook", d.comm_hook);
  get(j, "ddp.sync_batchnorm", d.sync_batchnorm);
  if (o.deterministic) {
    const int64_t k = c.gradient_accumulation_steps;
    TANDEM_CHECK((k & (k - 1)) == 0, ValueError,
                 "config: \"ddp.deterministic\" sums each rank's micro-batches in a binary tree, which needs a power-of-two "
                 "number of them per step; this run has {} (train_batch_size {} = micro-batch {} x accumulation {} x {} "
                 "processes): pick sizes that make it 1, 2, 4, ...",
                 k, c.train_batch_size, c.train_micro_batch_size_per_gpu, k, c.world_size);
    TANDEM_CHECK(c.model.name == "mlp" || c.model.name == "gpt", ValueError,
                 "config: \"ddp.deterministic\" with model \"{}\": its BatchNorm running statistics depend on which rank "
                 "saw which micro-batch, so they would differ between world sizes; use it with mlp or gpt",
                 c.model.name);
    TANDEM_CHECK(!at(j, "ddp.comm_hook") || d.comm_hook == "no", ValueError,
                 "config: \"ddp.deterministic\" gathers the exact gradients (no communication hook); drop \"ddp.comm_hook\" "
                 "\"{}\"",
                 d.comm_hook);
  }
  TANDEM_CHECK(d.comm_hook != "batched_power_sgd", ValueError,
               "config: \"ddp.comm_hook\" \"batched_power_sgd\" is not offered by tandem train: its state is per bucket, and "
               "a resumed run starts with another bucket layout, so it would not continue exactly; use \"power_sgd\" "
               "(state per parameter, saved in checkpoints)");
  parallel::PowerSGDOptions& ps = d.power_sgd;
  get_int(j, "ddp.comm_state_option.matrix_approximation_rank", ps.matrix_approximation_rank);
  get_int(j, "ddp.comm_state_option.start_powerSGD_iter", ps.start_powerSGD_iter);
  get(j, "ddp.comm_state_option.min_compression_rate", ps.min_compression_rate);
  get(j, "ddp.comm_state_option.use_error_feedback", ps.use_error_feedback);
  get(j, "ddp.comm_state_option.warm_start", ps.warm_start);
  get(j, "ddp.comm_state_option.orthogonalization_epsilon", ps.orthogonalization_epsilon);
  if (const json* v = at(j, "ddp.comm_state_option.random_seed")) ps.random_seed = static_cast<uint64_t>(v->get<double>());
  for (const char* k : {"matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
                        "warm_start", "orthogonalization_epsilon", "random_seed"}) {
    TANDEM_CHECK(!at(j, std::string("ddp.comm_state_option.") + k) || d.comm_hook == "power_sgd", ValueError,
                 "config: \"ddp.comm_state_option.{}\" configures PowerSGD, but \"ddp.comm_hook\" is \"{}\"; set it to "
                 "\"power_sgd\" or drop the option",
                 k, d.comm_hook);
  }
  parse_post_local_sgd(c, j);
  TANDEM_CHECK(!((ps.use_error_feedback || ps.warm_start) && ps.start_powerSGD_iter <= 1), ValueError,
               "config: \"ddp.comm_state_option.start_powerSGD_iter\" is {}: it must be > 1 with use_error_feedback or "
               "warm_start (PyTorch's rule)",
               ps.start_powerSGD_iter);
  get(j, "ddp.comm_wrapper", d.comm_wrapper);
  TANDEM_CHECK(d.comm_wrapper == "no" || d.comm_hook == "power_sgd", ValueError,
               "config: \"ddp.comm_wrapper\" \"{}\" wraps PowerSGD (its factors sent in 16 bits), but \"ddp.comm_hook\" is "
               "\"{}\"; for 16-bit gradients without PowerSGD set \"ddp.comm_hook\" to \"{}\"",
               d.comm_wrapper, d.comm_hook, d.comm_wrapper);
  // DeepSpeed's communication_data_type: the wire dtype. With PowerSGD it is the wrapper's.
  // `cdt` as given (fp32 | fp16 | bf16 | bfp16), `wire` with DeepSpeed's alias resolved.
  const json* cdt_json = at(j, "communication_data_type");
  const std::string cdt = cdt_json ? cdt_json->get<std::string>() : "";
  const std::string wire = cdt == "bfp16" ? "bf16" : cdt;
  if (cdt_json) {
    const std::string& t = cdt;
    TANDEM_CHECK(!o.deterministic || wire == "fp32", ValueError,
                 "config: \"ddp.deterministic\" gathers the exact f32 gradients; drop \"communication_data_type\" \"{}\"", t);
    const std::string low = wire == "fp32" ? "no" : wire;
    if (d.comm_hook == "post_local_sgd") {
      // fp32 only (parse_post_local_sgd): nothing to set.
    } else if (d.comm_hook == "power_sgd") {
      TANDEM_CHECK(!at(j, "ddp.comm_wrapper") || d.comm_wrapper == low, ValueError,
                   "config: \"communication_data_type\" \"{}\" and \"ddp.comm_wrapper\" \"{}\" disagree on the wire dtype of "
                   "PowerSGD's factors; give one of them",
                   t, d.comm_wrapper);
      d.comm_wrapper = low;
    } else {
      TANDEM_CHECK(!at(j, "ddp.comm_hook") || d.comm_hook == low, ValueError,
                   "config: \"communication_data_type\" \"{}\" and \"ddp.comm_hook\" \"{}\" disagree on the gradients' wire "
                   "dtype; give one of them",
                   t, d.comm_hook);
      d.comm_hook = low;
    }
  }
  // O2/O3 cast the parameters, so the gradients are already 16-bit and reduce in their own dtype
  // (f32 accumulation); another wire dtype would be silently ignored. PowerSGD compresses them
  // (in f32, its factors sent in their dtype), so it stays, without a wrapper.
  if (c.opt_level == "O2" || c.opt_level == "O3") {
    const std::string low = c.bf16 ? "bf16" : "fp16";
    std::string asked;
    if (cdt_json && wire != low) asked = "communication_data_type \"" + cdt + "\"";
    if (asked.empty() && (d.comm_hook == "fp16" || d.comm_hook == "bf16") && d.comm_hook != low) {
      asked = "ddp.comm_hook \"" + d.comm_hook + "\"";
    }
    if (asked.empty() && d.comm_wrapper != "no" && d.comm_wrapper != low) asked = "ddp.comm_wrapper \"" + d.comm_wrapper + "\"";
    TANDEM_CHECK(asked.empty(), ValueError,
                 "config: amp.opt_level {} keeps {} parameters, whose gradients are reduced in {} (f32 accumulation); {} "
                 "applies to f32 gradients only: drop it, or use amp.opt_level O1",
                 c.opt_level, low, low, asked);
    if (d.comm_hook != "power_sgd" && d.comm_hook != "post_local_sgd") d.comm_hook = "no";
    d.comm_wrapper = "no";
  }
}

Config parse_config(const nlohmann::json& j, int world_size) {
  TANDEM_CHECK(world_size >= 1, ValueError, "parse_config: world_size {} < 1", world_size);
  validate(j, "");
  Config c;
  c.source = j;
  c.world_size = world_size;
  resolve_batch(c, j);
  get(j, "gradient_clipping", c.gradient_clipping);
  get_int(j, "steps_per_print", c.steps_per_print);
  if (const json* v = at(j, "seed")) c.seed = static_cast<uint64_t>(v->get<double>());

  OptimizerConfig& o = c.optimizer;
  get(j, "optimizer.type", o.type);
  if (o.type == "AdamW") o.weight_decay = 1e-2;  // PyTorch's AdamW default
  get(j, "optimizer.params.lr", o.lr);
  if (const json* v = at(j, "optimizer.params.betas")) o.betas = {(*v)[0].get<double>(), (*v)[1].get<double>()};
  get(j, "optimizer.params.eps", o.eps);
  get(j, "optimizer.params.weight_decay", o.weight_decay);
  get(j, "optimizer.params.momentum", o.momentum);
  get(j, "optimizer.params.nesterov", o.nesterov);
  TANDEM_CHECK(o.type == "SGD" || (!at(j, "optimizer.params.momentum") && !at(j, "optimizer.params.nesterov")),
               ValueError, "config: \"optimizer.params.momentum\"/\"nesterov\" apply to SGD only, optimizer.type is \"{}\"",
               o.type);
  TANDEM_CHECK(o.type != "SGD" || (!at(j, "optimizer.params.betas") && !at(j, "optimizer.params.eps")), ValueError,
               "config: \"optimizer.params.betas\"/\"eps\" apply to Adam/AdamW only, optimizer.type is \"SGD\" (torch's SGD "
               "takes neither)");

  SchedulerConfig& s = c.scheduler;
  get(j, "scheduler.type", s.type);
  TANDEM_CHECK(!s.type.empty() || !at(j, "scheduler.params"), ValueError,
               "config: \"scheduler.params\" given without \"scheduler.type\" (one of WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  get(j, "scheduler.params.warmup_min_lr", s.warmup_min_lr);
  get(j, "scheduler.params.warmup_max_lr", s.warmup_max_lr);
  get_int(j, "scheduler.params.warmup_num_steps", s.warmup_num_steps);
  get(j, "scheduler.params.warmup_type", s.warmup_type);
  get_int(j, "scheduler.params.total_num_steps", s.total_num_steps);
  get(j, "scheduler.params.warmup_min_ratio", s.warmup_min_ratio);
  get(j, "scheduler.params.cos_min_ratio", s.cos_min_ratio);
  if (!s.type.empty()) {
    // DeepSpeed builds the schedule as Type(optimizer, **params): a parameter of another schedule
    // is a TypeError there, and was silently ignored here.
    static const std::map<std::string, std::vector<std::string>> kParams = {
        {"WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}},
        {"WarmupDecayLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"}},
        {"WarmupCosineLR",
         {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"}}};
    const std::vector<std::string>& allowed = kParams.at(s.type);
    if (const json* params = at(j, "scheduler.params")) {
      for (const auto& [key, value] : params->items()) {
        if (value.is_null()) continue;  // (null: unset, as everywhere in the config)
        TANDEM_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), ValueError,
                     "config: \"scheduler.params.{}\" is not a parameter of {} (it takes {}); drop it or change "
                     "\"scheduler.type\"",
                     key, s.type, fmt::format("{}", fmt::join(allowed, ", ")));
      }
    }
  }

  Fp16Config& f = c.fp16;
  get(j, "fp16.enabled", f.enabled);
  get(j, "fp16.loss_scale", f.loss_scale);
  if (const json* v = at(j, "fp16.initial_scale_power")) f.initial_scale_power = static_cast<int>(v->get<double>());
  get_int(j, "fp16.loss_scale_window", f.loss_scale_window);
  get_int(j, "fp16.hysteresis", f.hysteresis);
  get(j, "fp16.min_loss_scale", f.min_loss_scale);
  get(j, "bf16.enabled", c.bf16);
  TANDEM_CHECK(!(f.enabled && c.bf16), ValueError,
               "config: \"fp16.enabled\" and \"bf16.enabled\" are both true; enable one precision (or neither for fp32)");

  get_int(j, "zero_optimization.stage", c.zero_stage);
  TANDEM_CHECK(c.zero_stage == 0, ValueError,
               "config: \"zero_optimization.stage\" is {}: ZeRO stages 1-3 are not implemented yet; use stage 0 (plain DDP)",
               c.zero_stage);

  ModelConfig& m = c.model;
  get(j, "model.name", m.name);
  if (const json* v = at(j, "model.hidden")) {
    m.hidden.clear();
    for (const json& e : *v) m.hidden.push_back(static_cast<int64_t>(e.get<double>()));
  }
  get_int(j, "model.num_classes", m.num_classes);
  get_int(j, "model.vocab_size", m.vocab_size);
  get_int(j, "model.context", m.context);
  get_int(j, "model.n_layer", m.n_layer);
  get_int(j, "model.d_model", m.d_model);
  get_int(j, "model.n_head", m.n_head);
  TANDEM_CHECK(m.d_model % m.n_head == 0, ValueError, "config: \"model.d_model\" {} is not a multiple of \"model.n_head\" {}",
               m.d_model, m.n_head);

  DataConfig& d = c.data;
  get(j, "data.name", d.name);
  get(j, "data.path", d.path);
  get_int(j, "data.num_workers", d.num_workers);
  get_int(j, "data.samples_per_epoch", d.samples_per_epoch);
  get_int(j, "data.eval_samples", d.eval_samples);
  get(j, "data.drop_last", d.drop_last);
  const bool text_data = d.name == "text" || d.name == "tokens";
  TANDEM_CHECK(text_data == (m.name == "gpt"), ValueError,
               "config: model \"{}\" does not fit data \"{}\" (gpt trains on text or tokens; mlp, cnn and resnet18 on "
               "fashion_mnist or cifar10)",
               m.name, d.name);
  TANDEM_CHECK(d.name != "tokens" || !d.path.empty(), ValueError, "config: data \"tokens\" needs \"data.path\" (a uint16 token file)");
  TANDEM_CHECK(text_data || d.samples_per_epoch == 0, ValueError,
               "config: \"data.samples_per_epoch\" applies to text and tokens data (windows drawn per epoch); {} trains on "
               "all its images every epoch: drop it, or give train.steps for a shorter run",
               d.name);

  TrainLoopConfig& t = c.train;
  get_int(j, "train.steps", t.steps);
  get_int(j, "train.epochs", t.epochs);
  get_int(j, "train.eval_every", t.eval_every);
  get_int(j, "train.checkpoint_every", t.checkpoint_every);
  get_int(j, "train.keep_last", t.keep_last);
  get_int(j, "train.threads", t.threads);
  TANDEM_CHECK(t.steps > 0 || t.epochs > 0, ValueError, "config: \"train.steps\" and \"train.epochs\" are both 0; give one");

  get(j, "amp.opt_level", c.opt_level);
  TANDEM_CHECK(c.opt_level.empty() || c.opt_level == "O0" || f.enabled || c.bf16, ValueError,
               "config: \"amp.opt_level\" {} needs a low precision: set \"bf16.enabled\" or \"fp16.enabled\"", c.opt_level);
  get(j, "dist.backend", c.dist.backend);
  get(j, "dist.timeout_s", c.dist.timeout_s);
  parse_ddp(c, j);
  get(j, "log.jsonl", c.log.jsonl);
  get(j, "log.tensorboard", c.log.tensorboard);
  get(j, "log.progress", c.log.progress);
  return c;
}

const std::vector<std::string>& rank_local_keys() {
  static const std::vector<std::string> keys = {"data.path", "data.num_workers", "train.threads", "dist.timeout_s",
                                                "log.progress"};
  return keys;
}

bool is_rank_local_key(const std::string& key) {
  return std::find(rank_local_keys().begin(), rank_local_keys().end(), key) != rank_local_keys().end();
}

namespace {

// A value as shared_config_lines writes it: numbers by value, arrays element by element.
std::string canonical(const json& v) {
  if (v.is_number()) return fmt::format("{}", v.get<double>());
  if (v.is_array()) {
    std::vector<std::string> parts;
    for (const json& e : v) parts.push_back(canonical(e));
    return fmt::format("[{}]", fmt::join(parts, ", "));
  }
  return v.dump();
}

}  // namespace

std::vector<std::string> shared_config_lines(const nlohmann::json& source) {
  std::vector<std::string> lines;
  for (const Spec& s : specs()) {
    if (is_rank_local_key(s.path)) continue;
    const json* v = at(source, s.path);
    lines.push_back(fmt::format("{} = {}", s.path, v ? canonical(*v) : "unset"));
  }
  return lines;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides, int world_size) {
  json j;
  if (path.empty()) {
    j = default_config_json();
  } else {
    errno = 0;
    std::ifstream f(path);
    const int err = errno;
    TANDEM_CHECK(!std::filesystem::is_directory(path), IOError, "config: \"{}\" is a directory; give the JSON file", path);
    TANDEM_CHECK(f.good(), IOError, "config: cannot read \"{}\": {}", path,
                 err != 0 ? std::strerror(err) : "open failed");
    std::stringstream ss;
    ss << f.rdbuf();
    // A key given twice in one object: nlohmann keeps the last silently, which hides a typo'd
    // edit (two "train_batch_size" lines, the first one edited); refused, naming it.
    std::vector<std::set<std::string>> keys_seen;
    std::vector<std::string> object_path;
    std::string pending_key;
    const json::parser_callback_t on_event = [&](int, json::parse_event_t event, json& parsed) {
      switch (event) {
        case json::parse_event_t::object_start:
          keys_seen.emplace_back();
          [[fallthrough]];
        case json::parse_event_t::array_start:
          object_path.push_back(pending_key);
          pending_key.clear();
          break;
        case json::parse_event_t::object_end:
          keys_seen.pop_back();
          [[fallthrough]];
        case json::parse_event_t::array_end:
          object_path.pop_back();
          pending_key.clear();
          break;
        case json::parse_event_t::key: {
          const std::string key = parsed.get<std::string>();
          if (!keys_seen.back().insert(key).second) {
            std::string where;
            for (const std::string& part : object_path) {
              if (!part.empty()) where += part + ".";
            }
            throw ValueError(fmt::format("config: \"{}\" gives \"{}{}\" twice; keep one", path, where, key));
          }
          pending_key = key;
          break;
        }
        default:
          break;
      }
      return true;
    };
    try {
      j = json::parse(ss.str(), on_event, true, /*ignore_comments=*/true);
    } catch (const json::parse_error& e) {
      throw IOError(fmt::format("config: \"{}\" is not valid JSON: {}", path, e.what()));
    }
  }
  for (const std::string& o : overrides) apply_override(j, o);
  return parse_config(j, world_size);
}

}  // namespace tandem::train
