// DistributedDataParallel: construction-time agreement, forward bookkeeping, replica checks.
#include "tandem/parallel/ddp.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/error.h"
#include "tandem/core/hash.h"
#include "tandem/nn/norm.h"
#include "tandem/optim/optimizer.h"

namespace tandem::parallel {
namespace {

uint64_t checksum(const Tensor& t) {
  Tensor c = t.contiguous();
  uint64_t h = fnv1a(c.shape().data(), c.shape().size() * sizeof(int64_t));  // 0-dim: no bytes
  return checksum64(c.data_ptr(), c.nbytes(), h);
}

// One line per tensor: "kind name shape dtype".
std::vector<std::string> describe(const nn::NamedTensors& params, const nn::NamedTensors& buffers) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : params) {
    lines.push_back(fmt::format("parameter '{}' {} {}", name, shape_str(t.shape()), dtype_name(t.dtype())));
  }
  for (const auto& [name, t] : buffers) {
    lines.push_back(fmt::format("buffer '{}' {} {}", name, shape_str(t.shape()), dtype_name(t.dtype())));
  }
  return lines;
}

// One line per option whose disagreement across ranks breaks the collectives' lockstep or the
// replicas' equality: "name=value". (gradient_as_bucket_view and init_sync are rank-local.)
std::vector<std::string> describe(const DDPOptions& o) {
  std::vector<std::string> ignored = o.params_and_buffers_to_ignore;
  std::sort(ignored.begin(), ignored.end());
  return {fmt::format("bucket_cap_mb={}", o.bucket_cap_mb),
          fmt::format("first_bucket_mb={}", o.first_bucket_mb),
          fmt::format("broadcast_buffers={}", o.broadcast_buffers),
          fmt::format("find_unused_parameters={}", o.find_unused_parameters),
          fmt::format("static_graph={}", o.static_graph),
          fmt::format("delay_allreduce={}", o.delay_allreduce),
          fmt::format("check_replicas_every={}", o.check_replicas_every),
          fmt::format("deterministic={}", o.deterministic),
          fmt::format("params_and_buffers_to_ignore=[{}]", fmt::join(ignored, ", "))};
}

// join's throw_on_early_termination error, after `what` happened.
ValueError early_termination(const std::string& what) {
  return ValueError(fmt::format(
      "DistributedDataParallel.join: {}; with throw_on_early_termination every rank stops here. Give every rank the "
      "same number of batches (DistributedSampler pads), or join without throw_on_early_termination to go on "
      "without them",
      what));
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<dist::ProcessGroup> group, DDPOptions options)
    : nn::Module("DistributedDataParallel"), module_(std::move(module)), group_(std::move(group)), options_(options) {
  TANDEM_CHECK(module_ != nullptr, ValueError, "DistributedDataParallel: module is null");
  TANDEM_CHECK(group_ != nullptr, ValueError,
               "DistributedDataParallel: process group is null (call dist::init_process_group first)");
  register_module("module", module_);
  if (!options_.params_and_buffers_to_ignore.empty()) {
    std::set<std::string> known;
    for (const auto& [name, t] : module_->named_parameters()) known.insert(name);
    for (const auto& [name, t] : module_->named_buffers()) known.insert(name);
    for (const auto& name : options_.params_and_buffers_to_ignore) {
      TANDEM_CHECK(known.count(name) != 0, ValueError,
                   "DistributedDataParallel: params_and_buffers_to_ignore names '{}', which is neither a parameter "
                   "nor a buffer of the wrapped module; use the names named_parameters() / named_buffers() give "
                   "(e.g. '{}')",
                   name, known.empty() ? std::string("none: the module has no tensors") : *known.begin());
      ignored_.insert(name);
    }
  }
  // The parameters the reducer averages (it sees neither frozen nor ignored ones), and every
  // parameter's dtype, to detect a later cast.
  std::vector<std::pair<std::string, Tensor>> trainable;
  for (auto& [name, t] : module_->named_parameters()) {
    dtypes_.emplace_back(name, t.dtype());
    if (t.requires_grad() && ignored_.count(name) == 0) trainable.emplace_back(name, t);
  }
  // PyTorch refuses this too: there would be nothing to average, only buffers to broadcast.
  TANDEM_CHECK(!trainable.empty(), ValueError,
               "DistributedDataParallel is not needed when the module has no parameter that requires a gradient "
               "(its {} parameters are frozen or in params_and_buffers_to_ignore); train it without the wrapper, or "
               "set requires_grad on the parameters to train",
               dtypes_.size());
  if (options_.init_sync) {
    check_same_model();
    NoGradGuard no_grad;
    broadcast_tensors(synced_states());  // rank 0's values everywhere
  }

  ReducerOptions ro;
  ro.bucket_cap_mb = options_.bucket_cap_mb;
  ro.first_bucket_mb = options_.first_bucket_mb;
  ro.find_unused_parameters = options_.find_unused_parameters;
  ro.gradient_as_bucket_view = options_.gradient_as_bucket_view;
  ro.static_graph = options_.static_graph;
  ro.delay_allreduce = options_.delay_allreduce;
  ro.deterministic = options_.deterministic;
  reducer_ = Reducer::create(std::move(trainable), group_, ro);
}

DistributedDataParallel::~DistributedDataParallel() {
  if (fused_optimizer_) {
    reducer_->set_bucket_done(nullptr);
    fused_optimizer_->set_stepped_by("");
  }
}

void DistributedDataParallel::register_fused_optimizer(std::shared_ptr<optim::Optimizer> optimizer) {
  TANDEM_CHECK(optimizer != nullptr, ValueError, "DistributedDataParallel::register_fused_optimizer: got a null optimizer");
  TANDEM_CHECK(fused_optimizer_ == nullptr, ValueError,
               "DistributedDataParallel::register_fused_optimizer: this DDP already steps a {} in backward; one "
               "optimizer per DDP (put several parameter groups into it instead)",
               fused_optimizer_ ? fused_optimizer_->name() : "");
  TANDEM_CHECK(optimizer->stepped_by().empty(), ValueError,
               "DistributedDataParallel::register_fused_optimizer: this {} is already stepped by {}", optimizer->name(),
               optimizer->stepped_by());
  // Which of the reduced parameters (the reducer's indices) the optimizer holds.
  const Reducer& r = *reducer_;
  std::map<const TensorImpl*, int64_t> index;
  for (int64_t i = 0; i < r.num_parameters(); ++i) index.emplace(&r.parameter(i).impl(), i);
  auto held = std::make_shared<std::vector<char>>(static_cast<size_t>(r.num_parameters()), 0);
  for (const auto& g : optimizer->param_groups()) {
    for (const Tensor& p : g.params) {
      auto it = index.find(&p.impl());
      if (it != index.end()) {
        (*held)[static_cast<size_t>(it->second)] = 1;
        continue;
      }
      // A frozen parameter of the module gets no gradient, so step() would not update it either.
      std::string which = p.name().empty() ? "" : " \"" + p.name() + "\"";
      bool frozen = false;
      for (const auto& [name, t] : module_->named_parameters()) {
        if (&t.impl() != &p.impl()) continue;
        frozen = ignored_.count(name) == 0 && !t.requires_grad();
        which = fmt::format(" '{}' ({})", name, ignored_.count(name) ? "in params_and_buffers_to_ignore" : "frozen");
      }
      if (frozen) continue;
      throw ValueError(fmt::format(
          "DistributedDataParallel::register_fused_optimizer: the {}'s parameter{} of shape {} is not one this DDP "
          "reduces, so no bucket would step it. A fused optimizer must hold only the wrapped module's trained "
          "parameters (not another module's, an ignored one, or amp O2's f32 master copies: with O2, call "
          "optimizer.step() after backward instead)",
          optimizer->name(), which, shape_str(p.shape())));
    }
  }
  optimizer->set_stepped_by("DistributedDataParallel (register_fused_optimizer)");
  fused_optimizer_ = optimizer;
  if (optimizer_ == nullptr) optimizer_ = optimizer.get();
  optim::Optimizer* opt = optimizer.get();
  const Reducer* rp = reducer_.get();
  reducer_->set_bucket_done([opt, rp, held](const std::vector<int64_t>& params, bool last) {
    std::vector<Tensor> mine;
    mine.reserve(params.size());
    for (int64_t i : params) {
      if ((*held)[static_cast<size_t>(i)]) mine.push_back(rp->parameter(i));
    }
    if (!mine.empty()) opt->step_subset(mine);
    if (last) opt->run_step_post_hooks();
  });
}

nn::NamedTensors DistributedDataParallel::without_ignored(nn::NamedTensors tensors) const {
  if (!ignored_.empty()) std::erase_if(tensors, [&](const auto& nt) { return ignored_.count(nt.first) != 0; });
  return tensors;
}

std::vector<Tensor> DistributedDataParallel::synced_buffer_tensors() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : without_ignored(module_->named_buffers())) out.push_back(t);
  return out;
}

std::vector<Tensor> DistributedDataParallel::synced_states() const {
  std::vector<Tensor> all;
  for (auto& [name, t] : without_ignored(module_->named_parameters())) all.push_back(t);
  // broadcast_buffers=false keeps every rank's buffers also here (torch 2.x: at construction and
  // at the end of join only the parameters are taken from the source rank).
  if (options_.broadcast_buffers) {
    for (auto& t : synced_buffer_tensors()) all.push_back(t);
  }
  return all;
}

void DistributedDataParallel::check_same_model() {
  const std::vector<std::string> options_lines = describe(options_);
  // Buffers are compared only where they are broadcast (as torch verifies only what it syncs): a
  // rank-local buffer under broadcast_buffers=false may differ.
  std::vector<std::string> model_lines =
      describe(without_ignored(module_->named_parameters()),
               options_.broadcast_buffers ? without_ignored(module_->named_buffers()) : nn::NamedTensors{});
  // Whether each BatchNorm synchronizes its statistics: a model converted on some ranks only
  // (convert_sync_batchnorm behind a rank condition) would otherwise pass, then fail at its first
  // forward as a collective the other ranks never issue.
  for (const auto& [name, m] : module_->named_modules()) {
    if (const auto* bn = dynamic_cast<const nn::BatchNorm*>(m.get())) {
      model_lines.push_back(fmt::format("batch norm '{}' with {}", name.empty() ? "(the wrapped module)" : name,
                                        bn->group_stats ? "statistics over a process group (SyncBatchNorm)"
                                                        : "this rank's statistics (BatchNorm)"));
    }
  }
  // One gather settles both; the (rare) disagreement costs a few broadcasts more to explain.
  const auto diffs = dist::differences_from_rank0(*group_, {options_lines, model_lines});
  auto side = [](const std::optional<std::string>& line, int rank, const char* what) {
    return line ? *line : fmt::format("(nothing: rank {} has fewer {})", rank, what);
  };
  if (const dist::LinesDifference& d = diffs[0]; !d.ranks.empty()) {
    throw ValueError(fmt::format(
        "DistributedDataParallel: the options differ across ranks ({} from rank 0): rank 0 has {}, rank {} "
        "has {}. Pass the same DDPOptions on every rank (they decide which collectives each rank issues)",
        dist::ranks_differ(d.ranks), side(d.at0, 0, "options"), d.ranks.front(),
        side(d.at_first, d.ranks.front(), "options")));
  }
  if (const dist::LinesDifference& d = diffs[1]; !d.ranks.empty()) {
    throw ValueError(fmt::format(
        "DistributedDataParallel: the model differs across ranks ({} from rank 0). First difference, "
        "item #{}: rank 0 has {}, rank {} has {}. Build the same model on every rank before wrapping it",
        dist::ranks_differ(d.ranks), d.line, side(d.at0, 0, "items"), d.ranks.front(),
        side(d.at_first, d.ranks.front(), "items")));
  }
}

void coalesced(const std::vector<Tensor>& tensors, const std::function<void(Tensor& flat)>& collective,
               const std::function<Tensor(DType, int64_t)>& flat_for) {
  NoGradGuard no_grad;
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.dtype()].push_back(t);
  for (auto& [dt, list] : by_dtype) {
    int64_t total = 0;
    for (const auto& t : list) total += t.numel();
    Tensor flat = flat_for ? flat_for(dt, total) : empty({total}, dt);
    int64_t off = 0;
    for (const auto& t : list) {
      make_view(flat, t.shape(), contiguous_strides(t.shape()), off).copy_(t);
      off += t.numel();
    }
    collective(flat);
    off = 0;
    for (auto t : list) {
      t.copy_(make_view(flat, t.shape(), contiguous_strides(t.shape()), off));
      off += t.numel();
    }
  }
}

void DistributedDataParallel::broadcast_tensors(const std::vector<Tensor>& tensors, int root) {
  if (group_->size() == 1) return;
  coalesced(tensors, [&](Tensor& flat) { group_->broadcast(flat, root)->wait(); });
}

void DistributedDataParallel::before_forward() {
  size_t i = 0;
  for (const auto& [name, t] : module_->named_parameters()) {
    TANDEM_CHECK(i < dtypes_.size() && dtypes_[i].first == name, ValueError,
                 "DistributedDataParallel: the module's parameters changed after DDP was built ('{}' is new); build "
                 "DDP after the model is complete",
                 name);
    TANDEM_CHECK(t.dtype() == dtypes_[i].second, ValueError,
                 "DistributedDataParallel: parameter '{}' was {} when DDP was built but is {} now: the model was cast "
                 "after wrapping. Cast first (amp::initialize with O2, or module.to(dtype)), then build DDP",
                 name, dtype_name(dtypes_[i].second), dtype_name(t.dtype()));
    ++i;
  }
  int buffer_root = 0;
  bool all_train = true;
  if (join_active_ && group_->size() > 1) {
    const JoinRound round = join_round(true, autograd::is_grad_enabled() && require_sync_);
    if (join_options_.throw_on_early_termination && round.active < group_->size()) {
      throw early_termination(fmt::format("{} of {} ranks have run out of inputs (rank {} has not)",
                                          group_->size() - round.active, group_->size(), group_->rank()));
    }
    buffer_root = round.highest_active;
    all_train = round.active == group_->size();
    reducer_->set_join_divisor(join_options_.divide_by_initial_world_size ? 0 : round.active);
  }
  // As PyTorch: buffers are broadcast at a forward that follows a synchronized one (or the
  // construction), whatever the training flag — so the first eval forward after training evaluates
  // with rank 0's running statistics on every rank — and not after a no_sync or no-grad forward.
  // Under join they come from the highest rank still training.
  if (options_.broadcast_buffers && require_forward_param_sync_ && group_->size() > 1) {
    NoGradGuard no_grad;
    try {
      broadcast_tensors(synced_buffer_tensors(), buffer_root);
    } catch (const dist::CommError& e) {
      // A forward some ranks ran and others did not: most often an evaluation on rank 0 only
      // through the wrapper (PyTorch hangs there).
      dist::rethrow_with_hint(
          e, fmt::format(
                 "DistributedDataParallel: broadcasting rank {}'s buffers at this forward failed. Every rank must run "
                 "the DDP module's forward after a synchronized backward (broadcast_buffers): to evaluate on some "
                 "ranks only, call the wrapped module there (ddp.module()->forward), or build DDP with "
                 "broadcast_buffers=false; if some rank ran out of batches, run the training loop inside "
                 "DistributedDataParallel::join",
                 buffer_root));
    }
  }
  if (!is_training()) return;
  ++forwards_;
  if (options_.check_replicas_every > 0 && forwards_ % options_.check_replicas_every == 0 && all_train) {
    check_replicas();
  }
}

DistributedDataParallel::JoinRound DistributedDataParallel::join_round(bool active, bool sync) {
  const int world = group_->size();
  // [rank 0 trains, ..., rank w-1 trains, number of ranks whose backward reduces]
  Tensor t = zeros({world + 1}, kInt64);
  int64_t* v = t.data_ptr<int64_t>();
  v[group_->rank()] = active ? 1 : 0;
  v[world] = sync ? 1 : 0;
  try {
    group_->all_reduce(t, dist::ReduceOp::SUM)->wait();
  } catch (const dist::CommError& e) {
    dist::rethrow_with_hint(e, kJoinLockstepHint);
  }
  JoinRound round;
  for (int r = 0; r < world; ++r) {
    if (v[r] != 0) {
      ++round.active;
      round.highest_active = r;
    }
  }
  round.sync = v[world] != 0;
  return round;
}

void DistributedDataParallel::join(const std::function<void()>& loop, JoinOptions options) {
  if (!options.enable) {
    loop();
    return;
  }
  TANDEM_CHECK(!join_active_, ValueError, "DistributedDataParallel.join: already inside join() (joins do not nest)");
  TANDEM_CHECK(!options_.deterministic, ValueError,
               "DistributedDataParallel.join: the deterministic mode needs every rank to run the same micro-batches "
               "per step, so it cannot join uneven inputs; give every rank the same number of batches instead");
  // A SyncBatchNorm's forward is a collective a rank out of inputs cannot answer; with
  // throw_on_early_termination (what torch asks for there) every rank stops at the join round in
  // the forward's start, before that collective.
  if (!options.throw_on_early_termination) {
    for (const auto& [name, m] : module_->named_modules()) {
      // A SyncBatchNorm, or a BatchNorm convert_sync_batchnorm made synchronize (group_stats).
      const auto* bn = dynamic_cast<const nn::BatchNorm*>(m.get());
      TANDEM_CHECK(bn == nullptr || !bn->group_stats, ValueError,
                   "DistributedDataParallel.join: module '{}' is a SyncBatchNorm, whose forward is a collective that "
                   "a rank out of inputs cannot answer; join with throw_on_early_termination=true (every rank stops "
                   "at the first iteration some rank lacks), use BatchNorm, or give every rank the same number of "
                   "batches",
                   name.empty() ? std::string("(the wrapped module)") : name);
    }
  }
  join_active_ = true;
  join_options_ = options;
  struct Leave {
    DistributedDataParallel& ddp;
    ~Leave() {
      ddp.join_active_ = false;
      ddp.reducer_->set_join_divisor(0);
    }
  } leave{*this};

  loop();
  if (group_->size() == 1) return;

  // This rank is out of inputs: answer the others' iterations until every rank is.
  bool last = true;
  for (;;) {
    const JoinRound round = join_round(false, false);
    if (round.active == 0) break;
    last = false;
    if (options.throw_on_early_termination) {
      throw early_termination(
          fmt::format("rank {} ran out of inputs while {} other rank(s) still train", group_->rank(), round.active));
    }
    if (options_.broadcast_buffers && require_forward_param_sync_) {
      NoGradGuard no_grad;
      broadcast_tensors(synced_buffer_tensors(), round.highest_active);
    }
    require_forward_param_sync_ = round.sync;
    if (round.sync) reducer_->shadow_backward();
  }

  // Every rank takes the model of the highest rank among those that trained to the end, and its
  // count of training forwards (so check_replicas_every fires at the same forward everywhere).
  Tensor agree = tensor(std::vector<int64_t>{last ? group_->rank() : -1, forwards_}, {2});
  group_->all_reduce(agree, dist::ReduceOp::MAX)->wait();
  const int root = static_cast<int>(agree.data_ptr<int64_t>()[0]);
  forwards_ = agree.data_ptr<int64_t>()[1];
  NoGradGuard no_grad;
  broadcast_tensors(synced_states(), root);
}

Tensor DistributedDataParallel::forward(const Tensor& x) {
  return forward_with([&] { return module_->forward(x); });
}

Tensor DistributedDataParallel::forward_with(const std::function<Tensor()>& fn) {
  before_forward();
  Tensor out = fn();
  after_forward({out});
  return out;
}

std::vector<Tensor> DistributedDataParallel::forward_with(const std::function<std::vector<Tensor>()>& fn) {
  before_forward();
  std::vector<Tensor> outs = fn();
  after_forward(outs);
  return outs;
}

void DistributedDataParallel::after_forward(const std::vector<Tensor>& outputs) {
  // Armed whenever a backward may follow, in eval mode too (fine-tuning with frozen BatchNorm
  // statistics): PyTorch reduces such gradients; skipping them would leave them rank-local.
  const bool grad = autograd::is_grad_enabled();
  if (grad) reducer_->prepare_for_backward(require_sync_, outputs);
  require_forward_param_sync_ = grad && require_sync_;
}

void DistributedDataParallel::check_replicas() {
  std::vector<std::string> names;
  std::vector<int64_t> sums;
  std::vector<const TensorImpl*> ignored;  // the ignored parameters, whose optimizer state is rank-local too
  for (const auto& [name, t] : module_->named_parameters()) {
    if (ignored_.count(name) != 0) {
      ignored.push_back(t.impl_ptr().get());
      continue;
    }
    names.push_back("parameter '" + name + "'");
    sums.push_back(static_cast<int64_t>(checksum(t)));
  }
  if (optimizer_ != nullptr) {
    // The live state, in state_dict's order (parameters by index over all groups), not a copy.
    size_t i = 0;
    for (const auto& g : optimizer_->param_groups()) {
      for (const auto& p : g.params) {
        const bool skip = std::find(ignored.begin(), ignored.end(), p.impl_ptr().get()) != ignored.end();
        if (const auto* st = skip ? nullptr : optimizer_->state(p)) {
          for (const auto& [key, t] : *st) {
            names.push_back(fmt::format("optimizer state[{}].{}", i, key));
            sums.push_back(static_cast<int64_t>(checksum(t)));
          }
        }
        ++i;
      }
    }
  }
  // The checksums are compared by position: the ranks must first agree on what each position holds
  // (the same parameters, and optimizer state for the same ones: momentum made lazily on some
  // ranks only would otherwise be compared with another parameter's).
  if (const dist::LinesDifference d = dist::differences_from_rank0(*group_, {names})[0]; !d.ranks.empty()) {
    auto side = [](const std::optional<std::string>& line) { return line ? *line : std::string("nothing more"); };
    throw ValueError(fmt::format(
        "check_replicas: the ranks hold different tensors to compare ({} from rank 0): item #{} is {} on rank 0 but "
        "{} on rank {} (a different model, or optimizer state that exists on some ranks only)",
        dist::ranks_differ(d.ranks), d.line, side(d.at0), side(d.at_first), d.ranks.front()));
  }
  const auto all = dist::all_gather_i64(*group_, sums);
  for (size_t i = 0; i < sums.size(); ++i) {
    const std::vector<int> bad = dist::ranks_unlike_rank0(all, {i});
    if (!bad.empty()) {
      throw ValueError(fmt::format(
          "check_replicas: {} differs between rank 0 and rank(s) {} (checksums {:016x} vs {:016x}); the replicas "
          "diverged: look for rank-dependent updates (a step skipped on one rank, an unsynchronised random "
          "number, a gradient modified outside DDP)",
          names[i], fmt::join(bad, ", "), static_cast<uint64_t>(all[0][i]), static_cast<uint64_t>(all[bad[0]][i])));
    }
  }
}

// ---- metric helpers ----

std::function<bool(bool)> found_inf_reducer(std::shared_ptr<dist::ProcessGroup> group) {
  return [group](bool found) {
    if (group->size() == 1) return found;
    Tensor t = tensor(std::vector<double>{found ? 1.0 : 0.0}, {1}, kUInt8);
    group->all_reduce(t, dist::ReduceOp::MAX)->wait();
    return t.data_ptr<uint8_t>()[0] != 0;
  };
}

}  // namespace tandem::parallel
