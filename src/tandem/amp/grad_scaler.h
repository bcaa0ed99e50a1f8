// GradScaler: dynamic loss scaling with PyTorch's semantics and defaults, DeepSpeed's extras
// (static scale, hysteresis, min_loss_scale, loss_scale_window, initial_scale_power), agreement
// on overflow across ranks through an injectable reducer, and overflow provenance.
// Invariant: a skipped step leaves every parameter and every optimizer state bitwise unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tandem/core/tensor.h"
#include "tandem/optim/optimizer.h"

namespace tandem::amp {

// Reduces this rank's "found inf/nan" flag across ranks (a MAX all-reduce) and returns the
// agreed flag; DDP plugs its process group in here. Called once per unscale, on every rank.
using FoundInfReducer = std::function<bool(bool local_found_inf)>;
// Where warnings and provenance lines go (default: one line on stderr).
using LogSink = std::function<void(const std::string& line)>;

struct GradScalerOptions {
  // ---- PyTorch's GradScaler ----
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // DeepSpeed's loss_scale_window
  bool enabled = true;
  // ---- DeepSpeed's extras ----
  std::optional<int> initial_scale_power;  // when set, init_scale = 2^initial_scale_power
  bool dynamic = true;                     // false: a static loss scale (init_scale), never changed
  // Overflows tolerated before the scale backs off (DeepSpeed's hysteresis; its default is 2,
  // 1 is PyTorch's rule). Reset to its full value when the scale grows, or after every good step
  // with consecutive_hysteresis.
  int64_t hysteresis = 1;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 0.0;  // backoff never goes below this (DeepSpeed's default is 1)
  // ---- distributed agreement ----
  FoundInfReducer found_inf_reducer;  // empty: single process
  int rank = 0;                       // named in provenance and warnings
  // ---- diagnostics ----
  bool provenance = false;       // record which gradients held inf/nan when a step is skipped
  int64_t warn_after_skips = 10;  // warn once after this many consecutive skipped steps (0: never)
  LogSink log;                   // empty: stderr
};

// One gradient that held non-finite values.
struct OverflowEntry {
  std::string name;  // the parameter's name, or "group G param I"
  int64_t num_inf = 0;
  int64_t num_nan = 0;
  int64_t numel = 0;
};

// Why a step was skipped: the gradients that held inf/nan on this rank, before reduction.
struct OverflowReport {
  int64_t step = 0;  // the scaler's update count when it happened
  int rank = 0;
  double scale = 0;  // the scale the gradients were multiplied by
  bool local = false;  // true when this rank's own gradients overflowed (else another rank's did)
  std::vector<OverflowEntry> entries;
  // "GradScaler rank 0 step 12: skipped, scale 65536: fc1.weight (3 inf, 0 nan of 1024), ..."
  std::string to_string() const;
};

// The scale-update rule alone (PyTorch's _amp_update_scale_ plus DeepSpeed's hysteresis and
// floor), shared by GradScaler and amp::initialize. The scale is kept in f32, as PyTorch keeps it
// in a float32 tensor, so that sequences agree bitwise.
class LossScaleRule {
 public:
  explicit LossScaleRule(const GradScalerOptions& o);
  // One update after a step: backs off (or spends hysteresis) on found_inf, grows after
  // growth_interval good steps in a row.
  void update(bool found_inf);
  float scale() const { return scale_; }
  void set_scale(float s) { scale_ = s; }
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_left() const { return hysteresis_left_; }
  void set_state(float scale, int64_t growth_tracker, int64_t hysteresis_left) {
    scale_ = scale;
    growth_tracker_ = growth_tracker;
    hysteresis_left_ = hysteresis_left;
  }

 private:
  float scale_;
  // The factors stay f64: PyTorch multiplies the f32 scale by the f64 factor and rounds once.
  double growth_factor_, backoff_factor_, min_scale_;
  int64_t growth_interval_, hysteresis_;
  bool dynamic_, consecutive_hysteresis_;
  int64_t growth_tracker_ = 0, hysteresis_left_;
};

// Multiplies every gradient in `grads` by inv_scale in place (f32 arithmetic; f16/bf16
// gradients are widened and rounded back) and counts non-finite values per gradient. Returns
// whether any was found; fills `entries` (with `names`) only when it is non-null. Every gradient's
// dtype is checked before any changes: f32/bf16, and f16 only with allow_fp16 (PyTorch's
// GradScaler refuses f16 gradients: unscaled values below f16's range become 0; Apex's O3 takes
// them); otherwise DTypeError naming the gradient.
bool unscale_grads(const std::vector<Tensor>& grads, float inv_scale, const std::vector<std::string>& names,
                   std::vector<OverflowEntry>* entries, bool allow_fp16 = false);

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale (differentiable; the scale is an f32 scalar). Disabled: the loss itself.
  Tensor scale(const Tensor& loss) const;
  // Divides this optimizer's gradients by the scale in place and records whether any is inf/nan
  // (agreed across ranks through the reducer). Once per optimizer between update()s: a second
  // call, or a call after step(), throws Error. Lets you clip_grad_norm_ on true gradients.
  void unscale_(optim::Optimizer& optimizer);
  // unscale_ (unless done), then optimizer.step() unless a gradient was inf/nan. Returns whether
  // it stepped. A second step() before update() throws Error. Disabled: just steps.
  bool step(optim::Optimizer& optimizer);
  // Adjusts the scale from the found_inf flags of this iteration's optimizers (throws when no
  // unscale/step happened since the last update), or sets it to new_scale.
  void update();
  void update(double new_scale);

  double get_scale() const;  // 1.0 when disabled
  bool is_enabled() const { return enabled_; }
  double get_growth_factor() const { return options_.growth_factor; }
  double get_backoff_factor() const { return options_.backoff_factor; }
  int64_t get_growth_interval() const { return options_.growth_interval; }
  void set_found_inf_reducer(FoundInfReducer r) { options_.found_inf_reducer = std::move(r); }
  void set_rank(int rank) { options_.rank = rank; }

  // Diagnostics.
  int64_t skipped_steps() const { return skipped_total_; }
  int64_t consecutive_skips() const { return consecutive_skips_; }
  // The last skipped step's provenance (only filled with options.provenance).
  const std::optional<OverflowReport>& last_overflow() const { return last_overflow_; }

  // PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker (plus
  // _hysteresis_left). Empty when disabled, as in PyTorch.
  std::map<std::string, double> state_dict() const;
  // Throws ValueError for an empty dict (saved from a disabled scaler) or a missing key.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { ready, unscaled, stepped };
  struct PerOptimizer {
    Stage stage = Stage::ready;
    bool found_inf = false;
    int64_t num_grads = 0;  // gradients unscale_ saw
  };
  void log(const std::string& line) const;

  GradScalerOptions options_;
  bool enabled_;
  LossScaleRule rule_;
  // Per-step state of each optimizer seen since the last update() (PyTorch keys it by id()).
  std::map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
  int64_t updates_ = 0, skipped_total_ = 0, consecutive_skips_ = 0;
  bool warned_ = false;
  std::optional<OverflowReport> last_overflow_;
  std::vector<OverflowEntry> pending_entries_;
};

}  // namespace tandem::amp
