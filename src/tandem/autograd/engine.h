// The backward engine: runs the graph behind some root tensors in reverse, accumulating
// gradients into leaves. Single-threaded, on the caller's thread; hooks run on that thread.
#pragma once

#include <functional>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::autograd {

// Works as follows: collect every node reachable from the roots and count how many edges enter
// each; starting from the roots, run a node once all its gradient inputs have arrived (later
// created nodes first when several are ready), summing gradients that meet at the same input;
// hand the outputs to the next nodes. Leaves' AccumulateGrad nodes add into grad().
// Throws AutogradError for a root that does not require grad, a non-scalar root without an
// explicit gradient, a graph already freed by an earlier backward, a hook that returns a gradient
// of another shape, or create_graph (higher-order gradients are not implemented: the gradients
// would carry no history, so a gradient penalty would silently be dropped). A floating-point
// explicit gradient is cast to its root's dtype (PyTorch's validate_outputs).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph, bool create_graph);

// Queues `fn` to run once the backward pass now executing on this thread has finished every node
// (torch's Variable._execution_engine.queue_callback): DDP's reducer finalizes its buckets there.
// Callbacks run in queue order on the backward's thread; one queued by a callback runs too. If the
// backward throws (a node, a hook, or an earlier callback), the callbacks not yet run are dropped
// and their `on_abort` (optional, must not throw) runs instead, as the exception leaves backward:
// the reducer's chance to settle collectives it started and forget the iteration. Throws
// AutogradError outside a backward.
void queue_callback(std::function<void()> fn, std::function<void()> on_abort = {});
// Whether a backward pass is running on this thread (hooks may ask).
bool in_backward();

// Gradients of `outputs` w.r.t. `inputs` without touching any grad() (torch.autograd.grad). Runs
// only the part of the graph between them (nodes past the inputs, their hooks and their saved
// tensors are left alone); an input's own tensor hooks apply to its gradient. An input the outputs
// do not depend on is an AutogradError naming it, or an undefined Tensor with allow_unused.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false,
                         bool allow_unused = false);

}  // namespace tandem::autograd
