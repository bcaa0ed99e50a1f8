// GradScaler and the loss-scale update rule.
#include "tandem/amp/grad_scaler.h"

#include <cmath>
#include <cstdio>

#include "tandem/amp/initialize.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/ops/elementwise.h"

namespace tandem::amp {

std::string OverflowReport::to_string() const {
  std::string s = fmt::format("GradScaler rank {} step {}: step skipped, scale {}:", rank, step, scale);
  if (entries.empty()) s += local ? " (no gradient named)" : " overflow on another rank";
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    s += fmt::format("{} {} ({} inf, {} nan of {})", i ? "," : "", e.name, e.num_inf, e.num_nan, e.numel);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// The update rule. Works as follows (PyTorch's _amp_update_scale_ when hysteresis is 1 and the
// floor 0; DeepSpeed's DynamicLossScaler.update_scale otherwise):
//   overflow: if no hysteresis is left, scale = max(scale * backoff, min_scale), else spend one;
//             the growth tracker restarts.
//   no overflow: tracker += 1; when it reaches growth_interval, scale *= growth (kept only when
//             finite), tracker = 0, hysteresis refilled. consecutive_hysteresis refills it on every
//             good step instead.
LossScaleRule::LossScaleRule(const GradScalerOptions& o)
    : scale_(static_cast<float>(o.initial_scale_power ? std::ldexp(1.0, *o.initial_scale_power) : o.init_scale)),
      growth_factor_(o.growth_factor),
      backoff_factor_(o.backoff_factor),
      min_scale_(o.min_loss_scale),
      growth_interval_(o.growth_interval),
      hysteresis_(o.hysteresis),
      dynamic_(o.dynamic),
      consecutive_hysteresis_(o.consecutive_hysteresis),
      hysteresis_left_(o.hysteresis) {
  TANDEM_CHECK(scale_ > 0 && std::isfinite(scale_), ValueError, "GradScaler: init_scale must be positive and finite, got {}",
               scale_);
  TANDEM_CHECK(o.growth_factor > 1.0, ValueError, "GradScaler: growth_factor must be > 1, got {}", o.growth_factor);
  TANDEM_CHECK(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, ValueError,
               "GradScaler: backoff_factor must be in (0, 1), got {}", o.backoff_factor);
  TANDEM_CHECK(o.growth_interval >= 1, ValueError, "GradScaler: growth_interval (loss_scale_window) must be >= 1, got {}",
               o.growth_interval);
  TANDEM_CHECK(o.hysteresis >= 1, ValueError, "GradScaler: hysteresis must be >= 1, got {}", o.hysteresis);
  TANDEM_CHECK(o.min_loss_scale >= 0, ValueError, "GradScaler: min_loss_scale must be >= 0, got {}", o.min_loss_scale);
}

void LossScaleRule::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    if (hysteresis_left_ <= 1) {
      scale_ = static_cast<float>(std::max(static_cast<double>(scale_) * backoff_factor_, min_scale_));
    } else {
      --hysteresis_left_;
    }
    growth_tracker_ = 0;
    return;
  }
  if (consecutive_hysteresis_) hysteresis_left_ = hysteresis_;
  if (++growth_tracker_ == growth_interval_) {
    const float grown = static_cast<float>(static_cast<double>(scale_) * growth_factor_);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
    hysteresis_left_ = hysteresis_;
  }
}

// ---------------------------------------------------------------------------------------------
namespace {

// x *= inv in place over n floats; returns whether any input was inf/nan. v * 0 is 0 for finite
// v and nan otherwise, so one vectorised sum detects both.
bool scale_f32(float* x, int64_t n, float inv) {
  float probe = 0.0f;
#pragma omp simd reduction(+ : probe)
  for (int64_t i = 0; i < n; ++i) {
    probe += x[i] * 0.0f;
    x[i] *= inv;
  }
  return !(probe == 0.0f);
}

void count_nonfinite(const float* x, int64_t n, float inv, int64_t& n_inf, int64_t& n_nan) {
  // Counted on the scaled values: inv is a positive finite number, so inf stays inf and nan nan.
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) ++n_nan;
    else if (std::isinf(x[i])) ++n_inf;
  }
}

}  // namespace

bool unscale_grads(const std::vector<Tensor>& grads, float inv_scale, const std::vector<std::string>& names,
                   std::vector<OverflowEntry>* entries, bool allow_fp16) {
  NoGradGuard no_grad;
  const auto name = [&](size_t i) { return i < names.size() ? names[i] : fmt::format("gradient {}", i); };
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    TANDEM_CHECK(is_floating(g.dtype()) && g.dtype() != kFloat64, DTypeError,
                 "GradScaler: cannot unscale a {} gradient ({}); expected float32, bfloat16 or float16",
                 dtype_name(g.dtype()), name(i));
    TANDEM_CHECK(allow_fp16 || g.dtype() != kFloat16, DTypeError,
                 "GradScaler: attempting to unscale a float16 gradient ({}): unscaled, its small values would fall "
                 "below float16's range and become 0 (PyTorch refuses it too). Keep the parameters in float32 (autocast "
                 "computes in float16) or use amp::initialize at O2, which keeps float32 master weights",
                 name(i));
  }
  bool any = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    Tensor g = grads[i];
    if (!g.defined()) continue;
    // Work on a dense f32 buffer: the gradient itself when it is, else a copy written back.
    const bool direct = g.dtype() == kFloat32 && g.is_contiguous();
    Tensor w = direct ? g : g.to(kFloat32).contiguous();
    float* p = w.data_ptr<float>();
    const bool bad = scale_f32(p, w.numel(), inv_scale);
    if (!direct) g.copy_(w);
    if (bad) {
      any = true;
      if (entries) {
        OverflowEntry e{name(i), 0, 0, w.numel()};
        count_nonfinite(p, w.numel(), inv_scale, e.num_inf, e.num_nan);
        entries->push_back(std::move(e));
      }
    }
  }
  return any;
}

// ---------------------------------------------------------------------------------------------
GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), enabled_(options_.enabled), rule_(options_) {}

void GradScaler::log(const std::string& line) const {
  if (options_.log) options_.log(line);
  else std::fprintf(stderr, "%s\n", line.c_str());
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!enabled_) return loss;
  return ops::mul(loss, scalar_tensor(rule_.scale(), kFloat32));
}

double GradScaler::get_scale() const { return enabled_ ? static_cast<double>(rule_.scale()) : 1.0; }

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  if (!enabled_) return;
  TANDEM_CHECK(optimizer.stepped_by().empty(), Error,
               "GradScaler.unscale_: optimizer {} is stepped by {} inside backward, before any unscale could happen; "
               "with a GradScaler (fp16), step the optimizer yourself (do not register it as DDP's fused optimizer)",
               optimizer.name(), optimizer.stepped_by());
  TANDEM_CHECK(!is_amp_managed(optimizer), Error,
               "GradScaler.unscale_: optimizer {} is managed by amp::initialize, which scales its loss itself; use "
               "amp::scale_loss(loss, optimizer) with it, or drop amp::initialize and keep this GradScaler",
               optimizer.name());
  if (auto it = per_optimizer_.find(&optimizer); it != per_optimizer_.end()) {
    TANDEM_CHECK(it->second.stage != Stage::unscaled, Error,
                 "unscale_() has already been called on this optimizer ({}) since the last update()", optimizer.name());
    TANDEM_CHECK(it->second.stage != Stage::stepped, Error,
                 "unscale_() is being called after step() ({}); call update() first", optimizer.name());
  }
  // PyTorch computes the reciprocal in f64 and rounds it to f32 once.
  const float inv = static_cast<float>(1.0 / static_cast<double>(rule_.scale()));
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (size_t gi = 0; gi < optimizer.param_groups().size(); ++gi) {
    const auto& group = optimizer.param_groups()[gi];
    for (size_t pi = 0; pi < group.params.size(); ++pi) {
      const Tensor& p = group.params[pi];
      if (!p.grad().defined()) continue;
      grads.push_back(p.grad());
      names.push_back(p.name().empty() ? fmt::format("group {} param {}", gi, pi) : p.name());
    }
  }
  // Checks every gradient before it changes any: a refused one leaves them all as they were.
  const bool local = unscale_grads(grads, inv, names, options_.provenance ? &pending_entries_ : nullptr);
  // From here the gradients are unscaled: should agreeing on found_inf fail (a collective), the
  // optimizer counts as unscaled with inf found, so that a retried unscale_ cannot divide twice
  // and step() cannot apply them.
  PerOptimizer& st = per_optimizer_[&optimizer];
  st.stage = Stage::unscaled;
  st.found_inf = true;
  st.num_grads = static_cast<int64_t>(grads.size());
  st.found_inf = options_.found_inf_reducer ? options_.found_inf_reducer(local) : local;
  if (st.found_inf && options_.provenance) {
    last_overflow_ = OverflowReport{updates_, options_.rank, get_scale(), local, std::move(pending_entries_)};
    pending_entries_.clear();
    log(last_overflow_->to_string());
  }
  pending_entries_.clear();
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  TANDEM_CHECK(optimizer.stepped_by().empty(), Error,
               "GradScaler.step: optimizer {} is stepped by {} inside backward, before the scaler could unscale the "
               "gradients and check them for inf/nan; with a GradScaler (fp16), step the optimizer yourself (do not "
               "register it as DDP's fused optimizer)",
               optimizer.name(), optimizer.stepped_by());
  TANDEM_CHECK(!is_amp_managed(optimizer), Error,
               "GradScaler.step: optimizer {} is managed by amp::initialize; mixing it with a manual GradScaler "
               "scales gradients twice. Use amp::scale_loss(loss, optimizer), or drop amp::initialize",
               optimizer.name());
  auto it = per_optimizer_.find(&optimizer);
  if (it != per_optimizer_.end()) {
    TANDEM_CHECK(it->second.stage != Stage::stepped, Error,
                 "step() has already been called on this optimizer ({}) since the last update()", optimizer.name());
  }
  if (it == per_optimizer_.end() || it->second.stage == Stage::ready) unscale_(optimizer);
  PerOptimizer& st = per_optimizer_[&optimizer];
  // PyTorch: "No inf checks were recorded for this optimizer." A step without any gradient is a
  // forgotten scale(loss).backward(), not a good step to count toward growth.
  TANDEM_CHECK(st.num_grads > 0, Error,
               "GradScaler.step: optimizer {} has no gradients (no inf checks were recorded for it); call "
               "scaler.scale(loss).backward() before scaler.step(optimizer)",
               optimizer.name());
  const bool stepped = !st.found_inf;
  if (stepped) optimizer.step();
  st.stage = Stage::stepped;
  return stepped;
}

void GradScaler::update() {
  if (!enabled_) return;
  TANDEM_CHECK(!per_optimizer_.empty(), Error,
               "GradScaler.update: no inf checks were recorded since the last update(); call step(optimizer) (or "
               "unscale_) first");
  bool found_inf = false;
  for (const auto& [opt, st] : per_optimizer_) found_inf = found_inf || st.found_inf;
  const float before = rule_.scale();
  rule_.update(found_inf);
  per_optimizer_.clear();
  ++updates_;
  if (!found_inf) {
    consecutive_skips_ = 0;
    return;
  }
  ++skipped_total_;
  ++consecutive_skips_;
  // ---- troubleshooting: warn once ----
  const bool at_floor = options_.dynamic && options_.min_loss_scale > 0 && rule_.scale() <= static_cast<float>(options_.min_loss_scale) &&
                        before <= static_cast<float>(options_.min_loss_scale);
  const bool many = options_.warn_after_skips > 0 && consecutive_skips_ >= options_.warn_after_skips;
  if (!warned_ && (many || at_floor)) {
    warned_ = true;
    std::string who;
    if (last_overflow_ && !last_overflow_->entries.empty()) {
      for (size_t i = 0; i < last_overflow_->entries.size() && i < 5; ++i) who += (i ? ", " : "") + last_overflow_->entries[i].name;
    } else {
      who = options_.provenance ? "none recorded on this rank" : "unknown (enable GradScalerOptions.provenance to name them)";
    }
    log(fmt::format(
        "GradScaler warning (rank {}): {} consecutive steps skipped for inf/nan gradients, scale now {}{}; offending "
        "gradients: {}. Usual fixes: lower the learning rate, clip gradients (unscale_ then clip_grad_norm_), adjust "
        "initial_scale_power, or train in bf16, which needs no loss scaling",
        options_.rank, consecutive_skips_, rule_.scale(), at_floor ? " (at min_loss_scale)" : "", who));
  }
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  TANDEM_CHECK(new_scale > 0 && std::isfinite(new_scale), ValueError, "GradScaler.update: new_scale must be positive and finite, got {}",
               new_scale);
  rule_.set_scale(static_cast<float>(new_scale));
  per_optimizer_.clear();
  ++updates_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!enabled_) return {};
  return {{"scale", rule_.scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(rule_.growth_tracker())},
          {"_hysteresis_left", static_cast<double>(rule_.hysteresis_left())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& s) {
  if (!enabled_) return;
  TANDEM_CHECK(!s.empty(), ValueError,
               "GradScaler.load_state_dict: the state dict is empty, possibly because it was saved from a disabled "
               "GradScaler");
  for (const char* k : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TANDEM_CHECK(s.count(k), ValueError, "GradScaler.load_state_dict: missing key \"{}\"", k);
  }
  // Checked whole (the rule's constructor checks the factors) before anything changes.
  const double scale = s.at("scale"), tracker = s.at("_growth_tracker"), interval = s.at("growth_interval");
  TANDEM_CHECK(std::isfinite(scale) && scale > 0 && std::isfinite(static_cast<float>(scale)), ValueError,
               "GradScaler.load_state_dict: scale {} is not a positive finite float32", scale);
  TANDEM_CHECK(interval >= 1 && interval <= 9.0e15 && interval == std::floor(interval), ValueError,
               "GradScaler.load_state_dict: growth_interval {} is not a whole number >= 1", interval);
  TANDEM_CHECK(tracker >= 0 && tracker < interval && tracker == std::floor(tracker), ValueError,
               "GradScaler.load_state_dict: _growth_tracker {} is not a whole number in [0, growth_interval {})",
               tracker, interval);
  GradScalerOptions o = options_;
  o.growth_factor = s.at("growth_factor");
  o.backoff_factor = s.at("backoff_factor");
  o.growth_interval = static_cast<int64_t>(interval);
  LossScaleRule rule(o);
  const int64_t hyst = s.count("_hysteresis_left") ? static_cast<int64_t>(s.at("_hysteresis_left")) : o.hysteresis;
  TANDEM_CHECK(hyst >= 0 && hyst <= std::max<int64_t>(o.hysteresis, 1), ValueError,
               "GradScaler.load_state_dict: _hysteresis_left {} is outside [0, hysteresis {}]", hyst, o.hysteresis);
  rule.set_state(static_cast<float>(scale), static_cast<int64_t>(tracker), hyst);
  options_ = std::move(o);
  rule_ = rule;
}

}  // namespace tandem::amp
