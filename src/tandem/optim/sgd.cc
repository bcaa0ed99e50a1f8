#include "tandem/optim/sgd.h"

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/optim_kernels.h"

namespace tandem::optim {
namespace {

Options to_options(const SGDOptions& o) {
  TANDEM_CHECK(o.lr >= 0, ValueError, "SGD: invalid learning rate {}", o.lr);
  TANDEM_CHECK(o.momentum >= 0, ValueError, "SGD: invalid momentum {}", o.momentum);
  TANDEM_CHECK(o.weight_decay >= 0, ValueError, "SGD: invalid weight_decay {}", o.weight_decay);
  TANDEM_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), ValueError,
               "SGD: Nesterov momentum requires a momentum and zero dampening (got momentum={}, dampening={})",
               o.momentum, o.dampening);
  return {{"lr", o.lr},
          {"momentum", o.momentum},
          {"dampening", o.dampening},
          {"weight_decay", o.weight_decay},
          {"nesterov", o.nesterov ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0}};
}

}  // namespace

SGD::SGD(std::vector<Tensor> params, SGDOptions options) : SGD(std::vector<ParamGroup>{{std::move(params), {}}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options) : Optimizer(std::move(groups), to_options(options), "SGD") {}

void SGD::update() {
  NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const double lr = option(group, "lr"), momentum = option(group, "momentum");
    const double dampening = option(group, "dampening"), wd = option(group, "weight_decay");
    const bool nesterov = option(group, "nesterov") != 0, maximize = option(group, "maximize") != 0;
    for (Tensor& p : group.params) {
      const Tensor grad_t = p.grad();
      if (!grad_t.defined()) continue;
      Tensor g = grad_t.dtype() == p.dtype() ? grad_t.contiguous() : grad_t.to(p.dtype()).contiguous();
      TANDEM_CHECK(p.is_contiguous(), ValueError, "SGD: parameter \"{}\" is not contiguous", p.name());
      auto& st = state_of(p);
      const bool first = momentum != 0 && !st.count("momentum_buffer");
      if (momentum != 0 && first) st["momentum_buffer"] = empty(p.shape(), p.dtype());
      Tensor buf = momentum != 0 ? st["momentum_buffer"] : Tensor();
      if (p.dtype() == kFloat32) {
        const kernels::SgdParams k{.lr = static_cast<float>(lr),
                                   .momentum = static_cast<float>(momentum),
                                   .weight_decay = static_cast<float>(wd),
                                   .one_minus_dampening = static_cast<float>(1.0 - dampening),
                                   .nesterov = nesterov,
                                   .maximize = maximize,
                                   .first_step = first};
        kernels::sgd_update_f32(p.data_ptr<float>(), g.data_ptr<float>(), buf.defined() ? buf.data_ptr<float>() : nullptr,
                                p.numel(), k);
        continue;
      }
      TANDEM_DISPATCH_FLOATING(p.dtype(), "SGD.step", [&] {
        using T = scalar_t;
        using C = compute_t<T>;
        T* pp = static_cast<T*>(p.data_ptr());
        const T* gp = static_cast<const T*>(g.data_ptr());
        T* bp = buf.defined() ? static_cast<T*>(buf.data_ptr()) : nullptr;
        const C cwd = static_cast<C>(wd), cm = static_cast<C>(momentum), cd = static_cast<C>(1.0 - dampening);
        const C clr = static_cast<C>(-lr);
        parallel_for(0, p.numel(), 65536, [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) {
            C d = static_cast<C>(gp[i]);
            if (maximize) d = -d;
            const C pv = static_cast<C>(pp[i]);
            if (wd != 0) d = d + cwd * pv;
            if (bp != nullptr) {
              C b = first ? d : static_cast<C>(bp[i]) * cm + cd * d;
              bp[i] = static_cast<T>(b);
              b = static_cast<C>(bp[i]);
              d = nesterov ? d + cm * b : b;
            }
            pp[i] = static_cast<T>(pv + clr * d);
          }
        });
      });
    }
  }
}

}  // namespace tandem::optim
