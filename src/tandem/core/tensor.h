// Tensor: an n-d view (shape, strides, offset, dtype) over a shared Storage, plus optional
// autograd metadata. Tensor is a value type over shared state: copying a Tensor is shallow
// (both copies see the same data and the same grad); clone() is deep.
// Invariant: every element addressed by shape/strides/offset lies inside the storage.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/core/error.h"
#include "tandem/core/rng.h"
#include "tandem/core/storage.h"

namespace tandem {

using Shape = std::vector<int64_t>;

namespace autograd {
struct AutogradMeta;
class Node;
}  // namespace autograd

// The shared state behind a Tensor. Field by field:
struct TensorImpl {
  std::shared_ptr<Storage> storage;  // the bytes; shared by all views of it
  Shape shape;                       // extent of each dimension; {} is a scalar
  Shape strides;                     // step between neighbours of each dimension, in elements
  int64_t offset = 0;                // first element, in elements from storage->data()
  DType dtype = DType::f32;
  // Autograd state (requires_grad, grad, grad_fn, hooks); null for plain data tensors.
  std::shared_ptr<autograd::AutogradMeta> autograd;
};

class Tensor;
using TensorHook = std::function<Tensor(const Tensor&)>;          // may return an undefined Tensor: keep the grad
using PostAccumulateGradHook = std::function<void(Tensor&)>;      // receives the parameter

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  // Extent / stride of dimension d (negative d counts from the end).
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  int64_t offset() const { return impl().offset; }
  size_t element_size() const { return tandem::element_size(dtype()); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  // True when the elements fill a gap-free block exactly once in some dimension order (e.g.
  // contiguous, or channels-last): then elementwise work can walk memory linearly.
  bool is_non_overlapping_and_dense() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  // How many in-place writes this tensor's data has had (PyTorch's `_version`); shared by all
  // views of the same storage. The in-place methods below and optimizer steps bump it.
  uint32_t version() const { return impl().storage->version(); }
  // Marks the data as written in place (PyTorch's torch.autograd.graph.increment_version): code
  // that writes through data_ptr() calls it so that backward notices a saved tensor changed.
  void bump_version() const { impl().storage->bump_version(); }
  // Pointer to the first element.
  void* data_ptr() const;
  // Typed pointer; throws DTypeError when T does not match dtype().
  template <class T> T* data_ptr() const {
    TANDEM_CHECK(dtype_of<T>::value == dtype(), DTypeError, "data_ptr<{}>() on a {} tensor",
                 dtype_name(dtype_of<T>::value), dtype_name(dtype()));
    return static_cast<T*>(data_ptr());
  }
  // The single element of a one-element tensor, converted.
  // Integers come out exactly (through int64, not a double: 2^53 + 1 stays itself); a float that
  // is NaN or out of the integer's range is a ValueError.
  template <class T = double> T item() const {
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      const int64_t v = item_int64();
      TANDEM_CHECK(v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                       (std::is_same_v<T, uint64_t> || v <= static_cast<int64_t>(std::numeric_limits<T>::max())),
                   ValueError, "item(): {} does not fit the requested integer type", v);
      return static_cast<T>(v);
    } else {
      return static_cast<T>(item_double());
    }
  }
  double item_double() const;
  int64_t item_int64() const;
  // Contents as doubles in row-major order (for tests and printing).
  std::vector<double> to_vector() const;
  std::string to_string() const;
  TensorImpl& impl() const {
    TANDEM_CHECK(impl_ != nullptr, Error, "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }

  // ---- views and copies (differentiable; ops/shape.cc) ----
  Tensor view(Shape shape) const;      // needs compatible strides; one -1 may be inferred
  Tensor reshape(Shape shape) const;   // a view when possible, else a copy
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(Shape dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;                    // transpose of a 2-d tensor
  Tensor slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;
  Tensor select(int64_t d, int64_t index) const;
  Tensor expand(Shape shape) const;    // -1 keeps a dimension; size-1 dims broadcast
  Tensor squeeze(int64_t d) const;
  Tensor unsqueeze(int64_t d) const;
  Tensor contiguous() const;           // self when already contiguous
  Tensor to(DType dtype) const;        // self when already of that dtype
  Tensor clone() const;                // contiguous deep copy

  // ---- in-place, no autograd (optimizers, initialisation); ops/inplace.cc ----
  // Each bumps version(): a backward that needs the old values then throws instead of using the new.
  Tensor& copy_(const Tensor& src);    // broadcasts src, converts dtype
  Tensor& fill_(double value);
  Tensor& zero_();
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(double value);

  // ---- autograd (autograd/tensor_autograd.cc) ----
  bool requires_grad() const;
  // Marks a leaf as needing gradients; throws on a non-leaf or an integer tensor.
  Tensor& requires_grad_(bool requires_grad = true);
  bool is_leaf() const;
  // The accumulated gradient (undefined until a backward reaches this leaf).
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  // Keeps this non-leaf's gradient in grad() after backward.
  void retain_grad() const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  // A tensor sharing this one's data but no autograd history.
  Tensor detach() const;
  // Computes d(this)/d(leaves) and accumulates into every leaf's grad(). `gradient` defaults to
  // 1 for a one-element tensor. The graph is freed afterwards unless retain_graph.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false, bool create_graph = false) const;
  // Called with this tensor's gradient during backward, before it is used; may return a
  // replacement. Returns a handle for remove_hook.
  int64_t register_hook(TensorHook hook) const;
  void remove_hook(int64_t handle) const;
  // On a leaf: called after its gradient was accumulated into grad() (DDP's entry point).
  int64_t register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  // An optional name used in error messages and by hooks (parameters get their dotted name).
  void set_name(std::string name) const;
  std::string name() const;

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);
std::string shape_str(const Shape& s);  // "[2, 3]"
// Whether writing `t` element by element would write some memory location twice: a dimension of
// stride 0 and size > 1 (an expand()ed view). PyTorch's has_internal_overlap for the cases it
// can decide; other layouts are assumed not to overlap.
bool has_internal_overlap(const Tensor& t);
// Whether `a` and `b` share some but not all of their memory (PyTorch's partial overlap: reading
// one while writing the other element by element gives order-dependent results). The same view
// twice is full overlap, not partial. Decided, as in PyTorch, only when both are dense (a
// contiguous block in some order); other layouts count as not overlapping.
bool has_partial_overlap(const Tensor& a, const Tensor& b);

// Row-major strides of a contiguous tensor of this shape.
Shape contiguous_strides(const Shape& shape);
int64_t shape_numel(const Shape& shape);
// Normalises a possibly negative dimension index; throws ShapeError naming `op` when out of range.
int64_t wrap_dim(int64_t d, int64_t ndim, const char* op);

// ---- factories (no autograd history; requires_grad_() afterwards for leaves) ----
Tensor empty(const Shape& shape, DType dtype = kFloat32);
// Uninitialised with the given strides (which must describe a dense, non-overlapping layout).
Tensor empty_strided(const Shape& shape, const Shape& strides, DType dtype = kFloat32);
// Same shape; x's strides kept when x is dense (channels-last stays channels-last), else contiguous.
Tensor empty_like(const Tensor& x, DType dtype);
inline Tensor empty_like(const Tensor& x) { return empty_like(x, x.dtype()); }
Tensor zeros(const Shape& shape, DType dtype = kFloat32);
Tensor ones(const Shape& shape, DType dtype = kFloat32);
Tensor full(const Shape& shape, double value, DType dtype = kFloat32);
Tensor arange(double end, DType dtype = kInt64);
Tensor arange(double start, double end, double step = 1.0, DType dtype = kInt64);
// Uniform [0, 1) / standard normal, from `gen` (default: the thread's default generator).
Tensor rand(const Shape& shape, DType dtype = kFloat32, Generator* gen = nullptr);
Tensor randn(const Shape& shape, DType dtype = kFloat32, Generator* gen = nullptr);
// Uniform integers in [low, high).
Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator* gen = nullptr);
// Wraps caller-owned memory without copying; `deleter` (optional) runs when the last view dies.
Tensor from_blob(void* data, const Shape& shape, DType dtype, std::function<void(void*)> deleter = {});
Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype,
                 std::function<void(void*)> deleter = {});
// A tensor holding a copy of `values` with the given shape (numel must match).
Tensor tensor(const std::vector<double>& values, const Shape& shape, DType dtype = kFloat32);
Tensor tensor(const std::vector<float>& values, const Shape& shape);
Tensor tensor(const std::vector<int64_t>& values, const Shape& shape);
Tensor scalar_tensor(double value, DType dtype = kFloat32);

// A new TensorImpl viewing `base`'s storage (no autograd; the differentiable views wrap this).
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);

}  // namespace tandem
