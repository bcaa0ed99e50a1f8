// Apex's face over the same engine: amp::initialize(model, optimizer, {.opt_level = "O2"}) and
// amp::scale_loss(loss, optimizer). O0: f32. O1: autocast, f32 weights. O2: weights in bf16/f16
// except normalisation layers, f32 master copies and optimizer state, written back after each
// step. O3: pure low precision. Invariant: at O2 the optimizer only ever sees the f32 masters.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/amp/autocast.h"
#include "tandem/amp/grad_scaler.h"
#include "tandem/nn/module.h"
#include "tandem/optim/optimizer.h"

namespace tandem::amp {

enum class OptLevel { O0, O1, O2, O3 };
OptLevel parse_opt_level(const std::string& s);  // "O0".."O3"; throws ValueError otherwise

struct InitializeOptions {
  std::string opt_level = "O1";
  DType dtype = kBFloat16;                  // the low-precision dtype: bf16 or f16
  std::optional<bool> keep_batchnorm_fp32;  // default: true at O2, false at O3 (norm layers in f32)
  std::optional<bool> master_weights;       // default: true at O2, false otherwise
  std::string loss_scale;                   // "dynamic" or a number; default: "dynamic" at O1/O2, "1" at O0/O3
  GradScalerOptions scaler;                 // the dynamic scaler's settings (init scale, window, reducer, ...)
};

// The state amp::initialize sets up for one model and its optimizer. Owned by the caller; while it
// lives, the optimizer is "amp-managed" (a manual GradScaler on it is rejected).
class Amp {
 public:
  ~Amp();
  Amp(const Amp&) = delete;
  Amp& operator=(const Amp&) = delete;

  OptLevel opt_level() const { return level_; }
  DType dtype() const { return dtype_; }
  bool master_weights() const { return master_; }
  // The autocast guard the forward pass runs under: enabled at O1 only. At O2/O3 the model itself
  // is low precision (Apex casts the input, not each function): ops take bf16/f16 activations,
  // and the f32 normalisation parameters kept at O2 meet them inside the norm ops, which compute
  // statistics in f32 and return the input's dtype.
  autocast forward_autocast() const;
  // The model input in the model's dtype: cast to the low-precision dtype at O2/O3, else unchanged.
  Tensor cast_input(const Tensor& x) const;

  // Scales `loss` by the current scale (see ScaledLoss).
  Tensor scale(const Tensor& loss) const;
  // Before a backward whose gradients add to ones already unscaled (Apex's stash, for several
  // scale_loss per optimizer step): sets the optimizer's current gradients aside, so that
  // unscale_and_check divides only the new ones and adds them back. ScaledLoss calls it.
  void stash_gradients();
  // After backward on a scaled loss: O2 moves each low-precision gradient into its f32 master's
  // grad; then every gradient the optimizer will see (but a stashed one) is divided by the scale
  // and checked for inf/nan (agreed across ranks), and the stash is added back. On overflow every
  // such gradient is dropped, so that optimizer.step() changes nothing, and the scale backs off;
  // an overflow skips the whole step (every later scale_loss before step() drops its gradients
  // too, as Apex skips the next step()): call optimizer.step() after an overflow as after any
  // step (it is a no-op then). Returns whether this call found an overflow.
  bool unscale_and_check();
  double get_scale() const { return static_cast<double>(rule_.scale()); }
  int64_t skipped_steps() const { return skipped_; }
  const std::optional<OverflowReport>& last_overflow() const { return last_overflow_; }
  // f32 masters, one per low-precision model parameter (O2), in optimizer order.
  const std::vector<Tensor>& master_params() const { return masters_; }
  // Rounds the masters into the model's low-precision parameters, as after every optimizer step;
  // for code that changes the masters outside step() (a model averager). No-op without masters.
  void copy_masters_to_model() { write_back(); }

  // Everything to resume: the optimizer's state (for the f32 masters at O2), the masters
  // themselves, and the loss scale.
  struct State {
    optim::OptimizerState optimizer;
    std::vector<Tensor> master_params;  // copies
    std::map<std::string, double> scaler;
  };
  State state_dict() const;
  void load_state_dict(const State& s);

 private:
  friend std::unique_ptr<Amp> initialize(nn::Module& model, optim::Optimizer& optimizer, const InitializeOptions& options);
  Amp(nn::Module& model, optim::Optimizer& optimizer, const InitializeOptions& options);
  void write_back();

  nn::Module& model_;              // owned by the caller; must outlive this
  optim::Optimizer& optimizer_;    // owned by the caller; must outlive this
  OptLevel level_;
  DType dtype_;
  bool master_ = false, keep_norm_fp32_ = false, scaling_ = false;
  GradScalerOptions scaler_options_;
  LossScaleRule rule_;
  std::vector<Tensor> model_lowp_;  // low-precision model parameters with a master (O2)
  std::vector<Tensor> masters_;     // their f32 masters, in the optimizer
  int64_t hook_ = -1, step_hook_ = -1;
  std::map<const TensorImpl*, Tensor> stash_;  // gradients set aside by stash_gradients()
  bool step_overflowed_ = false;              // an overflow since the last optimizer step
  int64_t skipped_ = 0, updates_ = 0;
  std::optional<OverflowReport> last_overflow_;
};

// Casts the model as the level says, swaps the optimizer's low-precision parameters for f32
// masters (O2) and returns the state tying them together. Throws Error when the model or the
// optimizer was already initialized, when the optimizer holds low-precision parameters (built
// after the model was cast: build it on the f32 model and let initialize cast), when it holds a
// tensor that is not one of the model's parameters, or when it already has state (stepped).
std::unique_ptr<Amp> initialize(nn::Module& model, optim::Optimizer& optimizer, const InitializeOptions& options = {});

// Whether an Amp currently manages this optimizer (GradScaler refuses such optimizers).
bool is_amp_managed(const optim::Optimizer& optimizer);

// `with amp.scale_loss(loss, optimizer) as scaled_loss:` in C++. Call backward() (or use get())
// inside the scope; when the object dies (or finish() is called) the gradients are unscaled and
// checked, so that the next optimizer.step() skips on overflow. Several scale_loss per optimizer
// step accumulate (each one's gradients are unscaled once and added to the earlier, already
// unscaled ones, as Apex's stash does); an overflow in any of them skips the step.
// Throws Error when the optimizer is not managed by amp::initialize.
class ScaledLoss {
 public:
  ScaledLoss(const Tensor& loss, optim::Optimizer& optimizer);
  ~ScaledLoss();  // calls finish(); errors are logged to stderr, never thrown
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  const Tensor& get() const { return scaled_; }
  void backward() const { scaled_.backward(); }
  // Unscales and checks now; returns whether the gradients overflowed. Idempotent.
  bool finish();

 private:
  Amp* amp_;  // owned by the caller of initialize
  Tensor scaled_;
  bool done_ = false, overflow_ = false;
};
inline ScaledLoss scale_loss(const Tensor& loss, optim::Optimizer& optimizer) { return ScaledLoss(loss, optimizer); }

// Casts `module`'s floating parameters and buffers to `dtype` in place, skipping normalisation
// layers (BatchNorm, LayerNorm, GroupNorm) when keep_norm_fp32. Tensors keep their identity.
void cast_module(nn::Module& module, DType dtype, bool keep_norm_fp32);

}  // namespace tandem::amp
