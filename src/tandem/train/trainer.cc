// The training loop behind `tandem train`. Set-up first (process group, data, model, optimizer,
// precision, DDP, schedule, resume), then the loop, which reads top to bottom like the STYLE
// sketch: micro-batches under no_sync except the last, unscale, clip, step, update; diagnostics
// below the step.
#include "tandem/train/trainer.h"

#include <time.h>

#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>

#include <fmt/ranges.h>

#include "tandem/amp/autocast.h"
#include "tandem/amp/grad_scaler.h"
#include "tandem/amp/initialize.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/core/allocator.h"
#include "tandem/core/error.h"
#include "tandem/core/hash.h"
#include "tandem/core/parallel.h"
#include "tandem/core/rng.h"
#include "tandem/data/dataloader.h"
#include "tandem/data/sampler.h"
#include "tandem/data/text.h"
#include "tandem/data/vision.h"
#include "tandem/dist/metrics.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/store.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/nn/models/cnn.h"
#include "tandem/nn/models/gpt.h"
#include "tandem/nn/models/mlp.h"
#include "tandem/nn/models/resnet.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/loss.h"
#include "tandem/ops/reduce.h"
#include "tandem/ops/shape.h"
#include "tandem/optim/adam.h"
#include "tandem/optim/lr_scheduler.h"
#include "tandem/optim/sgd.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/local_sgd.h"
#include "tandem/parallel/powersgd.h"
#include "tandem/parallel/sync_batch_norm.h"
#include "tandem/train/checkpoint.h"
#include "tandem/train/metrics.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU seconds of this process (every thread): per step, the work done without the time other
// processes held the cores — the steadier figure on a shared machine (bench/compare uses it).
double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---- data ----
struct Data {
  std::unique_ptr<data::Dataset> train, eval;
  bool text = false;           // gpt on byte/token windows
  int64_t in_channels = 1, image_pixels = 0;
};

Data make_data(const Config& c) {
  Data d;
  const DataConfig& dc = c.data;
  if (dc.name == "fashion_mnist") {
    const data::FashionMNIST::Options o{.root = dc.path, .mean = data::FashionMNIST::kMean, .std = data::FashionMNIST::kStd};
    d.train = std::make_unique<data::FashionMNIST>("train", o);
    d.eval = std::make_unique<data::FashionMNIST>("test", o);
    d.in_channels = 1, d.image_pixels = 28 * 28;
  } else if (dc.name == "cifar10") {
    TANDEM_CHECK(!dc.path.empty(), ValueError, "config: data \"cifar10\" needs \"data.path\" (the cifar-10-batches-bin directory)");
    const data::CIFAR10::Options o{.mean = data::CIFAR10::kMean, .std = data::CIFAR10::kStd};
    d.train = std::make_unique<data::CIFAR10>(dc.path, true, o);
    d.eval = std::make_unique<data::CIFAR10>(dc.path, false, o);
    d.in_channels = 3, d.image_pixels = 3 * 32 * 32;
  } else {
    d.text = true;
    const int64_t T = c.model.context;
    // Held-out windows: the same corpus with another window seed (the corpora here have no split).
    const int64_t eval_windows = dc.eval_samples > 0 ? dc.eval_samples : 64;
    if (dc.name == "text") {
      const std::string path = dc.path.empty() ? data::TextBytes::kDefaultCorpus : dc.path;
      d.train = std::make_unique<data::TextBytes>(std::vector<std::string>{path}, T, c.seed, dc.samples_per_epoch);
      d.eval = std::make_unique<data::TextBytes>(std::vector<std::string>{path}, T, c.seed ^ 0x5eedull, eval_windows);
    } else {
      d.train = std::make_unique<data::TokenFile>(dc.path, T, c.seed, dc.samples_per_epoch);
      d.eval = std::make_unique<data::TokenFile>(dc.path, T, c.seed ^ 0x5eedull, eval_windows);
    }
  }
  return d;
}

// ---- model ----
std::shared_ptr<nn::Module> make_model(const Config& c, const Data& d) {
  const ModelConfig& m = c.model;
  if (m.name == "mlp") return nn::models::mlp({.in_features = d.image_pixels, .hidden = m.hidden, .num_classes = m.num_classes});
  if (m.name == "cnn") return nn::models::cnn({.in_channels = d.in_channels, .num_classes = m.num_classes});
  if (m.name == "resnet18") return nn::models::resnet18({.in_channels = d.in_channels, .num_classes = m.num_classes});
  return nn::models::gpt(
      {.vocab_size = m.vocab_size, .context = m.context, .n_layer = m.n_layer, .d_model = m.d_model, .n_head = m.n_head});
}

std::unique_ptr<optim::Optimizer> make_optimizer(const Config& c, const std::vector<Tensor>& params) {
  const OptimizerConfig& o = c.optimizer;
  if (o.type == "SGD") {
    return std::make_unique<optim::SGD>(params, optim::SGDOptions{.lr = o.lr, .momentum = o.momentum,
                                                                  .weight_decay = o.weight_decay, .nesterov = o.nesterov});
  }
  const optim::AdamOptions a{.lr = o.lr, .beta1 = o.betas[0], .beta2 = o.betas[1], .eps = o.eps, .weight_decay = o.weight_decay};
  if (o.type == "Adam") return std::make_unique<optim::Adam>(params, a);
  return std::make_unique<optim::AdamW>(params, a);
}

// DeepSpeed's schedules over the optimizer's lr (SchedulerConfig::lr_at).
class DeepSpeedSchedule : public optim::LRScheduler {
 public:
  DeepSpeedSchedule(optim::Optimizer& opt, SchedulerConfig s, int64_t total) : LRScheduler(opt), s_(std::move(s)), total_(total) {}

 protected:
  double lr_at(double base, int64_t step) const override { return s_.lr_at(step, base, total_); }

 private:
  SchedulerConfig s_;
  int64_t total_;
};

// ---- precision: fp32 / autocast (+ GradScaler for fp16) / amp opt levels ----
struct Precision {
  DType low = kFloat32;                     // the autocast / model dtype; f32 = none
  std::unique_ptr<amp::Amp> amp;            // amp.opt_level set
  std::unique_ptr<amp::GradScaler> scaler;  // fp16 without an opt level
  std::string describe;

  amp::autocast guard() const {
    if (amp) return amp->forward_autocast();
    return amp::autocast({.dtype = low == kFloat32 ? kBFloat16 : low, .enabled = low != kFloat32});
  }
  Tensor input(const Tensor& x) const { return amp ? amp->cast_input(x) : x; }
  double loss_scale() const { return amp ? amp->get_scale() : scaler ? scaler->get_scale() : 1.0; }
};

amp::GradScalerOptions scaler_options(const Config& c, const std::shared_ptr<dist::ProcessGroup>& pg, std::FILE* out) {
  const Fp16Config& f = c.fp16;
  amp::GradScalerOptions o;
  if (f.loss_scale > 0) {
    o.dynamic = false;
    o.init_scale = f.loss_scale;
  } else {
    o.initial_scale_power = f.initial_scale_power;
  }
  o.growth_interval = f.loss_scale_window;
  o.hysteresis = f.hysteresis;
  o.min_loss_scale = f.min_loss_scale;
  o.provenance = true;
  o.log = [out](const std::string& line) {
    std::fprintf(out, "\r%s\n", line.c_str());
    std::fflush(out);
  };
  if (pg) {
    o.found_inf_reducer = parallel::found_inf_reducer(pg);
    o.rank = pg->rank();
  }
  return o;
}

// The loss of one batch: cross entropy over classes, or over every position for a language model.
Tensor batch_loss(nn::Module& model, const Tensor& x, const Tensor& y, bool text) {
  Tensor logits = model(x);
  if (text) return ops::cross_entropy(logits.view({-1, logits.size(-1)}), y.reshape({-1}));
  return ops::cross_entropy(logits, y);
}

struct EvalResult {
  double loss = 0, accuracy = -1;
};

// Evaluates `model` (the plain module, never DDP: rank 0 alone runs it) on up to `limit` examples.
EvalResult evaluate(nn::Module& model, const data::Dataset& ds, const Precision& prec, bool text, int64_t limit) {
  const int64_t n = limit > 0 ? std::min(limit, ds.size()) : ds.size();
  model.eval();
  NoGradGuard no_grad;
  EvalResult r;
  int64_t correct = 0, seen = 0;
  double loss_sum = 0;
  const int64_t bs = text ? 16 : 500;
  std::vector<int64_t> idx;
  for (int64_t start = 0; start < n; start += bs) {
    const int64_t len = std::min(bs, n - start);
    idx.resize(static_cast<size_t>(len));
    std::iota(idx.begin(), idx.end(), start);
    const data::Batch b = ds.get_batch(idx);
    auto cast = prec.guard();
    const Tensor x = prec.input(b[0]);
    Tensor logits = model(x);
    if (text) {
      loss_sum += ops::cross_entropy(logits.view({-1, logits.size(-1)}), b[1].reshape({-1})).item() * static_cast<double>(len);
    } else {
      loss_sum += ops::cross_entropy(logits, b[1]).item() * static_cast<double>(len);
      correct += ops::count_equal(ops::argmax(logits, 1), b[1]);
    }
    seen += len;
  }
  model.train();
  r.loss = loss_sum / static_cast<double>(std::max<int64_t>(1, seen));
  if (!text) r.accuracy = static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(1, seen));
  return r;
}

std::vector<Tensor> optimizer_params(const optim::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& g : opt.param_groups()) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

// Where in its epoch a resumed run starts, in this run's micro-batches per rank. A checkpoint of
// another world size or micro-batch size (the same global batch: the sampler gives step s the
// same samples either way) stopped after batches_consumed x its micro-batch x its world samples
// of the epoch; this run continues from that sample, or refuses when its micro-batches x ranks
// do not divide it (naming the sizes), rather than repeat or skip data.
int64_t resume_position(const CheckpointState& st, const std::string& dir, int world, int64_t micro) {
  const int64_t saved_world = st.extra.value("world_size", int64_t{world});
  const int64_t saved_micro = st.extra.value("micro_batch_size", micro);
  if (saved_world == world && saved_micro == micro) return st.batches_consumed;
  const int64_t samples = st.batches_consumed * saved_micro * saved_world;
  TANDEM_CHECK(samples % (micro * world) == 0, ValueError,
               "train: checkpoint {} stopped {} samples into epoch {} ({} ranks x micro-batch {}); this run's {} ranks x "
               "micro-batch {} cannot resume at that sample: resume with {} ranks and micro-batch {}, or sizes whose "
               "product divides {}",
               dir, samples, st.epoch, saved_world, saved_micro, world, micro, saved_world, saved_micro, samples);
  return samples / (micro * world);
}

// PowerSGD's state for a checkpoint: the warm-start Qs (the same on every rank) as "q.<name>" and
// every rank's error feedback as "error.<rank>.<name>" (all-gathered: every rank calls this), plus
// the counters in `meta`.
std::vector<std::pair<std::string, Tensor>> gather_powersgd(const parallel::PowerSGDState& state, dist::ProcessGroup& pg,
                                                            json* meta) {
  const parallel::PowerSGDState::Dict d = state.state_dict();
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, q] : d.q) out.emplace_back("q." + name, q);
  int64_t total = 0;
  std::vector<Tensor> parts;
  for (const auto& [name, e] : d.error) {
    total += e.numel();
    parts.push_back(e);
  }
  // Every rank has errors for the same parameters (they all ran the same compressed steps).
  Tensor mine = parts.empty() ? zeros({0}, kFloat32) : ops::cat(parts, 0);
  Tensor all = empty({static_cast<int64_t>(pg.size()) * total}, kFloat32);
  if (total > 0) pg.all_gather(dist::as_buffer(all), dist::as_buffer(mine))->wait();
  for (int r = 0; r < pg.size(); ++r) {
    int64_t off = static_cast<int64_t>(r) * total;
    for (const auto& [name, e] : d.error) {
      out.emplace_back(fmt::format("error.{}.{}", r, name), all.narrow(0, off, e.numel()).clone());
      off += e.numel();
    }
  }
  *meta = {{"type", "power_sgd"},
           {"iter", d.iter},
           {"numel_before", d.numel_before},
           {"numel_after", d.numel_after},
           {"world_size", pg.size()},
           {"tensors", out.size()}};
  return out;
}

// Puts this rank's share of a checkpoint's PowerSGD state back. A checkpoint without one (saved
// with another comm_hook) leaves the state fresh; one from another world size is refused (the
// error feedback is per rank).
void restore_powersgd(parallel::PowerSGDState& state, const CheckpointState& st, const std::string& dir, int rank,
                      int world) {
  if (!st.extra.contains("comm_hook")) return;
  const json& meta = st.extra["comm_hook"];
  const int saved_world = meta.value("world_size", 0);
  TANDEM_CHECK(saved_world == world, ValueError,
               "train: checkpoint {} holds PowerSGD error feedback of {} ranks, this run has {}; resume it with {} "
               "processes (or start a new run directory)",
               dir, saved_world, world, saved_world);
  const size_t tensors = meta.value("tensors", size_t{0});
  TANDEM_CHECK(st.comm_hook.size() == tensors, IOError,
               "train: checkpoint {} should hold {} PowerSGD tensors in comm_hook.safetensors, found {} (file missing or "
               "replaced); restore the file or resume from another checkpoint",
               dir, tensors, st.comm_hook.size());
  parallel::PowerSGDState::Dict d;
  d.iter = meta.at("iter").get<int64_t>();
  d.numel_before = meta.at("numel_before").get<int64_t>();
  d.numel_after = meta.at("numel_after").get<int64_t>();
  const std::string mine = fmt::format("error.{}.", rank);
  for (const auto& [name, t] : st.comm_hook) {
    if (name.rfind("q.", 0) == 0) d.q[name.substr(2)] = t;
    if (name.rfind(mine, 0) == 0) d.error[name.substr(mine.size())] = t;
  }
  state.load_state_dict(d);
}

// Post-local SGD's counters from a checkpoint (the replicas came with load_checkpoint, which
// refuses another world size). One saved with another hook leaves them fresh.
void restore_local_sgd(parallel::PostLocalSGDState& state, parallel::ModelAverager& averager,
                       const CheckpointState& st) {
  if (!st.extra.contains("comm_hook") || st.extra["comm_hook"].value("type", "") != "post_local_sgd") return;
  const json& meta = st.extra["comm_hook"];
  state.set_iter(meta.at("iter").get<int64_t>());
  averager.set_step(meta.at("averager_step").get<int64_t>());
}

}  // namespace

json TrainSummary::to_json() const {
  json j = {{"steps", steps},
            {"skipped_steps", skipped_steps},
            {"final_loss", final_loss},
            {"samples_per_s", samples_per_s},
            {"peak_bytes", peak_bytes},
            {"train_seconds", train_seconds},
            {"loss_scale", loss_scale},
            {"precision", precision},
            {"world_size", world_size},
            {"batch_size", batch_size},
            {"epochs", epochs},
            {"threads", threads},
            {"interrupted", interrupted},
            {"last_checkpoint", last_checkpoint}};
  if (test_accuracy >= 0) j["test_accuracy"] = test_accuracy;
  if (eval_loss >= 0) j["eval_loss"] = eval_loss;
  if (tokens_per_s > 0) j["tokens_per_s"] = tokens_per_s;
  if (context > 0) j["context"] = context;
  return j;
}

namespace {

// Collective: every rank's config must equal rank 0's but for the rank-local keys; otherwise every
// rank throws the same error naming the first key that differs, its two values and the ranks.
void check_same_config(dist::ProcessGroup& pg, const Config& cfg) {
  const dist::LinesDifference d = dist::differences_from_rank0(pg, {shared_config_lines(cfg.source)})[0];
  if (d.ranks.empty()) return;
  // Lines are "key = value", one per key of the same table on every rank.
  const std::string l0 = d.at0.value_or(""), l_r = d.at_first.value_or("");
  const size_t eq0 = l0.find(" = "), eq_r = l_r.find(" = ");
  TANDEM_CHECK(eq0 != std::string::npos && eq_r != std::string::npos, Error,
               "train: the config differs across ranks ({} from rank 0), but no line differs (\"{}\" vs \"{}\")",
               dist::ranks_differ(d.ranks), l0, l_r);
  throw ValueError(fmt::format(
      "train: the config differs across ranks ({} from rank 0): \"{}\" is {} on rank 0 and {} on rank {}. Every rank "
      "must train with the same config (only {} may differ per rank); launch every rank with the same --config and "
      "--set arguments",
      dist::ranks_differ(d.ranks), l0.substr(0, eq0), l0.substr(eq0 + 3), l_r.substr(eq_r + 3), d.ranks.front(),
      fmt::join(rank_local_keys(), ", ")));
}

// A dataset's size and a checksum of up to 16 of its examples, spread over it (their fields'
// shapes, dtypes and bytes), at the cost of 16 reads: it tells another dataset or another version
// of its files, not a difference that none of the 16 examples covers.
std::pair<int64_t, int64_t> data_fingerprint(const data::Dataset& d) {
  const int64_t n = d.size();
  uint64_t h = fnv1a(&n, sizeof(n));
  const int64_t samples = std::min<int64_t>(n, 16);
  for (int64_t k = 0; k < samples; ++k) {
    const data::Example e = d.get(samples == n ? k : k * (n - 1) / (samples - 1));
    for (const Tensor& f : e) {
      const Tensor c = f.contiguous();
      h = fnv1a(c.shape().data(), c.shape().size() * sizeof(int64_t), h);
      const auto dt = static_cast<int>(c.dtype());
      h = fnv1a(&dt, sizeof(dt), h);
      h = checksum64(c.data_ptr(), c.nbytes(), h);
    }
  }
  return {n, static_cast<int64_t>(h)};
}

// Collective: every rank must read the same training and evaluation data as rank 0 (data.path
// may differ per rank: node-local copies of the same files). Otherwise every rank throws the same
// error naming the dataset, the sizes (or that the sizes agree but the contents do not) and the
// paths.
void check_same_data(dist::ProcessGroup& pg, const Config& cfg, const Data& data) {
  const auto [train_n, train_h] = data_fingerprint(*data.train);
  const auto [eval_n, eval_h] = data_fingerprint(*data.eval);
  const auto all = dist::all_gather_i64(pg, {train_n, train_h, eval_n, eval_h});
  for (size_t k : {size_t{0}, size_t{2}}) {
    const std::vector<int> differ = dist::ranks_unlike_rank0(all, {k, k + 1});
    if (differ.empty()) continue;
    const int first = differ.front();
    const std::string path0 = dist::broadcast_string(pg, cfg.data.path, 0);
    const std::string path_r = dist::broadcast_string(pg, cfg.data.path, first);
    auto where = [](const std::string& path) { return path.empty() ? std::string("the built-in default") : "\"" + path + "\""; };
    const std::string what =
        all[first][k] != all[0][k]
            ? fmt::format("{} examples on rank 0, {} on rank {}", all[0][k], all[first][k], first)
            : fmt::format("{} examples on both, but sampled examples differ between rank 0 and rank {}", all[0][k], first);
    throw ValueError(fmt::format(
        "train: the {} data differs across ranks ({} from rank 0): {}; data.path is {} on rank 0 and {} on rank {}. "
        "Every rank must read the same data: a node-local copy must hold the same files",
        k == 0 ? "training" : "evaluation", dist::ranks_differ(differ), what, where(path0), where(path_r), first));
  }
}

// What a resumed run must keep, as resolved values (a key left out and its default given
// explicitly are the same): what decides the meaning of the checkpoint's state -- the model, the
// optimizer and its schedule, precision and loss scaling, the data order (seed, dataset, epoch
// length), clipping. A change there would be ignored (the checkpoint's optimizer options and
// scaler state win) or continue another computation without a word. The rest may change: how long
// the run goes, how it saves, logs and evaluates, how the global batch is formed (world size,
// micro-batch, accumulation; the position in the data is kept by sample), and how DDP
// communicates (post-local SGD may hand over to plain averaging, say).
std::vector<std::pair<std::string, std::string>> resume_invariants(const Config& c) {
  const OptimizerConfig& o = c.optimizer;
  const SchedulerConfig& s = c.scheduler;
  const Fp16Config& f = c.fp16;
  const ModelConfig& m = c.model;
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  auto n = [](double v) { return fmt::format("{}", v); };
  auto q = [](const std::string& v) { return "\"" + v + "\""; };
  return {{"seed", std::to_string(c.seed)},
          {"model.name", q(m.name)},
          {"model.hidden", fmt::format("[{}]", fmt::join(m.hidden, ", "))},
          {"model.num_classes", std::to_string(m.num_classes)},
          {"model.vocab_size", std::to_string(m.vocab_size)},
          {"model.context", std::to_string(m.context)},
          {"model.n_layer", std::to_string(m.n_layer)},
          {"model.d_model", std::to_string(m.d_model)},
          {"model.n_head", std::to_string(m.n_head)},
          {"data.name", q(c.data.name)},
          {"data.samples_per_epoch", std::to_string(c.data.samples_per_epoch)},
          {"data.drop_last", b(c.data.drop_last)},
          {"optimizer.type", q(o.type)},
          {"optimizer.params.lr", n(o.lr)},
          {"optimizer.params.betas", fmt::format("[{}, {}]", o.betas[0], o.betas[1])},
          {"optimizer.params.eps", n(o.eps)},
          {"optimizer.params.weight_decay", n(o.weight_decay)},
          {"optimizer.params.momentum", n(o.momentum)},
          {"optimizer.params.nesterov", b(o.nesterov)},
          {"scheduler.type", q(s.type)},
          {"scheduler.params.warmup_min_lr", n(s.warmup_min_lr)},
          {"scheduler.params.warmup_max_lr", n(s.warmup_max_lr)},
          {"scheduler.params.warmup_num_steps", std::to_string(s.warmup_num_steps)},
          {"scheduler.params.warmup_type", q(s.warmup_type)},
          // (As given: 0, "the run's length", may stay 0 while train.steps changes.)
          {"scheduler.params.total_num_steps", std::to_string(s.total_num_steps)},
          {"scheduler.params.warmup_min_ratio", n(s.warmup_min_ratio)},
          {"scheduler.params.cos_min_ratio", n(s.cos_min_ratio)},
          {"fp16.enabled", b(f.enabled)},
          {"fp16.loss_scale", n(f.loss_scale)},
          {"fp16.initial_scale_power", std::to_string(f.initial_scale_power)},
          {"fp16.loss_scale_window", std::to_string(f.loss_scale_window)},
          {"fp16.hysteresis", std::to_string(f.hysteresis)},
          {"fp16.min_loss_scale", n(f.min_loss_scale)},
          {"bf16.enabled", b(c.bf16)},
          {"amp.opt_level", q(c.opt_level)},
          {"gradient_clipping", n(c.gradient_clipping)},
          {"zero_optimization.stage", std::to_string(c.zero_stage)}};
}

// Why this run cannot start as asked, or "": a fresh run into an --out whose checkpoints belong
// to an earlier run (its own would be mixed with them, and keep_last would delete the newer run's
// lower-numbered steps as the older ones), or a resume that changes a resume invariant.
std::string start_problem(const Config& cfg, const TrainerOptions& opts, const std::string& ckpt_root) {
  if (opts.resume.empty()) {
    const std::vector<std::string> existing = list_checkpoints(ckpt_root);
    if (existing.empty()) return {};
    return fmt::format(
        "train: {} already holds checkpoints of an earlier run (newest: {}); a new run there would mix its "
        "checkpoints with them (and keep_last could delete its own). Continue that run with --resume auto, or give "
        "this one another --out (or remove the old checkpoints)",
        ckpt_root, existing.back());
  }
  std::optional<std::string> dir = opts.resume == "auto" ? latest_checkpoint(ckpt_root) : std::optional(opts.resume);
  if (!dir) return {};
  if (opts.resume != "auto") {
    // A resume from an earlier step (a rewind) into an --out holding later checkpoints: keep_last
    // would delete the run's new checkpoints as the oldest, or its saves would replace the later
    // ones of the same step, and --resume auto would pick up the abandoned run.
    const int64_t from = checkpoint_step(*dir);
    std::vector<std::string> later;
    for (const std::string& c : list_checkpoints(ckpt_root)) {
      if (checkpoint_step(c) > from) later.push_back(c);
    }
    if (!later.empty()) {
      return fmt::format(
          "train: resuming from {} (step {}) into {}, which holds {} later checkpoint(s) (newest: {}); this run's "
          "checkpoints would be mixed with them (keep_last would delete this run's as the older ones, and --resume "
          "auto would continue the later run). Give this run another --out, or move the later checkpoints away",
          *dir, from, ckpt_root, later.size(), later.back());
    }
  }
  // The saved config resolved as this run resolves its own (the batch split may change: it is
  // taken from this run, so that another world size resolves).
  nlohmann::json saved = checkpoint_config(*dir);
  for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) saved.erase(k);
  saved["train_batch_size"] = cfg.train_batch_size;
  saved["train_micro_batch_size_per_gpu"] = cfg.train_micro_batch_size_per_gpu;
  Config before;
  try {
    before = parse_config(saved, cfg.world_size);
  } catch (const std::exception& e) {
    return fmt::format("train: resuming from {}: its config no longer parses ({}); resume it with the version that "
                       "wrote it, or start a new run with another --out",
                       *dir, e.what());
  }
  const auto was = resume_invariants(before), now = resume_invariants(cfg);
  for (size_t i = 0; i < was.size(); ++i) {
    if (was[i].second == now[i].second) continue;
    return fmt::format(
        "train: resuming from {}: \"{}\" is {} in its config but {} now. A resumed run continues the saved "
        "computation: the model, optimizer, schedule, precision, seed and dataset must stay (run length, saving, "
        "logging, the batch split and DDP's communication may change); resume with the run's own values (its "
        "trainer_state.json holds its config), or start a new run with another --out",
        *dir, was[i].first, was[i].second, now[i].second);
  }
  return {};
}

// Collective: every rank must start from the same step (the same checkpoint, or none): a rank
// that resolves --resume auto in another directory (a node-local --out) or gets another --resume
// DIR would otherwise train other steps than the others, with other optimizer state, and fail with
// a collective mismatch only at the end. Every rank throws the same error naming both starts.
void check_same_start(dist::ProcessGroup& pg, const std::string& resumed_from, int64_t step) {
  const auto all = dist::all_gather_i64(pg, {resumed_from.empty() ? -1 : step});
  const std::vector<int> differ = dist::ranks_unlike_rank0(all, {0});
  if (differ.empty()) return;
  const int first = differ.front();
  const std::string from0 = dist::broadcast_string(pg, resumed_from, 0);
  const std::string from_r = dist::broadcast_string(pg, resumed_from, first);
  auto start = [](const std::string& from, int64_t at) {
    return from.empty() ? std::string("starts fresh (no checkpoint)") : fmt::format("resumes from {} at step {}", from, at);
  };
  throw ValueError(fmt::format(
      "train: the ranks start from different checkpoints ({} from rank 0): rank 0 {}, rank {} {}. Every rank must "
      "resume from the same checkpoint: give every rank the same --out on a filesystem they all see, or the same "
      "--resume DIR",
      dist::ranks_differ(differ), start(from0, all[0][0]), first, start(from_r, all[first][0])));
}

}  // namespace

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  TANDEM_CHECK(f != nullptr, IOError, "cannot write {}: {}", tmp, std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = written ? 0 : errno;
  const bool closed = std::fclose(f) == 0;
  TANDEM_CHECK(written && closed, IOError, "writing {} failed (disk full?): {}", tmp, std::strerror(err != 0 ? err : errno));
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TANDEM_CHECK(!ec, IOError, "cannot rename {} to {}: {}", tmp, path, ec.message());
}

TrainSummary run_training(const Config& cfg, const TrainerOptions& opts) {
  // =========================== set-up ===========================
  // ---- process group (only when launched with WORLD_SIZE > 1) ----
  const dist::LaunchEnv env = dist::read_launch_env();
  const int world = std::max(1, env.world_size);
  TANDEM_CHECK(world == cfg.world_size, ValueError,
               "train: the config was resolved for world size {}, but this launch has WORLD_SIZE {}", cfg.world_size, world);
  std::shared_ptr<dist::ProcessGroup> pg;
  if (world > 1) {
    dist::InitOptions io;
    io.backend = cfg.dist.backend;
    io.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.timeout_s * 1000));
    pg = dist::is_initialized() ? dist::default_group() : dist::init_process_group(io);
    check_same_config(*pg, cfg);
  } else if (cfg.ddp.options.deterministic) {
    // One process in deterministic mode still sums its micro-batches in DDP's tree: a group of one.
    pg = dist::make_process_group(
        "shm", std::make_shared<dist::HashStore>(),
        0, 1, {.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.timeout_s * 1000))});
  }
  const int rank = pg ? pg->rank() : 0;
  const bool main_rank = rank == 0;
  set_num_threads(static_cast<int>(cfg.train.threads));
  manual_seed(cfg.seed);

  // ---- data: each rank its DistributedSampler share, micro-batches of train_micro_batch_size_per_gpu ----
  const Data data = make_data(cfg);
  if (pg && pg->size() > 1) check_same_data(*pg, cfg, data);
  data::DistributedSampler sampler(data.train->size(),
                                   {.num_replicas = world,
                                    .rank = rank,
                                    .shuffle = true,
                                    .seed = cfg.seed,
                                    .drop_last = true,
                                    .block = cfg.ddp.options.deterministic
                                                 ? cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
                                                 : 0});
  // The sampler gives every rank an equal share (drop_last there trims the dataset to a multiple
  // of the world size), so a partial last micro-batch has the same size on every rank. In
  // deterministic mode it deals whole per-rank blocks of each global batch instead (and cuts the
  // epoch to whole global batches).
  data::DataLoader loader(*data.train, {.batch_size = cfg.train_micro_batch_size_per_gpu,
                                        .sampler = &sampler,
                                        .drop_last = cfg.data.drop_last,
                                        .num_workers = cfg.data.num_workers});
  const int64_t gas = cfg.gradient_accumulation_steps;
  TANDEM_CHECK(loader.size() >= 1, ValueError,
               "train: the dataset has {} examples, fewer than one micro-batch of {} per rank on {} ranks", data.train->size(),
               cfg.train_micro_batch_size_per_gpu, world);
  // Micro-batches run on across epoch boundaries (an accumulation may span two epochs), so N
  // epochs are N * micro-batches-per-epoch / gas steps; per epoch, floor(size / gas) steps left
  // each epoch's remainder out and trained fewer epochs than asked (10 gave 8 at gas 4, M 10).
  int64_t epoch_micro_batches = 0;
  TANDEM_CHECK(!__builtin_mul_overflow(cfg.train.epochs, static_cast<int64_t>(loader.size()), &epoch_micro_batches),
               ValueError, "train: train.epochs {} * {} micro-batches per epoch overflows; give fewer epochs",
               cfg.train.epochs, loader.size());
  const int64_t total_steps = cfg.train.steps > 0 ? cfg.train.steps : std::max<int64_t>(1, epoch_micro_batches / gas);

  // ---- model, optimizer, precision, DDP ----
  std::shared_ptr<nn::Module> model = make_model(cfg, data);
  const int64_t sync_bns = pg && cfg.ddp.sync_batchnorm ? parallel::convert_sync_batchnorm(*model, pg) : 0;
  std::shared_ptr<optim::Optimizer> opt = make_optimizer(cfg, model->parameters());
  Precision prec;
  prec.low = cfg.bf16 ? kBFloat16 : cfg.fp16.enabled ? kFloat16 : kFloat32;
  if (!cfg.opt_level.empty() && cfg.opt_level != "O0") {
    amp::InitializeOptions io;
    io.opt_level = cfg.opt_level;
    io.dtype = prec.low;
    io.scaler = scaler_options(cfg, pg, opts.out);
    if (prec.low == kFloat16 && cfg.fp16.loss_scale > 0) io.loss_scale = fmt::format("{}", cfg.fp16.loss_scale);
    prec.amp = amp::initialize(*model, *opt, io);
    prec.describe = fmt::format("{} amp {}", prec.low == kBFloat16 ? "bf16" : "fp16", cfg.opt_level);
  } else if (prec.low == kFloat16) {
    prec.scaler = std::make_unique<amp::GradScaler>(scaler_options(cfg, pg, opts.out));
    prec.describe = "fp16 autocast + GradScaler";
  } else {
    prec.describe = prec.low == kBFloat16 ? "bf16 autocast" : "fp32";
  }
  std::shared_ptr<parallel::DistributedDataParallel> ddp;
  std::string ddp_describe;
  std::shared_ptr<parallel::PowerSGDState> powersgd;
  std::shared_ptr<parallel::PostLocalSGDState> local_sgd;
  std::unique_ptr<parallel::ModelAverager> averager;
  if (pg) {
    const DdpConfig& dc = cfg.ddp;
    ddp = std::make_shared<parallel::DistributedDataParallel>(model, pg, dc.options);
    ddp->attach_optimizer(opt.get());
    if (dc.fused_optimizer) ddp->register_fused_optimizer(opt);
    if (dc.comm_hook == "fp16") ddp->register_comm_hook(parallel::fp16_compress_hook);
    if (dc.comm_hook == "bf16") ddp->register_comm_hook(parallel::bf16_compress_hook);
    std::string hook_text = dc.comm_hook == "no" ? "" : fmt::format(" with {} gradients on the wire", dc.comm_hook);
    if (dc.comm_hook == "power_sgd") {
      powersgd = std::make_shared<parallel::PowerSGDState>(dc.power_sgd);
      parallel::CommHook hook = parallel::powerSGD_hook(powersgd);
      if (dc.comm_wrapper == "fp16") hook = parallel::fp16_compress_wrapper(hook);
      if (dc.comm_wrapper == "bf16") hook = parallel::bf16_compress_wrapper(hook);
      ddp->register_comm_hook(hook);
      hook_text = fmt::format(" with PowerSGD rank {} from iteration {}{}", dc.power_sgd.matrix_approximation_rank,
                              dc.power_sgd.start_powerSGD_iter,
                              dc.comm_wrapper == "no" ? "" : fmt::format(" in {}", dc.comm_wrapper));
    }
    if (dc.comm_hook == "post_local_sgd") {
      const int64_t size = dc.subgroup_size > 0 ? dc.subgroup_size : env.local_world_size > 0 ? env.local_world_size : world;
      parallel::PostLocalSGDOptions o = dc.post_local;
      if (size == 1) o.post_local_gradient_allreduce = false;  // groups of one: each rank's own gradients
      // Groups of all ranks: DDP's own group (subgroup nullptr).
      if (o.post_local_gradient_allreduce && size < world) o.subgroup = dist::new_subgroups(static_cast<int>(size));
      local_sgd = std::make_shared<parallel::PostLocalSGDState>(o);
      ddp->register_comm_hook(parallel::post_localSGD_hook(local_sgd));
      std::string when;
      if (dc.averaging_hierarchy.empty()) {
        averager = std::make_unique<parallel::PeriodicModelAverager>(dc.averaging_period, dc.averaging_warmup_steps, pg);
        when = fmt::format("every {} steps", dc.averaging_period);
      } else {
        averager = std::make_unique<parallel::HierarchicalModelAverager>(dc.averaging_hierarchy, dc.averaging_warmup_steps);
        std::vector<std::string> levels;
        for (const auto& [period, group_size] : dc.averaging_hierarchy)
          levels.push_back(group_size == world ? fmt::format("every {} steps over all ranks", period)
                                               : fmt::format("every {} steps in groups of {}", period, group_size));
        when = fmt::format("{}", fmt::join(levels, ", "));
      }
      const std::string grads = !o.post_local_gradient_allreduce ? "each rank's own gradients"
                                : o.subgroup ? fmt::format("gradients averaged in groups of {}", size)
                                             : "gradients averaged over all ranks";
      hook_text = fmt::format(" with post-local SGD from iteration {} ({}; parameters averaged {} from step {})",
                              o.start_localSGD_iter, grads, when, dc.averaging_warmup_steps);
    }
    ddp_describe = fmt::format(", DDP over {}{}{}{}{}", world > 1 ? cfg.dist.backend : "one process", hook_text,
                               sync_bns ? fmt::format(", {} SyncBatchNorm", sync_bns) : "",
                               dc.options.deterministic ? ", deterministic" : "",
                               dc.fused_optimizer ? ", optimizer fused into backward" : "");
  }
  nn::Module& net = ddp ? static_cast<nn::Module&>(*ddp) : *model;
  DeepSpeedSchedule schedule(*opt, cfg.scheduler, total_steps);

  // ---- resume ----
  const std::string ckpt_root = opts.out_dir + "/checkpoints";
  const CheckpointTarget target{model.get(), opt.get(), prec.amp.get()};
  int64_t step = 0, skipped = 0;
  std::string resumed_from;
  {
    // Rank 0's verdict on how this run starts, the same error on every rank.
    std::string problem;
    if (main_rank) {
      try {
        problem = start_problem(cfg, opts, ckpt_root);
      } catch (const std::exception& e) {  // an unreadable --resume DIR, say: every rank says so
        problem = e.what();
      }
    }
    if (pg && pg->size() > 1) problem = dist::broadcast_string(*pg, problem, 0);
    if (!problem.empty()) throw ValueError(problem);
  }
  if (!opts.resume.empty()) {
    std::optional<std::string> dir = opts.resume == "auto" ? latest_checkpoint(ckpt_root) : std::optional(opts.resume);
    if (dir) {
      // Post-local SGD continues each rank's replica; any other run starts every rank from rank
      // 0's (its replicas must be identical, and DDP's broadcast came before the load).
      const bool own_replica = cfg.ddp.comm_hook == "post_local_sgd";
      const CheckpointState st = own_replica ? load_checkpoint(*dir, target, rank, world) : load_checkpoint(*dir, target);
      step = st.step;
      if (prec.scaler) prec.scaler->load_state_dict(st.scaler);
      loader.load_state({st.epoch, resume_position(st, *dir, world, cfg.train_micro_batch_size_per_gpu)});
      schedule.set_last_step(st.scheduler_step);
      default_generator().manual_seed(st.rng_seed);
      default_generator().set_offset(st.rng_offset);
      skipped = st.extra.value("skipped_steps", int64_t{0});
      if (powersgd) restore_powersgd(*powersgd, st, *dir, rank, world);
      if (local_sgd) restore_local_sgd(*local_sgd, *averager, st);
      resumed_from = *dir;
    }
  }
  if (resumed_from.empty()) schedule.set_last_step(0);
  if (pg && pg->size() > 1) check_same_start(*pg, resumed_from, step);

  // ---- outputs (rank 0) ----
  std::unique_ptr<JsonlWriter> jsonl;
  std::unique_ptr<TensorBoardWriter> tb;
  std::optional<Progress> progress;
  if (main_rank) {
    fs::create_directories(opts.out_dir);
    // The log continues through the step this run starts from; records after it (a resumed run
    // redoes those steps) and a fresh run's predecessors' (no checkpoint to continue) are dropped.
    if (cfg.log.jsonl)
      jsonl = std::make_unique<JsonlWriter>(opts.out_dir + "/metrics.jsonl", resumed_from.empty() ? -1 : step);
    if (cfg.log.tensorboard) tb = std::make_unique<TensorBoardWriter>(opts.out_dir + "/tensorboard");
    progress.emplace(total_steps, cfg.log.progress, cfg.steps_per_print, opts.out);
    progress->message(fmt::format(
        "tandem train: {} ({} parameters) on {} ({} train examples), {} x {} micro-batch x {} accumulation = batch {}, "
        "{} steps, {}{}{}",
        cfg.model.name, model->num_parameters(), cfg.data.name, data.train->size(), world, cfg.train_micro_batch_size_per_gpu,
        gas, cfg.train_batch_size, total_steps,
        // which kernels multiply in bf16 here (kernels/cpu/bf16_products.h)
        prec.low == kBFloat16
            ? fmt::format("{} (bf16 products {})", prec.describe, kernels::bf16_products_name(kernels::bf16_products()))
            : prec.describe,
        ddp_describe,
        resumed_from.empty() ? "" : fmt::format(", resumed from {} at step {}", resumed_from, step)));
  }

  TrainSummary sum;
  sum.precision = prec.describe;
  sum.world_size = world;
  sum.batch_size = cfg.train_batch_size;
  sum.threads = static_cast<int>(cfg.train.threads);

  double overhead_s = 0;  // checkpoints and evaluations, left out of train_seconds
  const auto save = [&](int64_t at_step) {
    const auto t0 = Clock::now();
    // Every rank holds the same state (DDP); rank 0 writes it, the others wait for it. PowerSGD's
    // error feedback is per rank: gathered to rank 0 first (a collective every rank makes here).
    std::vector<std::pair<std::string, Tensor>> hook_tensors;
    json hook_meta;
    if (powersgd) hook_tensors = gather_powersgd(*powersgd, *pg, &hook_meta);
    // Post-local SGD: the replicas differ between averagings, so every rank's goes in.
    std::vector<Replica> replicas;
    if (local_sgd) {
      replicas = gather_replicas(target, *pg);
      hook_meta = {{"type", "post_local_sgd"}, {"iter", local_sgd->iter()}, {"averager_step", averager->step()},
                   {"world_size", world}};
    }
    if (main_rank) {
      CheckpointState st;
      st.step = at_step;
      const data::DataLoaderState ls = loader.state();
      st.epoch = ls.epoch;
      st.batches_consumed = ls.batches_consumed;
      st.scheduler_step = schedule.last_step();
      st.rng_seed = default_generator().seed();
      st.rng_offset = default_generator().offset();
      if (prec.scaler) st.scaler = prec.scaler->state_dict();
      st.config = cfg.source;
      st.extra = {{"skipped_steps", skipped}, {"world_size", world}, {"micro_batch_size", cfg.train_micro_batch_size_per_gpu}};
      if (powersgd || local_sgd) {
        st.extra["comm_hook"] = hook_meta;
        st.comm_hook = std::move(hook_tensors);
      }
      sum.last_checkpoint = save_checkpoint(ckpt_root, target, st, cfg.train.keep_last, replicas);
    }
    if (pg) pg->barrier()->wait();
    overhead_s += seconds_since(t0);
  };
  const auto run_eval = [&](int64_t at_step) {
    if (!main_rank) return;
    const auto t0 = Clock::now();
    const EvalResult e = evaluate(*model, *data.eval, prec, data.text, cfg.data.eval_samples);
    sum.eval_loss = e.loss;
    sum.test_accuracy = e.accuracy;
    json rec = {{"step", at_step}, {"eval_loss", e.loss}};
    std::string line = fmt::format("eval step {}: loss {:.4f}", at_step, e.loss);
    if (e.accuracy >= 0) {
      rec["test_accuracy"] = e.accuracy;
      line += fmt::format("  accuracy {:.4f}", e.accuracy);
    }
    if (jsonl) jsonl->write(rec);
    if (tb) {
      std::vector<std::pair<std::string, double>> v = {{"eval/loss", e.loss}};
      if (e.accuracy >= 0) v.emplace_back("eval/accuracy", e.accuracy);
      tb->add_scalars(v, at_step);
    }
    progress->message(line);
    overhead_s += seconds_since(t0);
  };

  // =========================== the loop ===========================
  const std::vector<Tensor> opt_params = optimizer_params(*opt);
  std::optional<data::DataLoader::Iterator> it;
  std::deque<double> last_losses;
  reset_peak_allocated_bytes();
  const auto t_start = Clock::now();
  const int64_t first_step = step;
  const int64_t tokens_per_sample = data.text ? cfg.model.context : 0;
  while (step < total_steps) {
    const auto t_step = Clock::now();
    const double cpu_step0 = process_cpu_seconds();
    double data_wait = 0, loss_sum = 0;
    // ---- forward + backward over the micro-batches; DDP reduces on the last one only ----
    opt->zero_grad();
    for (int64_t micro = 0; micro < gas; ++micro) {
      const auto t_data = Clock::now();
      if (!it || *it == std::default_sentinel) {
        if (it) loader.set_epoch(loader.epoch() + 1);  // the previous pass ended
        it.emplace(loader.begin());
        if (*it == std::default_sentinel) {  // a resumed state at the very end of its epoch
          loader.set_epoch(loader.epoch() + 1);
          it.emplace(loader.begin());
        }
      }
      data::Batch batch = **it;
      ++*it;
      data_wait += seconds_since(t_data);
      std::optional<parallel::DistributedDataParallel::NoSyncGuard> no_sync;
      if (ddp && micro + 1 < gas) no_sync.emplace(*ddp);
      Tensor loss;
      {
        auto cast = prec.guard();
        loss = batch_loss(net, prec.input(batch[0]), batch[1], data.text);
      }
      loss_sum += loss.item();
      // (Deterministic mode: DDP divides the tree's sum by the micro-batch count itself.)
      const Tensor scaled_for_accum = gas > 1 && !cfg.ddp.options.deterministic ? loss / static_cast<double>(gas) : loss;
      if (prec.amp) {
        prec.amp->scale(scaled_for_accum).backward();
      } else if (prec.scaler) {
        prec.scaler->scale(scaled_for_accum).backward();
      } else {
        scaled_for_accum.backward();
      }
    }
    // ---- unscale, clip, step, update ----
    bool stepped = true;
    double grad_norm = 0;
    const double max_norm = cfg.gradient_clipping > 0 ? cfg.gradient_clipping : std::numeric_limits<double>::infinity();
    if (prec.amp) {
      const bool overflow = prec.amp->unscale_and_check();
      grad_norm = overflow ? std::numeric_limits<double>::quiet_NaN() : optim::clip_grad_norm_(opt_params, max_norm);
      opt->step();  // a no-op after an overflow (amp dropped the gradients)
      stepped = !overflow;
    } else if (prec.scaler) {
      prec.scaler->unscale_(*opt);
      grad_norm = optim::clip_grad_norm_(opt_params, max_norm);
      stepped = prec.scaler->step(*opt);
      prec.scaler->update();
    } else {
      grad_norm = optim::clip_grad_norm_(opt_params, max_norm);  // fused: max_norm is inf (config)
      if (!ddp || !ddp->fused_optimizer()) opt->step();          // fused: stepped inside backward
    }
    // Post-local SGD: after each optimizer step that happened (torch's PostLocalSGDOptimizer:
    // GradScaler's skipped steps never reach it) the averager may average what the optimizer
    // updates (amp O2: the f32 masters, then rounded into the model).
    if (averager && stepped && averager->average_parameters(opt_params) && prec.amp) prec.amp->copy_masters_to_model();
    const double lr = opt->param_groups()[0].options.at("lr");
    // As DeepSpeed: a skipped step does not advance the schedule.
    if (stepped) schedule.step();
    ++step;
    if (!stepped) ++skipped;

    // ---- diagnostics only below ----
    const double loss_mean = pg ? parallel::all_reduce_mean(loss_sum / static_cast<double>(gas), *pg)
                                : loss_sum / static_cast<double>(gas);
    last_losses.push_back(loss_mean);
    if (last_losses.size() > 50) last_losses.pop_front();
    const double step_s = seconds_since(t_step);
    const double cpu_s = process_cpu_seconds() - cpu_step0;
    const double samples_s = static_cast<double>(cfg.train_batch_size) / step_s;
    if (main_rank) {
      json rec = {{"step", step},
                  {"loss", loss_mean},
                  {"lr", lr},
                  {"loss_scale", prec.loss_scale()},
                  {"skipped_steps", skipped},
                  {"grad_norm", std::isfinite(grad_norm) ? json(grad_norm) : json(nullptr)},
                  {"samples_per_s", samples_s},
                  {"peak_bytes", peak_allocated_bytes()},
                  {"data_wait_s", data_wait},
                  {"step_s", step_s},
                  {"cpu_s", cpu_s}};
      if (tokens_per_sample > 0) rec["tokens_per_s"] = samples_s * static_cast<double>(tokens_per_sample);
      if (!stepped) {
        const auto& ov = prec.amp ? prec.amp->last_overflow() : prec.scaler->last_overflow();
        rec["overflow"] = ov ? ov->to_string() : "inf/nan gradients";
      }
      if (jsonl) jsonl->write(rec);
      if (tb) {
        std::vector<std::pair<std::string, double>> v = {{"train/loss", loss_mean},        {"train/lr", lr},
                                                         {"train/loss_scale", prec.loss_scale()}, {"train/samples_per_s", samples_s},
                                                         {"train/data_wait_s", data_wait},  {"train/skipped_steps", static_cast<double>(skipped)}};
        if (std::isfinite(grad_norm)) v.emplace_back("train/grad_norm", grad_norm);
        tb->add_scalars(v, step);
      }
      progress->update({.step = step, .loss = loss_mean, .loss_scale = prec.loss_scale(), .lr = lr, .samples_per_s = samples_s});
    }
    if (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0 && step < total_steps) run_eval(step);
    if (cfg.train.checkpoint_every > 0 && step % cfg.train.checkpoint_every == 0) save(step);
    if (opts.stop_after >= 0 && step >= opts.stop_after && step < total_steps) {
      sum.interrupted = true;
      break;
    }
    if (opts.stop_requested != nullptr && step < total_steps) {
      // A signal reaches the ranks at different moments: stop where any rank saw it, all together.
      const double local = opts.stop_requested->load() ? 1.0 : 0.0;
      if ((pg ? parallel::all_reduce_mean(local, *pg) : local) > 0) {
        if (cfg.train.checkpoint_every == 0 || step % cfg.train.checkpoint_every != 0) save(step);
        if (main_rank) {
          progress->message(fmt::format("stopped at step {} on request; checkpoint {}; continue with --resume auto", step,
                                        sum.last_checkpoint));
        }
        sum.interrupted = true;
        break;
      }
    }
  }
  sum.train_seconds = seconds_since(t_start) - overhead_s;
  const int64_t done_here = step - first_step;

  // =========================== the end ===========================
  if (!sum.interrupted) {
    if (cfg.train.checkpoint_every == 0 || step % cfg.train.checkpoint_every != 0) save(step);
    run_eval(step);
  }
  if (progress) progress->finish();
  sum.steps = step;
  sum.skipped_steps = skipped;
  sum.epochs = loader.epoch() + 1;
  sum.final_loss = last_losses.empty() ? 0.0
                                       : std::accumulate(last_losses.begin(), last_losses.end(), 0.0) /
                                             static_cast<double>(last_losses.size());
  sum.samples_per_s = sum.train_seconds > 0 ? static_cast<double>(done_here * cfg.train_batch_size) / sum.train_seconds : 0;
  sum.tokens_per_s = sum.samples_per_s * static_cast<double>(tokens_per_sample);
  sum.context = tokens_per_sample;
  sum.peak_bytes = peak_allocated_bytes();
  sum.loss_scale = prec.loss_scale();
  if (main_rank) {
    const json j = sum.to_json();
    write_text_atomically(opts.out_dir + "/summary.json", j.dump(2) + "\n");
    progress->message(fmt::format("summary: {}", j.dump()));
  }
  return sum;
}

}  // namespace tandem::train
