// Tensor's in-place methods (declared in core/tensor.h). They record no autograd history, so
// they refuse a tensor that requires grad while grad mode is on (as PyTorch refuses a leaf), and
// they bump the data's version, so a backward that saved it refuses to use the new values.
#include <cstring>

#include "tandem/autograd/grad_mode.h"
#include "tandem/kernels/cpu/loops.h"

namespace tandem {
namespace {

void check_inplace(const Tensor& t, const char* op, bool writes_each_once = false) {
  TANDEM_CHECK(!(autograd::is_grad_enabled() && t.requires_grad()), AutogradError,
               "{}: a tensor that requires grad{} is being used in an in-place operation; in-place operations "
               "record no autograd history. {}",
               op, t.name().empty() ? "" : " (\"" + t.name() + "\")",
               t.is_leaf() ? "To update a parameter, wrap the update in NoGradGuard"
                           : "Use the out-of-place operation instead (y = y * 3, not y.mul_(3)): under NoGradGuard "
                             "the backward would not see the change and its gradients would be wrong");
  // PyTorch: "unsupported operation: more than one element of the written-to tensor refers to a
  // single memory location" (an expand()ed view would be written several times per element).
  // (fill_ and zero_ write one value: PyTorch allows them on an expanded view.)
  TANDEM_CHECK(writes_each_once || !has_internal_overlap(t), ValueError,
               "{}: more than one element of the written-to tensor (shape {}, strides {}) refers to a single memory "
               "location; clone() it first",
               op, shape_str(t.shape()), shape_str(t.strides()));
  // Counted before the write: a write that fails part-way has changed the data too.
  t.bump_version();
}

void check_source(const Tensor& dst, const Tensor& src, const char* op) {
  TANDEM_CHECK(!has_partial_overlap(dst, src), ValueError,
               "{}: some elements of the input tensor and the written-to tensor refer to a single memory location "
               "(they overlap in part); clone() the input first",
               op);
}

}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  check_source(*this, src, "copy_");
  check_inplace(*this, "copy_");
  kernels::copy_into(*this, src);
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_", /*writes_each_once=*/true);
  Tensor v = full({}, value, dtype());
  kernels::copy_into(*this, v);
  return *this;
}

Tensor& Tensor::zero_() {
  check_inplace(*this, "zero_", /*writes_each_once=*/true);
  if (is_contiguous()) {
    std::memset(data_ptr(), 0, nbytes());
    return *this;
  }
  return fill_(0.0);
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_source(*this, other, "add_");
  check_inplace(*this, "add_");
  const Tensor o = other.dtype() == dtype() ? other : other.detach().to(dtype());
  const Shape ost = kernels::broadcast_strides(o, shape(), "add_");
  TANDEM_DISPATCH_FLOATING(dtype(), "add_", [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    const C a = static_cast<C>(alpha);
    if (is_contiguous() && o.is_contiguous() && o.shape() == shape()) {
      T* d = static_cast<T*>(data_ptr());
      const T* s = static_cast<const T*>(o.data_ptr());
      parallel_for(0, numel(), kernels::kElementwiseGrain, [&](int64_t b, int64_t e) {
        if (alpha == 1.0) {
          for (int64_t i = b; i < e; ++i) d[i] = static_cast<T>(static_cast<C>(d[i]) + static_cast<C>(s[i]));
        } else {
          for (int64_t i = b; i < e; ++i) d[i] = static_cast<T>(static_cast<C>(d[i]) + a * static_cast<C>(s[i]));
        }
      });
      return;
    }
    kernels::for_each_row<2>(shape(), {strides(), ost}, {static_cast<char*>(data_ptr()), static_cast<char*>(o.data_ptr())},
                             {sizeof(T), sizeof(T)}, [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n, int64_t) {
                               T* d = reinterpret_cast<T*>(p[0]);
                               const T* s = reinterpret_cast<const T*>(p[1]);
                               for (int64_t i = 0; i < n; ++i)
                                 d[i * st[0]] = static_cast<T>(static_cast<C>(d[i * st[0]]) + a * static_cast<C>(s[i * st[1]]));
                             });
  });
  return *this;
}

Tensor& Tensor::mul_(double value) {
  check_inplace(*this, "mul_");
  TANDEM_DISPATCH_FLOATING(dtype(), "mul_", [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    const C v = static_cast<C>(value);
    kernels::for_each_row<1>(shape(), {strides()}, {static_cast<char*>(data_ptr())}, {sizeof(T)},
                             [&](std::array<char*, 1> p, std::array<int64_t, 1> st, int64_t n, int64_t) {
                               T* d = reinterpret_cast<T*>(p[0]);
                               for (int64_t i = 0; i < n; ++i) d[i * st[0]] = static_cast<T>(static_cast<C>(d[i * st[0]]) * v);
                             });
  });
  return *this;
}

}  // namespace tandem
