#include "tandem/ops/where.h"

#include "tandem/amp/policy.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/ops/elementwise.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

// The bool condition as 0/1 in `dtype`, so the elementwise machinery can select with it.
Tensor as_selector(const Tensor& cond, DType dtype, const char* op) {
  TANDEM_CHECK(cond.dtype() == kBool, DTypeError, "{}: expected a bool condition/mask, got {}", op,
               dtype_name(cond.dtype()));
  return cond.detach().to(dtype);
}

}  // namespace

Tensor where(const Tensor& cond, const Tensor& a0, const Tensor& b0) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::where, [](const auto&... args) { return where(args...); }, cond, a0, b0);
  const DType dt = result_type(a0, b0);
  TANDEM_CHECK(is_floating(dt), DTypeError, "where: expected floating values, got {} and {}", dtype_name(a0.dtype()),
               dtype_name(b0.dtype()));
  const Tensor a = a0.to(dt), b = b0.to(dt);
  const Tensor sel = as_selector(cond, dt, "where");
  Tensor out = kernels::ternary_op(sel, a.detach(), b.detach(), "where", [](auto s, auto x, auto y) { return s != decltype(s)(0) ? x : y; });
  record("WhereBackward", {a, b}, {out}, [sel, sa = a.shape(), sb = b.shape()](const G& g) {
    Tensor ga = kernels::binary_op(g[0], sel, "where backward", [](auto gg, auto s) { return s != decltype(s)(0) ? gg : decltype(gg)(0); });
    Tensor gb = kernels::binary_op(g[0], sel, "where backward", [](auto gg, auto s) { return s != decltype(s)(0) ? decltype(gg)(0) : gg; });
    return G{sum_to(ga, sa), sum_to(gb, sb)};
  });
  return out;
}

Tensor masked_fill(const Tensor& x_in, const Tensor& mask, double value) {
  TANDEM_CHECK(is_floating(x_in.dtype()), DTypeError, "masked_fill: expected a floating tensor, got {}",
               dtype_name(x_in.dtype()));
  const Tensor sel = as_selector(mask, x_in.dtype(), "masked_fill");
  // As PyTorch's out-of-place masked_fill: x and mask broadcast together, so a mask with more
  // (or larger) dims than x gives the broadcast shape; x's gradient is summed back by expand.
  const Shape shape = kernels::broadcast_shapes(x_in.shape(), mask.shape(), "masked_fill");
  const Tensor x = shape == x_in.shape() ? x_in : x_in.expand(shape);
  Tensor out = kernels::binary_op(x.detach(), sel, "masked_fill", [value](auto v, auto s) {
    using T = decltype(v);
    return s != T(0) ? static_cast<T>(value) : v;
  });
  record("MaskedFillBackward", {x}, {out}, [sel](const G& g) {
    return G{kernels::binary_op(g[0], sel, "masked_fill backward", [](auto gg, auto s) { return s != decltype(s)(0) ? decltype(gg)(0) : gg; })};
  });
  return out;
}

namespace {

Tensor triangle(const Tensor& x, int64_t diagonal, bool lower, const char* op) {
  TANDEM_CHECK(x.dim() >= 2, ShapeError, "{}: expected a tensor with at least 2 dims, got {}", op, shape_str(x.shape()));
  const int64_t R = x.size(-2), C = x.size(-1);
  Tensor keep = empty({R, C}, kBool);
  bool* p = keep.data_ptr<bool>();
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) p[i * C + j] = lower ? (j - i <= diagonal) : (j - i >= diagonal);
  if (!is_floating(x.dtype())) {
    // Integer/bool tensors: no gradient, select directly.
    Tensor out = x.detach().contiguous().clone();
    const Tensor k = keep.expand(x.shape()).contiguous();
    TANDEM_DISPATCH_ALL(x.dtype(), op, [&] {
      auto* o = static_cast<scalar_t*>(out.data_ptr());
      const bool* kp = k.data_ptr<bool>();
      for (int64_t i = 0; i < out.numel(); ++i)
        if (!kp[i]) o[i] = scalar_t{};
    });
    return out;
  }
  Tensor drop = empty({R, C}, kBool);
  bool* d = drop.data_ptr<bool>();
  for (int64_t i = 0; i < R * C; ++i) d[i] = !p[i];
  return masked_fill(x, drop, 0.0);
}

}  // namespace

Tensor tril(const Tensor& x, int64_t diagonal) { return triangle(x, diagonal, true, "tril"); }
Tensor triu(const Tensor& x, int64_t diagonal) { return triangle(x, diagonal, false, "triu"); }

}  // namespace tandem::ops
