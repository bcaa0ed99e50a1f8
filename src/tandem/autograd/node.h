// Autograd graph nodes. A Node turns the gradients of its forward outputs into gradients of its
// forward inputs; next_edges()[i] says where input i's gradient goes. Nodes are owned by the
// grad_fn of the tensors they produced (and by downstream nodes' edges), never by inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::autograd {

class Node;

// Where a gradient flows: input `input_nr` of `fn`. An edge with no fn is a dead end (the
// input did not require grad).
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

// Shape and dtype of a forward output, so a missing gradient can be materialised as zeros.
struct OutputMeta {
  Shape shape;
  DType dtype = kFloat32;
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // grads[i] is the gradient of forward output i (may be undefined when nothing used it).
  // Returns one gradient per next edge (undefined = no gradient).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grads) = 0;
  virtual std::string name() const = 0;
  // Frees saved tensors after a backward without retain_graph.
  virtual void release_variables() {}
  // Whether release_variables() ran (a backward without retain_graph went through it).
  virtual bool released() const { return false; }

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  size_t num_outputs() const { return outputs_.size(); }
  const std::vector<OutputMeta>& outputs() const { return outputs_; }
  std::vector<OutputMeta>& mutable_outputs() { return outputs_; }
  // Creation order; backward runs later-created nodes first.
  uint64_t sequence_nr() const { return sequence_nr_; }

  // Hooks on the gradient of forward output `output_nr` (Tensor::register_hook on a non-leaf).
  std::map<int64_t, std::pair<uint32_t, TensorHook>>& pre_hooks() { return pre_hooks_; }

  // A cast's backward that only converts its one incoming gradient, of dtype `from`, exactly to its
  // input's wider dtype (the bf16 -> f32 cast back of autocast's weight cast): the engine may then
  // let the node before it produce that gradient already widened, into the destination the cast's
  // input offers (see take_rounded_output_destination); the cast passes such a gradient through.
  void set_widening_cast_from(DType from);
  bool is_widening_cast() const { return has_widening_from_; }
  DType widening_cast_from() const { return widening_from_; }

 protected:
  std::vector<Edge> next_edges_;
  std::vector<OutputMeta> outputs_;

 private:
  uint64_t sequence_nr_;
  std::map<int64_t, std::pair<uint32_t, TensorHook>> pre_hooks_;  // handle -> (output_nr, hook)
  bool has_widening_from_ = false;
  DType widening_from_ = kFloat32;
};

// Per-tensor autograd state, held by TensorImpl::autograd.
struct AutogradMeta {
  bool requires_grad = false;
  bool retains_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;    // null for leaves
  uint32_t output_nr = 0;           // which output of grad_fn this tensor is
  std::shared_ptr<Node> grad_accumulator;  // leaves only, made on first use
  std::map<int64_t, TensorHook> leaf_hooks;                    // leaves: run before accumulation
  std::map<int64_t, PostAccumulateGradHook> post_acc_hooks;   // leaves: run after accumulation
  // Leaves: where the next gradient should be produced (set_grad_destination), or undefined.
  Tensor grad_destination;
  std::string name;
  // Leaves: serializes accumulation into grad when backward passes on several threads reach the
  // same leaf (PyTorch locks there too).
  std::mutex accumulate_mu;
};

// Accumulates a gradient into a leaf's grad(), running its hooks. Holds the leaf weakly.
class AccumulateGrad : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf);
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  // The leaf's tensor hooks applied to `g` (apply() runs them before accumulating; autograd::grad
  // before it captures a leaf's gradient). Returns `g` when the leaf is gone.
  Tensor run_leaf_hooks(Tensor g) const;
  std::string name() const override { return "AccumulateGrad"; }
  // The leaf it accumulates into (may have expired). DDP walks graphs to find unused parameters.
  const std::weak_ptr<TensorImpl>& leaf() const { return leaf_; }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

// A node whose backward is a closure (the common case for ops). The closure's captures are
// its saved tensors, dropped by release_variables().
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;

class FunctionNode : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  std::string name() const override { return name_; }
  void release_variables() override {
    fn_ = nullptr;
    saved_.clear();
  }
  bool released() const override { return fn_ == nullptr; }
  // The tensors the closure captured, each with its version() when captured: apply() throws
  // AutogradError, as PyTorch's SavedVariable::unpack does, when one was written in place since.
  void set_saved(const std::vector<Tensor>& saved);

 private:
  struct Saved {
    Tensor tensor;
    uint32_t version = 0;
  };
  std::string name_;
  BackwardFn fn_;
  std::vector<Saved> saved_;
};

// ---- gradient destinations ----
// A leaf may name a contiguous buffer of its own shape and dtype (else ValueError) where its next gradient is produced
// (DDP: the parameter's slot in its communication bucket). While that leaf has no grad() and its
// gradient comes from a single edge, the engine offers the buffer to the node producing it; a
// node's backward that takes the offer writes its result there and returns it, and
// AccumulateGrad then adopts it as grad() without a copy. Offers are only made in a backward
// without create_graph, outside autograd::grad. A node that ignores the offer is unaffected.
// The destination stays set until replaced or cleared (an undefined `destination`); it holds a
// reference to the buffer. Not thread-safe against a backward running on the same leaf.
void set_grad_destination(const Tensor& leaf, Tensor destination);

// Inside a node's backward: the buffer offered for next edge `edge`, if one is and it has
// `shape` and `dtype` (contiguous); else undefined. Each offer is taken at most once.
Tensor take_output_destination(size_t edge, const Shape& shape, DType dtype);

// Rounded destinations. When next edge `edge` feeds a widening cast (Node::set_widening_cast_from,
// e.g. autocast's bf16 copy of an f32 parameter) that gets no other gradient, and the cast's own
// input is a leaf that would take the gradient as it comes (no grad() yet, one edge), the engine
// offers the leaf's buffer here instead: its destination if it has one, else a new tensor of the
// leaf's shape and dtype (made when taken). A node that would produce a gradient of `shape` and
// dtype `dtype` (the cast's `from`) may take it: it writes its result rounded to `dtype` and
// stored widened in the buffer's dtype (bit for bit the cast's output), and returns the buffer as
// that edge's gradient; the cast passes it through and the leaf adopts it, so the narrow gradient
// and the conversion pass are never made. Undefined when there is no such offer.
Tensor take_rounded_output_destination(size_t edge, const Shape& shape, DType dtype);

namespace detail {
// How many leaves have a destination set and how many widening-cast nodes exist (the engine skips
// the search when both are 0).
int64_t live_grad_destinations();
int64_t live_widening_casts();
// How many rounded offers this process's backward passes have handed out (tests).
int64_t rounded_destinations_taken();
// One offer: the buffer (or, when `fresh`, the shape and dtype of a new one, made when taken),
// and for a rounded offer the dtype its values must be rounded to.
struct DestinationOffer {
  Tensor buffer;
  bool rounded = false;
  DType round_to = kFloat32;
  bool fresh = false;
  Shape shape;
  DType dtype = kFloat32;
};
// The offers for the node being applied on this thread (one per next edge), or null.
std::vector<DestinationOffer>*& offered_destinations();
}  // namespace detail

// ---- helpers used by ops ----

AutogradMeta& autograd_meta(const Tensor& t);   // creates it if missing
// Where a gradient for `t` goes: its grad_fn, its accumulator (leaf requiring grad), or nowhere.
Edge gradient_edge(const Tensor& t);
// True when grad mode is on and any input requires grad.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
bool any_requires_grad(const std::vector<Tensor>& inputs);

// Connects `outputs` to a new FunctionNode whose backward is `fn`, if grad mode is on and any of
// `inputs` requires grad (otherwise does nothing). Returns whether a node was recorded.
// Save outputs inside `fn` only through detach() (a saved output with its own grad_fn is a cycle).
// `saved` lists every tensor `fn` captures (inputs or outputs, undefined ones allowed): backward
// then refuses to run when one of them was written in place after this call (see version()).
bool record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs, BackwardFn fn,
            const std::vector<Tensor>& saved = {});

}  // namespace tandem::autograd
