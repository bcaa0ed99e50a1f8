#include "tandem/autograd/engine.h"

#include <queue>
#include <unordered_map>

#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/core/error.h"

namespace tandem::autograd {
namespace {

struct ReadyOrder {
  // AccumulateGrad first (so post-accumulate hooks fire as early as possible), then the node
  // created last.
  bool operator()(Node* a, Node* b) const {
    const bool acc_a = dynamic_cast<AccumulateGrad*>(a) != nullptr, acc_b = dynamic_cast<AccumulateGrad*>(b) != nullptr;
    if (acc_a != acc_b) return acc_b;
    return a->sequence_nr() < b->sequence_nr();
  }
};

void add_into(Tensor& slot, Tensor&& g) {
  if (!g.defined()) return;
  if (!slot.defined()) {
    slot = std::move(g);
    return;
  }
  NoGradGuard no_grad;
  // In place when nothing else can see the slot's buffer (the common case: a buffer that an
  // earlier gradient function made for us); otherwise out of place, as the slot may be the very
  // tensor another consumer received.
  const bool exclusive = slot.impl_ptr().use_count() == 1 && slot.storage().use_count() == 1 && !slot.requires_grad() &&
                         slot.is_contiguous() && slot.shape() == g.shape() && slot.dtype() == g.dtype();
  if (exclusive) {
    slot.add_(g);
  } else {
    Tensor sum = slot.clone();
    sum.add_(g);
    slot = std::move(sum);
  }
}

// Whether the leaf behind `acc` takes its next gradient as it comes: acc's producer is the only
// one left (deps 1), nothing arrived before it, and the leaf has no grad(). Then its
// destination (possibly undefined) is in `dest`.
bool leaf_takes_gradient(AccumulateGrad* acc, const std::unordered_map<Node*, int64_t>& deps,
                         const std::unordered_map<Node*, std::vector<Tensor>>& buffers, Tensor& dest,
                         std::shared_ptr<TensorImpl>& leaf) {
  auto d = deps.find(acc);
  if (d == deps.end() || d->second != 1) return false;
  if (auto b = buffers.find(acc); b != buffers.end() && !b->second.empty() && b->second[0].defined()) return false;
  leaf = acc->leaf().lock();
  if (!leaf || !leaf->autograd || leaf->autograd->grad.defined()) return false;
  dest = leaf->autograd->grad_destination;
  return true;
}

// The gradient destinations (node.h) to offer node `n`: for each next edge into the
// AccumulateGrad of a leaf that takes its gradient as it comes and has a destination; and,
// rounded, for each next edge into a widening cast that gets nothing else (deps 1, no gradient
// yet, no hook on its input) and leads straight to such a leaf (its destination, else a fresh
// buffer of its shape and dtype). Empty when there is nothing to offer.
std::vector<detail::DestinationOffer> destination_offers(Node* n, const std::unordered_map<Node*, int64_t>& deps,
                                                         const std::unordered_map<Node*, std::vector<Tensor>>& buffers) {
  std::vector<detail::DestinationOffer> offers;
  const auto& edges = n->next_edges();
  for (size_t i = 0; i < edges.size(); ++i) {
    Node* next = edges[i].fn.get();
    if (next == nullptr) continue;
    detail::DestinationOffer offer;
    Tensor dest;
    std::shared_ptr<TensorImpl> leaf;
    if (auto* acc = dynamic_cast<AccumulateGrad*>(next); acc != nullptr) {
      if (!leaf_takes_gradient(acc, deps, buffers, dest, leaf) || !dest.defined()) continue;
      offer.buffer = std::move(dest);
    } else if (next->is_widening_cast() && next->pre_hooks().empty() && next->next_edges().size() == 1) {
      auto d = deps.find(next);
      if (d == deps.end() || d->second != 1) continue;
      if (auto b = buffers.find(next); b != buffers.end() && !b->second.empty() && b->second[0].defined()) continue;
      auto* acc = dynamic_cast<AccumulateGrad*>(next->next_edges()[0].fn.get());
      if (acc == nullptr || !leaf_takes_gradient(acc, deps, buffers, dest, leaf)) continue;
      offer.rounded = true;
      offer.round_to = next->widening_cast_from();
      if (dest.defined()) {
        offer.buffer = std::move(dest);
      } else {
        offer.fresh = true;
        offer.shape = leaf->shape;
        offer.dtype = leaf->dtype;
      }
    } else {
      continue;
    }
    offers.resize(edges.size());
    offers[i] = std::move(offer);
  }
  return offers;
}

// Makes `offers` (or nothing) the current node's for the duration of its apply().
struct OfferScope {
  std::vector<detail::DestinationOffer>* saved;
  explicit OfferScope(std::vector<detail::DestinationOffer>* o) : saved(detail::offered_destinations()) {
    detail::offered_destinations() = o;
  }
  ~OfferScope() { detail::offered_destinations() = saved; }
  OfferScope(const OfferScope&) = delete;
  OfferScope& operator=(const OfferScope&) = delete;
};

// A queued callback and what runs instead when its backward throws before it ran.
struct QueuedCallback {
  std::function<void()> fn, on_abort;
  bool started = false;
};

// Callbacks of the backward passes running on this thread (innermost last).
thread_local std::vector<std::vector<QueuedCallback>> callback_frames;

// Pushes a callback frame for one backward pass and pops it however the pass ends; a pass that
// ends by an exception runs the on_abort of the callbacks that did not start.
struct CallbackFrame {
  CallbackFrame() { callback_frames.emplace_back(); }
  ~CallbackFrame() {
    // Moved out first: an on_abort may not queue into a frame that is going away.
    std::vector<QueuedCallback> left = std::move(callback_frames.back());
    callback_frames.pop_back();
    for (auto& cb : left) {
      if (cb.started || !cb.on_abort) continue;
      try {
        cb.on_abort();
      } catch (...) {  // an abort handler must not replace the exception in flight
      }
    }
  }
  void run_all() {
    // Index loop: a callback may queue more callbacks into this frame.
    for (size_t i = 0; i < callback_frames.back().size(); ++i) {
      callback_frames.back()[i].started = true;
      auto fn = std::move(callback_frames.back()[i].fn);
      fn();
    }
  }
};

// Captured gradients for autograd::grad: (node, slot) -> result index.
using Captures = std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>>;

void run(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads_in, bool retain_graph, bool create_graph,
         const Captures* captures, std::vector<Tensor>* captured) {
  TANDEM_CHECK(grads_in.empty() || grads_in.size() == roots.size(), AutogradError,
               "backward: got {} gradients for {} outputs", grads_in.size(), roots.size());
  TANDEM_CHECK(!create_graph, AutogradError,
               "backward(create_graph=true): higher-order gradients are not implemented; the gradients would carry "
               "no history, so a term built from them (a gradient penalty) would silently get no gradient. Compute "
               "such a term another way, or differentiate it numerically");
  std::vector<std::pair<Edge, Tensor>> root_inputs;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    TANDEM_CHECK(r.requires_grad(), AutogradError,
                 "backward: element {} of the outputs does not require grad and has no grad_fn", i);
    Tensor g = grads_in.empty() ? Tensor() : grads_in[i];
    if (!g.defined()) {
      TANDEM_CHECK(r.numel() == 1, AutogradError,
                   "backward: a gradient can be created implicitly only for one-element outputs; output {} has shape "
                   "{} (pass a gradient of that shape)",
                   i, shape_str(r.shape()));
      g = ones(r.shape(), r.dtype());
    }
    TANDEM_CHECK(g.shape() == r.shape(), ShapeError, "backward: gradient shape {} does not match output shape {}",
                 shape_str(g.shape()), shape_str(r.shape()));
    TANDEM_CHECK(is_floating(g.dtype()), DTypeError,
                 "backward: the gradient of output {} has dtype {}; expected a floating-point gradient", i,
                 dtype_name(g.dtype()));
    if (g.dtype() != r.dtype()) g = g.detach().to(r.dtype());  // PyTorch casts it to the output's dtype
    root_inputs.emplace_back(gradient_edge(r), std::move(g));
  }

  // ---- dependencies: how many edges enter each reachable node ----
  std::unordered_map<Node*, int64_t> deps;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep_alive;
  {
    std::vector<Node*> stack;
    for (auto& [edge, g] : root_inputs) {
      if (keep_alive.emplace(edge.fn.get(), edge.fn).second) stack.push_back(edge.fn.get());
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next_edges()) {
        if (!e.valid()) continue;
        deps[e.fn.get()]++;
        if (keep_alive.emplace(e.fn.get(), e.fn).second) stack.push_back(e.fn.get());
      }
    }
  }

  // ---- autograd::grad: only nodes from which an input is reached run ----
  // needed: the node is an input's or leads to one; a needed node runs (apply) only when one of
  // its next nodes is needed (an input's node is captured on arrival, its own graph left alone).
  std::unordered_map<Node*, bool> needed;
  if (captures != nullptr) {
    // Post-order without recursion (graphs may be deep): a node is decided once all its next
    // nodes are.
    std::vector<std::pair<Node*, size_t>> stack;  // node, next edge to look at
    for (auto& [edge, g] : root_inputs) {
      if (needed.count(edge.fn.get())) continue;
      needed[edge.fn.get()] = captures->count(edge.fn.get()) > 0;
      stack.emplace_back(edge.fn.get(), 0);
      while (!stack.empty()) {
        auto& [n, next] = stack.back();
        if (next < n->next_edges().size()) {
          const Edge& e = n->next_edges()[next++];
          if (e.valid() && !needed.count(e.fn.get())) {
            needed[e.fn.get()] = captures->count(e.fn.get()) > 0;
            stack.emplace_back(e.fn.get(), 0);
          }
          continue;
        }
        bool need = needed[n];
        for (const Edge& e : n->next_edges()) need = need || (e.valid() && needed[e.fn.get()]);
        needed[n] = need;
        stack.pop_back();
      }
    }
    // Recount the entering edges over the needed part only.
    deps.clear();
    for (const auto& [n, need] : needed) {
      if (!need) continue;
      for (const Edge& e : n->next_edges()) {
        if (e.valid() && needed.at(e.fn.get())) deps[e.fn.get()]++;
      }
    }
  }
  const auto is_needed = [&](Node* n) { return captures == nullptr || needed[n]; };
  const auto runs = [&](Node* n) {
    if (captures == nullptr) return true;
    for (const Edge& e : n->next_edges()) {
      if (e.valid() && needed[e.fn.get()]) return true;
    }
    return false;
  };

  // ---- execution ----
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  auto buffer_of = [&](Node* n) -> std::vector<Tensor>& {
    auto& b = buffers[n];
    if (b.empty()) b.resize(std::max<size_t>(n->num_outputs(), 1));
    return b;
  };
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  for (auto& [edge, g] : root_inputs) add_into(buffer_of(edge.fn.get())[edge.input_nr], std::move(g));
  for (auto& [edge, g] : root_inputs) {
    Node* n = edge.fn.get();
    if (!is_needed(n)) continue;
    if (deps[n] == 0) {
      deps[n] = -1;  // queued
      ready.push(n);
    }
  }

  AutoGradMode mode(create_graph);
  CallbackFrame frame;
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    std::vector<Tensor> inputs = std::move(buffers[n]);
    buffers.erase(n);
    if (inputs.size() < n->num_outputs()) inputs.resize(n->num_outputs());
    // A copy: a hook may remove itself (or another) while they run.
    if (!n->pre_hooks().empty()) {
      const auto hooks = n->pre_hooks();
      for (const auto& [handle, hook] : hooks) {
        const auto& [slot, fn] = hook;
        if (slot < inputs.size() && inputs[slot].defined()) {
          Tensor r = fn(inputs[slot]);
          if (!r.defined()) continue;
          TANDEM_CHECK(r.shape() == inputs[slot].shape(), AutogradError,
                       "a hook on an output of {} returned a gradient of shape {} for a tensor of shape {}; a hook "
                       "must return a gradient of the same shape (or nothing)",
                       n->name(), shape_str(r.shape()), shape_str(inputs[slot].shape()));
          inputs[slot] = std::move(r);
        }
      }
    }
    const bool is_accumulator = dynamic_cast<AccumulateGrad*>(n) != nullptr;
    if (captures != nullptr) {
      if (auto it = captures->find(n); it != captures->end()) {
        // A leaf input's own tensor hooks apply to its gradient, as in backward.
        if (auto* acc = dynamic_cast<AccumulateGrad*>(n); acc != nullptr && !inputs.empty() && inputs[0].defined()) {
          inputs[0] = acc->run_leaf_hooks(std::move(inputs[0]));
        }
        for (auto [slot, index] : it->second) (*captured)[index] = inputs[slot];
      }
      if (is_accumulator || !runs(n)) continue;  // autograd::grad never touches grad(), nor goes past inputs
    }
    std::vector<detail::DestinationOffer> offers;
    const bool may_offer = detail::live_grad_destinations() > 0 || detail::live_widening_casts() > 0;
    if (captures == nullptr && !create_graph && !is_accumulator && may_offer) {
      offers = destination_offers(n, deps, buffers);
    }
    std::vector<Tensor> outputs;
    {
      OfferScope scope(offers.empty() ? nullptr : &offers);
      outputs = n->apply(std::move(inputs));
    }
    if (!retain_graph) n->release_variables();
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (!is_needed(e.fn.get())) continue;
      if (i < outputs.size()) add_into(buffer_of(e.fn.get())[e.input_nr], std::move(outputs[i]));
      if (--deps[e.fn.get()] == 0) ready.push(e.fn.get());
    }
  }
  frame.run_all();
}

}  // namespace

void queue_callback(std::function<void()> fn, std::function<void()> on_abort) {
  TANDEM_CHECK(!callback_frames.empty(), AutogradError,
               "queue_callback: no backward pass is running on this thread (call it from a hook during backward)");
  callback_frames.back().push_back(QueuedCallback{std::move(fn), std::move(on_abort)});
}

bool in_backward() { return !callback_frames.empty(); }

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph, bool create_graph) {
  run(roots, grads, retain_graph, create_graph, nullptr, nullptr);
  // Non-leaf tensors that asked for retain_grad() got their grad through a pre-hook.
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph, bool allow_unused) {
  Captures captures;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Edge e = gradient_edge(inputs[i]);
    TANDEM_CHECK(e.valid(), AutogradError, "autograd::grad: input {} does not require grad", i);
    captures[e.fn.get()].emplace_back(e.input_nr, i);
  }
  std::vector<Tensor> result(inputs.size());
  run(outputs, grad_outputs, retain_graph, false, &captures, &result);
  for (size_t i = 0; i < inputs.size() && !allow_unused; ++i) {
    TANDEM_CHECK(result[i].defined(), AutogradError,
                 "autograd::grad: input {}{} does not appear to have been used in the graph; pass allow_unused=true "
                 "if that is expected (its gradient is then undefined)",
                 i, inputs[i].name().empty() ? "" : " (\"" + inputs[i].name() + "\")");
  }
  return result;
}

}  // namespace tandem::autograd
