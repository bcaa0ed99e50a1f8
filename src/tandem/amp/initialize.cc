// amp::initialize (Apex's opt levels) and amp::scale_loss over the GradScaler's rule.
#include "tandem/amp/initialize.h"

#include <cmath>

#include <cstdio>
#include <map>
#include <mutex>
#include <set>

#include "tandem/autograd/grad_mode.h"
#include "tandem/nn/norm.h"
#include "tandem/ops/elementwise.h"

namespace tandem::amp {
namespace {

// Which optimizers and models an Amp manages. Process-wide (an optimizer can be handed between
// threads), guarded by a mutex; entries are removed by ~Amp, so a key is never a dead object's
// address while registered.
struct Registry {
  std::mutex mu;
  std::map<const optim::Optimizer*, Amp*> optimizers;
  std::set<const nn::Module*> models;
};
Registry& registry() {
  static Registry r;
  return r;
}

bool is_norm(const nn::Module& m) {
  return dynamic_cast<const nn::BatchNorm*>(&m) || dynamic_cast<const nn::LayerNorm*>(&m) ||
         dynamic_cast<const nn::GroupNorm*>(&m);
}

// Re-points t's TensorImpl at a converted copy, so every holder (module, optimizer) sees it.
void convert_in_place(const Tensor& t, DType dtype) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return;
  Tensor c = t.detach().to(dtype).contiguous();
  TensorImpl& impl = t.impl();
  impl.storage = c.storage();
  impl.strides = c.strides();
  impl.offset = c.offset();
  impl.dtype = dtype;
}

}  // namespace

OptLevel parse_opt_level(const std::string& s) {
  if (s == "O0") return OptLevel::O0;
  if (s == "O1") return OptLevel::O1;
  if (s == "O2") return OptLevel::O2;
  if (s == "O3") return OptLevel::O3;
  throw ValueError(fmt::format("amp: unknown opt_level \"{}\" (expected O0, O1, O2 or O3; the letter O, not zero)", s));
}

void cast_module(nn::Module& module, DType dtype, bool keep_norm_fp32) {
  for (auto& [name, m] : module.named_modules()) {
    if (keep_norm_fp32 && is_norm(*m)) continue;
    for (auto& [pname, p] : m->named_parameters(false)) {
      convert_in_place(p, dtype);
      if (p.grad().defined()) p.set_grad(Tensor());
    }
    for (auto& [bname, b] : m->named_buffers(false)) convert_in_place(b, dtype);
  }
}

bool is_amp_managed(const optim::Optimizer& optimizer) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.optimizers.count(&optimizer) > 0;
}

// ---------------------------------------------------------------------------------------------
std::unique_ptr<Amp> initialize(nn::Module& model, optim::Optimizer& optimizer, const InitializeOptions& options) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    TANDEM_CHECK(!r.optimizers.count(&optimizer), Error,
                 "amp::initialize: optimizer {} was already initialized; call amp::initialize once per model and "
                 "optimizer",
                 optimizer.name());
    TANDEM_CHECK(!r.models.count(&model), Error,
                 "amp::initialize: this model ({}) was already initialized; call amp::initialize once per model",
                 model.type_name());
  }
  return std::unique_ptr<Amp>(new Amp(model, optimizer, options));
}

Amp::Amp(nn::Module& model, optim::Optimizer& optimizer, const InitializeOptions& o)
    : model_(model),
      optimizer_(optimizer),
      level_(parse_opt_level(o.opt_level)),
      dtype_(o.dtype),
      scaler_options_(o.scaler),
      rule_(o.scaler) {
  TANDEM_CHECK(dtype_ == kBFloat16 || dtype_ == kFloat16, DTypeError,
               "amp::initialize: dtype must be bfloat16 or float16, got {}", dtype_name(dtype_));
  master_ = o.master_weights.value_or(level_ == OptLevel::O2);
  keep_norm_fp32_ = o.keep_batchnorm_fp32.value_or(level_ == OptLevel::O2);
  TANDEM_CHECK(!(master_ && (level_ == OptLevel::O0 || level_ == OptLevel::O1)), ValueError,
               "amp::initialize: master_weights needs low-precision weights (O2 or O3), got {}", o.opt_level);
  const std::string ls = o.loss_scale.empty() ? (level_ == OptLevel::O1 || level_ == OptLevel::O2 ? "dynamic" : "1")
                                              : o.loss_scale;
  if (ls == "dynamic") {
    scaling_ = true;
  } else {
    double v = 0;
    try {
      size_t pos = 0;
      v = std::stod(ls, &pos);
      if (pos != ls.size()) v = 0;
    } catch (const std::exception&) {
    }
    TANDEM_CHECK(v > 0, ValueError, "amp::initialize: loss_scale must be \"dynamic\" or a positive number, got \"{}\"", ls);
    scaler_options_.dynamic = false;
    scaler_options_.init_scale = v;
    scaler_options_.initial_scale_power.reset();
    scaling_ = v != 1.0;
    rule_ = LossScaleRule(scaler_options_);
  }

  // ---- check the optimizer was built on this f32 model and has not stepped ----
  std::map<const TensorImpl*, std::string> names;
  for (auto& [name, p] : model.named_parameters()) names[&p.impl()] = name;
  for (const auto& g : optimizer.param_groups()) {
    for (const Tensor& p : g.params) {
      TANDEM_CHECK(names.count(&p.impl()), Error,
                   "amp::initialize: optimizer {} holds a tensor of shape {} that is not a parameter of the model; build "
                   "the optimizer on model.parameters() and pass both to amp::initialize",
                   optimizer.name(), shape_str(p.shape()));
      TANDEM_CHECK(p.dtype() == kFloat32, Error,
                   "amp::initialize: parameter \"{}\" is already {}: the model was cast before initialize (or the "
                   "optimizer built after the cast); build the optimizer on the float32 model and let amp::initialize "
                   "cast it",
                   names[&p.impl()], dtype_name(p.dtype()));
    }
  }
  for (const auto& st : optimizer.state_dict().state) {
    TANDEM_CHECK(st.empty(), Error,
                 "amp::initialize: optimizer {} already has state (it has stepped); call amp::initialize before "
                 "training",
                 optimizer.name());
  }
  for (auto& [name, p] : model.named_parameters()) {
    if (p.name().empty()) p.set_name(name);  // provenance names the parameter
  }

  // ---- cast the model, make the f32 masters ----
  if (level_ == OptLevel::O2 || level_ == OptLevel::O3) {
    std::vector<std::pair<size_t, size_t>> lowp_slots;
    cast_module(model, dtype_, keep_norm_fp32_);
    if (master_) {
      NoGradGuard no_grad;
      for (auto& g : optimizer.param_groups()) {
        for (Tensor& p : g.params) {
          if (p.dtype() == kFloat32) continue;  // a kept-f32 norm parameter is its own master
          Tensor m = p.detach().to(kFloat32).contiguous().clone();
          m.requires_grad_(true);
          m.set_name(p.name());
          model_lowp_.push_back(p);
          masters_.push_back(m);
          p = m;  // the optimizer now updates the master
        }
      }
      hook_ = optimizer.register_step_post_hook([this](optim::Optimizer&) { write_back(); });
    }
  }
  // An overflow skips one optimizer step (Apex patches step() to skip once): it ends there.
  step_hook_ = optimizer.register_step_post_hook([this](optim::Optimizer&) { step_overflowed_ = false; });
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.optimizers[&optimizer] = this;
  r.models.insert(&model);
}

Amp::~Amp() {
  if (hook_ >= 0) optimizer_.remove_step_post_hook(hook_);
  if (step_hook_ >= 0) optimizer_.remove_step_post_hook(step_hook_);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.optimizers.erase(&optimizer_);
  r.models.erase(&model_);
}

autocast Amp::forward_autocast() const {
  return autocast(AutocastOptions{.dtype = dtype_, .enabled = level_ == OptLevel::O1});
}

Tensor Amp::cast_input(const Tensor& x) const {
  const bool low = level_ == OptLevel::O2 || level_ == OptLevel::O3;
  if (low && is_floating(x.dtype()) && x.dtype() != dtype_) return x.to(dtype_);
  return x;
}

Tensor Amp::scale(const Tensor& loss) const {
  if (!scaling_) return loss;
  return ops::mul(loss, scalar_tensor(rule_.scale(), kFloat32));
}

void Amp::write_back() {
  // master (f32) -> model weight (bf16/f16), rounded once to nearest even.
  NoGradGuard no_grad;
  for (size_t i = 0; i < masters_.size(); ++i) model_lowp_[i].copy_(masters_[i]);
}

void Amp::stash_gradients() {
  for (auto& g : optimizer_.param_groups()) {
    for (const Tensor& p : g.params) {
      if (!p.grad().defined()) continue;
      Tensor& kept = stash_[&p.impl()];
      NoGradGuard no_grad;
      if (kept.defined()) {
        kept.add_(p.grad());  // stashed twice without unscale_and_check in between
      } else {
        // A copy: the gradient may be a view of memory the next backward writes into (DDP's
        // gradient_as_bucket_view bucket slot).
        kept = p.grad().clone();
      }
      p.set_grad(Tensor());
    }
  }
}

bool Amp::unscale_and_check() {
  NoGradGuard no_grad;
  // The stash goes back whatever happens below (added to the new gradients, or dropped with them).
  std::map<const TensorImpl*, Tensor> stash = std::move(stash_);
  stash_.clear();
  // ---- O2: low-precision grads become the masters' f32 grads ----
  for (size_t i = 0; i < masters_.size(); ++i) {
    Tensor g = model_lowp_[i].grad();
    if (!g.defined()) continue;
    Tensor acc = masters_[i].grad();
    Tensor g32 = g.to(kFloat32).contiguous();
    if (acc.defined()) acc.add_(g32);  // accumulation across backward passes
    else masters_[i].set_grad(g32);
    model_lowp_[i].set_grad(Tensor());
  }
  // ---- unscale in place and check ----
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (auto& g : optimizer_.param_groups()) {
    for (const Tensor& p : g.params) {
      if (!p.grad().defined()) continue;
      grads.push_back(p.grad());
      names.push_back(p.name());
    }
  }
  const float inv = static_cast<float>(1.0 / static_cast<double>(rule_.scale()));
  std::vector<OverflowEntry> entries;
  bool local = false;
  try {
    // Apex's O3 keeps f16 parameters (and gradients) without masters: allowed here.
    local = unscale_grads(grads, scaling_ ? inv : 1.0f, names, scaler_options_.provenance ? &entries : nullptr,
                          /*allow_fp16=*/true);
  } catch (...) {
    stash_ = std::move(stash);  // set aside again: a retry unscales only the new gradients
    throw;
  }
  bool found = true;
  try {
    found = scaler_options_.found_inf_reducer ? scaler_options_.found_inf_reducer(local) : local;
  } catch (...) {
    // The ranks could not agree (a collective failed): this step is skipped, the earlier
    // micro-batches' gradients are kept.
    for (auto& g : optimizer_.param_groups())
      for (const Tensor& p : g.params) p.set_grad(Tensor());
    stash_ = std::move(stash);
    step_overflowed_ = true;
    throw;
  }
  // Already unscaled gradients of earlier scale_loss calls this step come back.
  for (auto& g : optimizer_.param_groups()) {
    for (const Tensor& p : g.params) {
      auto it = stash.find(&p.impl());
      if (it == stash.end()) continue;
      if (p.grad().defined()) {
        Tensor grad = p.grad();
        grad.add_(it->second);
      } else {
        p.set_grad(it->second);
      }
    }
  }
  if (found) step_overflowed_ = true;
  if (step_overflowed_) {
    // This step is skipped: also the gradients of a later scale_loss before step() are dropped.
    for (auto& g : optimizer_.param_groups())
      for (const Tensor& p : g.params) p.set_grad(Tensor());
  }
  if (found) {
    ++skipped_;
    if (scaler_options_.provenance) {
      last_overflow_ = OverflowReport{updates_, scaler_options_.rank, get_scale(), local, std::move(entries)};
      if (scaler_options_.log) scaler_options_.log(last_overflow_->to_string());
      else std::fprintf(stderr, "%s\n", last_overflow_->to_string().c_str());
    }
    // Dropping the gradients (above) makes the next optimizer.step() a no-op: parameters and
    // state stay bitwise unchanged (optimizers skip parameters without a gradient).
  }
  rule_.update(found);
  ++updates_;
  return found;
}

Amp::State Amp::state_dict() const {
  State s;
  s.optimizer = optimizer_.state_dict();
  for (const Tensor& m : masters_) s.master_params.push_back(m.detach().clone());
  s.scaler = {{"scale", rule_.scale()},
              {"_growth_tracker", static_cast<double>(rule_.growth_tracker())},
              {"_hysteresis_left", static_cast<double>(rule_.hysteresis_left())}};
  return s;
}

void Amp::load_state_dict(const State& s) {
  TANDEM_CHECK(s.master_params.size() == masters_.size(), ValueError,
               "amp: the state has {} master parameters, this model has {}", s.master_params.size(), masters_.size());
  for (size_t i = 0; i < masters_.size(); ++i) {
    TANDEM_CHECK(s.master_params[i].shape() == masters_[i].shape(), ValueError,
                 "amp: master parameter {} (\"{}\") has shape {} in the state, {} here", i, masters_[i].name(),
                 shape_str(s.master_params[i].shape()), shape_str(masters_[i].shape()));
  }
  // Everything checked before anything changes.
  for (const char* k : {"scale", "_growth_tracker", "_hysteresis_left"}) {
    TANDEM_CHECK(s.scaler.count(k), ValueError, "amp: scaler state is missing \"{}\"", k);
  }
  const double scale = s.scaler.at("scale");
  TANDEM_CHECK(std::isfinite(scale) && scale > 0, ValueError,
               "amp: the scaler state's scale is {}; a loss scale must be finite and positive", scale);
  optimizer_.load_state_dict(s.optimizer);  // checks everything before it changes anything
  NoGradGuard no_grad;
  for (size_t i = 0; i < masters_.size(); ++i) masters_[i].copy_(s.master_params[i]);
  write_back();
  rule_.set_state(static_cast<float>(s.scaler.at("scale")), static_cast<int64_t>(s.scaler.at("_growth_tracker")),
                  static_cast<int64_t>(s.scaler.at("_hysteresis_left")));
}

// ---------------------------------------------------------------------------------------------
ScaledLoss::ScaledLoss(const Tensor& loss, optim::Optimizer& optimizer) : amp_(nullptr) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.optimizers.find(&optimizer);
    TANDEM_CHECK(it != r.optimizers.end(), Error,
                 "amp::scale_loss: optimizer {} is not managed by amp::initialize; call amp::initialize(model, "
                 "optimizer, ...) first (or use a GradScaler)",
                 optimizer.name());
    amp_ = it->second;
  }
  amp_->stash_gradients();
  scaled_ = amp_->scale(loss);
}

bool ScaledLoss::finish() {
  if (!done_) {
    done_ = true;
    overflow_ = amp_->unscale_and_check();
  }
  return overflow_;
}

ScaledLoss::~ScaledLoss() {
  try {
    finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp::scale_loss: unscaling failed: %s\n", e.what());
  }
}

}  // namespace tandem::amp
