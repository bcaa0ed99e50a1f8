// Tensor's autograd methods (declared in core/tensor.h).
#include <atomic>
#include <limits>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"

namespace tandem {
namespace {
std::atomic<int64_t> next_hook_handle{1};
const std::shared_ptr<autograd::Node> kNoNode;
}  // namespace

bool Tensor::requires_grad() const {
  const auto& m = impl().autograd;
  return m && m->requires_grad;
}

Tensor& Tensor::requires_grad_(bool requires_grad) {
  auto& meta = autograd::autograd_meta(*this);
  TANDEM_CHECK(!meta.grad_fn || requires_grad, AutogradError,
               "requires_grad_(false) on a non-leaf tensor; use detach() to get a tensor without history");
  TANDEM_CHECK(!requires_grad || is_floating(dtype()), AutogradError,
               "requires_grad_: only floating-point tensors can require gradients, got {}", dtype_name(dtype()));
  if (meta.grad_fn) return *this;
  meta.requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const {
  const auto& m = impl().autograd;
  return !m || !m->grad_fn;
}

Tensor Tensor::grad() const {
  const auto& m = impl().autograd;
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& grad) const {
  if (grad.defined()) {
    TANDEM_CHECK(grad.shape() == shape(), ShapeError, "set_grad: gradient shape {} does not match tensor shape {}",
                 shape_str(grad.shape()), shape_str(shape()));
    TANDEM_CHECK(grad.dtype() == dtype(), DTypeError,
                 "set_grad: assigning a gradient of dtype {} to a tensor of dtype {}; convert it first (.to({}))",
                 dtype_name(grad.dtype()), dtype_name(dtype()), dtype_name(dtype()));
  }
  autograd::autograd_meta(*this).grad = grad;
}

void Tensor::retain_grad() const {
  TANDEM_CHECK(requires_grad(), AutogradError, "retain_grad: cannot retain the gradient of a tensor that does not "
               "require grad");
  auto& meta = autograd::autograd_meta(*this);
  if (!meta.grad_fn || meta.retains_grad) return;
  meta.retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_ptr();
  // After every other hook on this output (PyTorch runs retains_grad hooks last): the handle
  // sorts after any a register_hook gives.
  const int64_t handle = std::numeric_limits<int64_t>::max() - static_cast<int64_t>(meta.output_nr);
  meta.grad_fn->pre_hooks()[handle] = {meta.output_nr, [weak](const Tensor& g) {
                                         if (auto impl = weak.lock()) {
                                           auto& m = *impl->autograd;
                                           NoGradGuard no_grad;
                                           if (m.grad.defined()) {
                                             m.grad = m.grad.clone();
                                             m.grad.add_(g);
                                           } else {
                                             m.grad = g.clone();
                                           }
                                         }
                                         return Tensor();
                                       }};
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  const auto& m = impl().autograd;
  return m ? m->grad_fn : kNoNode;
}

Tensor Tensor::detach() const { return make_view(*this, shape(), strides(), offset()); }

void Tensor::backward(const Tensor& gradient, bool retain_graph, bool create_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph, create_graph);
}

int64_t Tensor::register_hook(TensorHook hook) const {
  TANDEM_CHECK(requires_grad(), AutogradError, "register_hook: cannot register a hook on a tensor that does not require grad");
  auto& meta = autograd::autograd_meta(*this);
  const int64_t handle = next_hook_handle++;
  if (meta.grad_fn) {
    meta.grad_fn->pre_hooks()[handle] = {meta.output_nr, std::move(hook)};
  } else {
    meta.leaf_hooks[handle] = std::move(hook);
  }
  return handle;
}

void Tensor::remove_hook(int64_t handle) const {
  auto& meta = autograd::autograd_meta(*this);
  if (meta.grad_fn) meta.grad_fn->pre_hooks().erase(handle);
  meta.leaf_hooks.erase(handle);
  meta.post_acc_hooks.erase(handle);
}

int64_t Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  auto& meta = autograd::autograd_meta(*this);
  TANDEM_CHECK(!meta.grad_fn, AutogradError,
               "register_post_accumulate_grad_hook: only leaf tensors have an accumulated gradient");
  TANDEM_CHECK(meta.requires_grad, AutogradError,
               "register_post_accumulate_grad_hook: the tensor does not require grad");
  const int64_t handle = next_hook_handle++;
  meta.post_acc_hooks[handle] = std::move(hook);
  return handle;
}

void Tensor::set_name(std::string name) const { autograd::autograd_meta(*this).name = std::move(name); }

std::string Tensor::name() const {
  const auto& m = impl().autograd;
  return m ? m->name : std::string();
}

}  // namespace tandem
