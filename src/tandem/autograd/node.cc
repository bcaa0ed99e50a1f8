#include "tandem/autograd/node.h"

#include <atomic>

#include "tandem/autograd/grad_mode.h"
#include "tandem/core/error.h"

namespace tandem::autograd {
namespace {
std::atomic<uint64_t> next_sequence_nr{0};
thread_local bool grad_enabled = true;
std::atomic<int64_t> live_destinations{0};
std::atomic<int64_t> widening_casts{0};
std::atomic<int64_t> rounded_taken{0};
thread_local std::vector<detail::DestinationOffer>* offers = nullptr;
}  // namespace

namespace detail {
int64_t live_grad_destinations() { return live_destinations.load(std::memory_order_relaxed); }
int64_t live_widening_casts() { return widening_casts.load(std::memory_order_relaxed); }
int64_t rounded_destinations_taken() { return rounded_taken.load(std::memory_order_relaxed); }
std::vector<DestinationOffer>*& offered_destinations() { return offers; }
}  // namespace detail

void set_grad_destination(const Tensor& leaf, Tensor destination) {
  if (destination.defined()) {
    TANDEM_CHECK(destination.shape() == leaf.shape() && destination.dtype() == leaf.dtype() &&
                     destination.is_contiguous(),
                 ValueError, "set_grad_destination: a {} {} buffer for a {} {} tensor (need the same shape and dtype, contiguous)",
                 dtype_name(destination.dtype()), shape_str(destination.shape()), dtype_name(leaf.dtype()),
                 shape_str(leaf.shape()));
  } else if (!leaf.impl().autograd) {
    return;
  }
  AutogradMeta& meta = autograd_meta(leaf);
  const bool had = meta.grad_destination.defined();
  meta.grad_destination = std::move(destination);
  const bool has = meta.grad_destination.defined();
  if (has != had) live_destinations.fetch_add(has ? 1 : -1, std::memory_order_relaxed);
}

namespace {
Tensor take_offer(size_t edge, const Shape& shape, DType dtype, bool rounded) {
  std::vector<detail::DestinationOffer>* o = offers;
  if (o == nullptr || edge >= o->size()) return {};
  detail::DestinationOffer& slot = (*o)[edge];
  if ((!slot.buffer.defined() && !slot.fresh) || slot.rounded != rounded) return {};
  detail::DestinationOffer d = std::move(slot);
  slot = {};
  const Shape& have = d.fresh ? d.shape : d.buffer.shape();
  const DType produced = rounded ? d.round_to : d.fresh ? d.dtype : d.buffer.dtype();
  if (have != shape || produced != dtype) return {};
  if (rounded) rounded_taken.fetch_add(1, std::memory_order_relaxed);
  // A destination is contiguous (set_grad_destination checked); a fresh buffer is made so.
  return d.fresh ? empty(d.shape, d.dtype) : d.buffer;
}
}  // namespace

Tensor take_output_destination(size_t edge, const Shape& shape, DType dtype) {
  return take_offer(edge, shape, dtype, false);
}

Tensor take_rounded_output_destination(size_t edge, const Shape& shape, DType dtype) {
  return take_offer(edge, shape, dtype, true);
}

bool is_grad_enabled() { return grad_enabled; }
void set_grad_enabled(bool enabled) { grad_enabled = enabled; }

Node::Node() : sequence_nr_(next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

Node::~Node() {
  if (has_widening_from_) widening_casts.fetch_sub(1, std::memory_order_relaxed);
}

void Node::set_widening_cast_from(DType from) {
  if (!has_widening_from_) widening_casts.fetch_add(1, std::memory_order_relaxed);
  has_widening_from_ = true;
  widening_from_ = from;
}

AccumulateGrad::AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}

Tensor AccumulateGrad::run_leaf_hooks(Tensor g) const {
  std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl || impl->autograd->leaf_hooks.empty()) return g;
  const auto hooks = impl->autograd->leaf_hooks;  // a copy: a hook may remove itself
  for (const auto& [handle, hook] : hooks) {
    Tensor r = hook(g);
    if (!r.defined()) continue;
    TANDEM_CHECK(r.shape() == g.shape(), AutogradError,
                 "a hook on leaf{} returned a gradient of shape {} for a tensor of shape {}; a hook must return a "
                 "gradient of the same shape (or nothing)",
                 impl->autograd->name.empty() ? "" : " \"" + impl->autograd->name + "\"", shape_str(r.shape()),
                 shape_str(g.shape()));
    g = std::move(r);
  }
  return g;
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads) {
  std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl || grads.empty() || !grads[0].defined()) return {};
  Tensor leaf(impl);
  AutogradMeta& meta = *impl->autograd;
  // A leaf frozen (requires_grad_(false)) after the forward gets nothing (PyTorch returns early).
  if (!meta.requires_grad) return {};
  Tensor g = run_leaf_hooks(std::move(grads[0]));
  TANDEM_CHECK(g.shape() == leaf.shape(), AutogradError,
               "AccumulateGrad: gradient of shape {} does not match parameter{} of shape {}", shape_str(g.shape()),
               meta.name.empty() ? "" : " \"" + meta.name + "\"", shape_str(leaf.shape()));
  {
    NoGradGuard no_grad;
    std::lock_guard<std::mutex> lock(meta.accumulate_mu);
    if (!meta.grad.defined()) {
      // Steal the buffer when nobody else holds it (the common case), else copy: another input
      // of the same op may have received this very tensor. A gradient produced in the leaf's
      // destination (set_grad_destination) is adopted as it is.
      const Tensor& dest = meta.grad_destination;
      // (dest has the leaf's shape, as g was checked to have, and is contiguous.)
      const bool in_destination = dest.defined() && g.storage() == dest.storage() && g.offset() == dest.offset() &&
                                  g.dtype() == dest.dtype() && g.is_contiguous();
      const bool exclusive = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.is_contiguous();
      Tensor owned = in_destination || exclusive ? g.detach() : g.clone();
      if (owned.dtype() != leaf.dtype()) owned = owned.to(leaf.dtype());
      meta.grad = owned;
    } else if (has_internal_overlap(meta.grad)) {
      // An expanded grad (set by the caller): summed out of place, as PyTorch's AccumulateGrad.
      Tensor sum = meta.grad.clone();
      sum.add_(g);
      meta.grad = sum;
    } else {
      meta.grad.add_(g);
    }
  }
  if (!meta.post_acc_hooks.empty()) {
    const auto hooks = meta.post_acc_hooks;  // a copy: a hook may remove itself
    for (const auto& [handle, hook] : hooks) hook(leaf);
  }
  return {};
}

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& grads) {
  TANDEM_CHECK(fn_ != nullptr, AutogradError,
               "{}: trying to backward through the graph a second time (or directly access saved tensors after "
               "they have already been freed). Pass retain_graph=true to the first backward() if you need to "
               "backward twice.",
               name_);
  for (const Saved& sv : saved_) {
    const uint32_t now = sv.tensor.version();
    TANDEM_CHECK(now == sv.version, AutogradError,
                 "{}: one of the variables needed for gradient computation has been modified by an inplace "
                 "operation: the {} {} tensor it saved in the forward is at version {}; expected version {} instead. "
                 "Its gradients would be computed from the new values, so they would be wrong. Write to a clone() "
                 "of that tensor instead, or write after backward() (an optimizer step() or an in-place update "
                 "under NoGradGuard between the forward and backward() is such a write)",
                 name_, dtype_name(sv.tensor.dtype()), shape_str(sv.tensor.shape()), now, sv.version);
  }
  // Materialise missing gradients as zeros so that every closure sees defined tensors.
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = zeros(outputs_[i].shape, outputs_[i].dtype);
  }
  return fn_(grads);
}

void FunctionNode::set_saved(const std::vector<Tensor>& saved) {
  saved_.clear();
  saved_.reserve(saved.size());
  for (const Tensor& t : saved) {
    // Held without autograd state (an output holding its own grad_fn would be a cycle).
    if (t.defined()) saved_.push_back({t.impl().autograd ? t.detach() : t, t.version()});
  }
}

AutogradMeta& autograd_meta(const Tensor& t) {
  TensorImpl& impl = t.impl();
  if (!impl.autograd) impl.autograd = std::make_shared<AutogradMeta>();
  return *impl.autograd;
}

Edge gradient_edge(const Tensor& t) {
  const auto& meta = t.impl().autograd;
  if (!meta) return {};
  if (meta->grad_fn) return {meta->grad_fn, meta->output_nr};
  if (!meta->requires_grad) return {};
  // Made once: forwards on several threads may reach the same leaf first together.
  static std::mutex made;
  std::lock_guard<std::mutex> lock(made);
  if (!meta->grad_accumulator) meta->grad_accumulator = std::make_shared<AccumulateGrad>(t.impl_ptr());
  return {meta->grad_accumulator, 0};
}

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!is_grad_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

bool record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs, BackwardFn fn,
            const std::vector<Tensor>& saved) {
  if (!any_requires_grad(inputs)) return false;
  auto node = std::make_shared<FunctionNode>(name, std::move(fn));
  auto& edges = node->mutable_next_edges();
  edges.reserve(inputs.size());
  for (const Tensor& in : inputs) edges.push_back(in.defined() ? gradient_edge(in) : Edge{});
  auto& outs = node->mutable_outputs();
  for (uint32_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    outs.push_back({out.shape(), out.dtype()});
    AutogradMeta& meta = autograd_meta(out);
    meta.requires_grad = true;
    meta.grad_fn = node;
    meta.output_nr = i;
  }
  // After the outputs got their grad_fn: a saved output is then held detached (as itself it would
  // hold its grad_fn, this node: a cycle that leaked every graph never backwarded).
  if (!saved.empty()) node->set_saved(saved);
  return true;
}

}  // namespace tandem::autograd
