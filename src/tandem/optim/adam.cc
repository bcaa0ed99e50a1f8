#include "tandem/optim/adam.h"

#include <cmath>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/optim_kernels.h"

namespace tandem::optim {
namespace {

Options to_options(const AdamOptions& o, const char* name, bool decoupled) {
  const double weight_decay = o.weight_decay.value_or(decoupled ? 1e-2 : 0.0);
  TANDEM_CHECK(o.lr >= 0, ValueError, "{}: invalid learning rate {}", name, o.lr);
  TANDEM_CHECK(o.eps >= 0, ValueError, "{}: invalid eps {}", name, o.eps);
  TANDEM_CHECK(o.beta1 >= 0 && o.beta1 < 1, ValueError, "{}: invalid beta1 {} (expected [0, 1))", name, o.beta1);
  TANDEM_CHECK(o.beta2 >= 0 && o.beta2 < 1, ValueError, "{}: invalid beta2 {} (expected [0, 1))", name, o.beta2);
  TANDEM_CHECK(weight_decay >= 0, ValueError, "{}: invalid weight_decay {}", name, weight_decay);
  return {{"lr", o.lr},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"weight_decay", weight_decay},
          {"amsgrad", o.amsgrad ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0}};
}

}  // namespace

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{{std::move(params), {}}}, options, "Adam", false) {}
Adam::Adam(std::vector<ParamGroup> groups, AdamOptions options) : Adam(std::move(groups), options, "Adam", false) {}
Adam::Adam(std::vector<ParamGroup> groups, AdamOptions options, std::string name, bool decoupled)
    : Optimizer(std::move(groups), to_options(options, name.c_str(), decoupled), name), decoupled_(decoupled), fused_(options.fused) {}

std::map<std::string, StateKind> Adam::state_keys() const {
  return {{"step", StateKind::kStep},
          {"exp_avg", StateKind::kLikeParam},
          {"exp_avg_sq", StateKind::kLikeParam},
          {"max_exp_avg_sq", StateKind::kOptionalLikeParam}};
}

AdamW::AdamW(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{{std::move(params), {}}}, options, "AdamW", true) {}
AdamW::AdamW(std::vector<ParamGroup> groups, AdamOptions options) : Adam(std::move(groups), options, "AdamW", true) {}

// Works as follows, per element, in the order PyTorch's single-tensor Adam uses (so that f32
// results agree to rounding):
//   g = maximize ? -g : g;  Adam: g += wd * p;  AdamW: p *= 1 - lr * wd
//   m = m * beta1 + (1 - beta1) * g;  v = v * beta2 + (1 - beta2) * g * g
//   denom = sqrt(amsgrad ? max(vmax, v) : v) / sqrt(1 - beta2^t) + eps
//   p += -(lr / (1 - beta1^t)) * m / denom
void Adam::update() {
  NoGradGuard no_grad;
  std::vector<kernels::AdamTensor> fused;    // f32 parameters, updated together at the end
  std::vector<Tensor> keep_alive;           // gradients converted for the fused pass
  for (auto& group : param_groups()) {
    const double lr = option(group, "lr"), b1 = option(group, "beta1"), b2 = option(group, "beta2");
    const double eps = option(group, "eps"), wd = option(group, "weight_decay");
    const bool amsgrad = option(group, "amsgrad") != 0, maximize = option(group, "maximize") != 0;
    for (Tensor& p : group.params) {
      const Tensor grad_t = p.grad();
      if (!grad_t.defined()) continue;
      TANDEM_CHECK(p.is_contiguous(), ValueError, "{}: parameter \"{}\" is not contiguous", name(), p.name());
      const Tensor g = grad_t.dtype() == p.dtype() ? grad_t.contiguous() : grad_t.to(p.dtype()).contiguous();
      auto& st = state_of(p);
      if (!st.count("step")) {
        st["step"] = zeros({}, kFloat64);
        st["exp_avg"] = zeros(p.shape(), p.dtype());
        st["exp_avg_sq"] = zeros(p.shape(), p.dtype());
      }
      // amsgrad switched on after the first step (or state loaded from a run without it): the
      // running maximum starts now (PyTorch fails with KeyError 'max_exp_avg_sq' there).
      if (amsgrad && !st.count("max_exp_avg_sq")) st["max_exp_avg_sq"] = zeros(p.shape(), p.dtype());
      double& step = *st["step"].data_ptr<double>();
      step += 1;
      const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
      const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
      Tensor m = st["exp_avg"], v = st["exp_avg_sq"];
      Tensor vmax = amsgrad ? st["max_exp_avg_sq"] : Tensor();
      if (p.dtype() == kFloat32) {
        const kernels::AdamParams k{.beta1 = static_cast<float>(b1),
                                    .one_minus_beta1 = static_cast<float>(1.0 - b1),
                                    .beta2 = static_cast<float>(b2),
                                    .one_minus_beta2 = static_cast<float>(1.0 - b2),
                                    .eps = static_cast<float>(eps),
                                    .weight_decay = static_cast<float>(wd),
                                    .decoupled_decay = static_cast<float>(1.0 - lr * wd),
                                    .step_size = static_cast<float>(step_size),
                                    .bias_correction2_sqrt = static_cast<float>(bc2_sqrt),
                                    .decoupled = decoupled_,
                                    .amsgrad = amsgrad,
                                    .maximize = maximize};
        float* vmp = vmax.defined() ? vmax.data_ptr<float>() : nullptr;
        if (fused_) {
          fused.push_back({p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), vmp, g.data_ptr<float>(), p.numel(), k});
          keep_alive.push_back(g);
        } else {
          kernels::adam_update_f32(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), vmp,
                                   p.numel(), k);
        }
        continue;
      }
      TANDEM_DISPATCH_FLOATING(p.dtype(), "Adam.step", [&] {
        using T = scalar_t;
        using C = compute_t<T>;
        T* pp = static_cast<T*>(p.data_ptr());
        const T* gp = static_cast<const T*>(g.data_ptr());
        T* mp = static_cast<T*>(m.data_ptr());
        T* vp = static_cast<T*>(v.data_ptr());
        T* vmp = vmax.defined() ? static_cast<T*>(vmax.data_ptr()) : nullptr;
        const C cb1 = static_cast<C>(b1), w = static_cast<C>(1.0 - b1);
        const C cb2 = static_cast<C>(b2), one_b2 = static_cast<C>(1.0 - b2);
        const C cwd = static_cast<C>(wd), decay = static_cast<C>(1.0 - lr * wd), ceps = static_cast<C>(eps);
        const C cbc2 = static_cast<C>(bc2_sqrt), neg_step = static_cast<C>(-step_size);
        const bool decoupled = decoupled_;
        parallel_for(0, p.numel(), 65536, [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) {
            C gv = static_cast<C>(gp[i]);
            if (maximize) gv = -gv;
            C pv = static_cast<C>(pp[i]);
            if (wd != 0) {
              if (decoupled) pv = pv * decay;
              else gv = gv + cwd * pv;
            }
            C mv = static_cast<C>(mp[i]);
            mv = mv * cb1 + w * gv;  // exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1) (torch 1.13)
            C vv = static_cast<C>(vp[i]) * cb2;
            vv = vv + one_b2 * gv * gv;
            mp[i] = static_cast<T>(mv);
            vp[i] = static_cast<T>(vv);
            C s = vv;
            if (vmp != nullptr) {
              s = std::max(static_cast<C>(vmp[i]), vv);
              vmp[i] = static_cast<T>(s);
            }
            const C denom = std::sqrt(s) / cbc2 + ceps;
            pp[i] = static_cast<T>(pv + neg_step * mv / denom);
          }
        });
      });
    }
  }
  if (!fused.empty()) kernels::adam_update_multi_f32(fused);
}

}  // namespace tandem::optim
