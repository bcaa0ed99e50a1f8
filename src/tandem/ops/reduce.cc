// Reductions with their backward beside them.
#include "tandem/ops/reduce.h"

#include <algorithm>
#include <cmath>

#include "tandem/amp/policy.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/kernels/cpu/reduce.h"
#include "tandem/ops/elementwise.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

void check_floating(const Tensor& x, const char* op) {
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "{}: expected a floating-point tensor, got {}", op,
               dtype_name(x.dtype()));
}

// Re-inserts reduced dims as size 1 so that a gradient broadcasts back over the input.
Tensor unsqueeze_reduced(const Tensor& g, const Shape& in_shape, const std::vector<int64_t>& dims, bool keepdim) {
  if (keepdim) return g;
  return g.reshape(kernels::reduced_shape(in_shape, dims, true));
}

// scale * g broadcast to the input's shape, laid out like the input when that was dense (a
// channels-last activation gets a channels-last gradient, so the ops before it stay on their
// linear fast paths).
Tensor broadcast_back(const Tensor& g, const Shape& in_shape, const Shape& in_strides, double scale) {
  const Tensor scaled = scale == 1.0 ? g : mul(g, scale);
  Tensor probe = make_view(scaled, in_shape, in_strides, 0);
  Tensor out = probe.is_non_overlapping_and_dense() ? empty_strided(in_shape, in_strides, g.dtype()) : empty(in_shape, g.dtype());
  out.copy_(scaled.expand(in_shape));
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::sum, [](const auto&... args) { return sum(args...); }, x, dims_in, keepdim);
  check_floating(x, "sum");
  const std::vector<int64_t> dims = kernels::reduction_dims(dims_in, x.dim(), "sum");
  Tensor out = kernels::sum(x, dims, keepdim, x.dtype());
  record("SumBackward", {x}, {out}, [in_shape = x.shape(), in_strides = x.strides(), dims, keepdim](const G& g) {
    return G{broadcast_back(unsqueeze_reduced(g[0], in_shape, dims, keepdim), in_shape, in_strides, 1.0)};
  });
  return out;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::mean, [](const auto&... args) { return mean(args...); }, x, dims_in, keepdim);
  check_floating(x, "mean");
  const std::vector<int64_t> dims = kernels::reduction_dims(dims_in, x.dim(), "mean");
  int64_t count = 1;
  for (int64_t d : dims) count *= x.size(d);
  Tensor s = kernels::sum(x, dims, keepdim, x.dtype() == kFloat64 ? kFloat64 : kFloat32);
  s.mul_(1.0 / static_cast<double>(count));
  Tensor out = s.to(x.dtype());  // 16-bit inputs: f32 statistics, rounded once
  record("MeanBackward", {x}, {out}, [in_shape = x.shape(), in_strides = x.strides(), dims, keepdim, count](const G& g) {
    return G{broadcast_back(unsqueeze_reduced(g[0], in_shape, dims, keepdim), in_shape, in_strides,
                            1.0 / static_cast<double>(count))};
  });
  return out;
}

namespace {

// max / min along `dim`: the values and the index of the first extreme element; the gradient
// flows to that element (PyTorch's value_selecting_reduction_backward).
std::pair<Tensor, Tensor> extreme_dim(const Tensor& x, int64_t dim, bool keepdim, bool minimum) {
  const char* op = minimum ? "min" : "max";
  const int64_t d = wrap_dim(dim, x.dim(), op);
  auto [values, indices] = kernels::max_dim(x, d, keepdim, minimum);
  if (is_floating(x.dtype())) {
    record(minimum ? "MinBackward" : "MaxBackward", {x}, {values}, [in_shape = x.shape(), d, keepdim, indices](const G& g) {
      // Scatter each gradient to the position of its extreme element.
      Tensor gi = zeros(in_shape, g[0].dtype());
      const Shape kshape = kernels::reduced_shape(in_shape, {d}, true);
      const Tensor gv = g[0].reshape(kshape).contiguous();
      const Tensor ix = indices.reshape(kshape).contiguous();
      const int64_t outer = shape_numel(Shape(in_shape.begin(), in_shape.begin() + d));
      const int64_t n = in_shape.empty() ? 1 : in_shape[d];
      const int64_t inner = shape_numel(Shape(in_shape.begin() + (in_shape.empty() ? 0 : d + 1), in_shape.end()));
      const int64_t* pi = ix.data_ptr<int64_t>();
      TANDEM_DISPATCH_FLOATING(gi.dtype(), "max backward", [&] {
        auto* dst = static_cast<scalar_t*>(gi.data_ptr());
        const auto* src = static_cast<const scalar_t*>(gv.data_ptr());
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t i = 0; i < inner; ++i) dst[(o * n + pi[o * inner + i]) * inner + i] = src[o * inner + i];
      });
      return G{gi};
    }, {indices});
  }
  return {values, indices};
}

// The max / min of all elements (0-d).
Tensor extreme_all(const Tensor& x, bool minimum) {
  const char* op = minimum ? "min" : "max";
  TANDEM_CHECK(x.numel() > 0, ShapeError, "{}: the input is empty (shape {})", op, shape_str(x.shape()));
  Tensor value = kernels::max_dim(x.detach().reshape({-1}), 0, false, minimum).first;
  if (is_floating(x.dtype())) {
    // PyTorch's evenly_distribute_backward: the gradient is shared equally by every element equal
    // to the extreme value (max(x, dim) gives it to the first one instead).
    record(minimum ? "MinBackward1" : "MaxBackward1", {x}, {value}, [xs = x.detach(), v = value.detach()](const G& g) {
      Tensor mask = eq(xs, v).to(kFloat64);  // counted in f64: exact for any number of ties
      double ties = sum(mask).item();
      if (ties == 0) {  // the extreme value is NaN: its NaN elements share the gradient
        mask = sub(ones(xs.shape(), kFloat64), eq(xs, xs).to(kFloat64));
        ties = sum(mask).item();
      }
      mask = mask.to(g[0].dtype());
      return G{mul(mask, div(g[0], scalar_tensor(ties, g[0].dtype())))};
    }, {x, value});
  }
  return value;
}

}  // namespace

std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) { return extreme_dim(x, dim, keepdim, false); }
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim) { return extreme_dim(x, dim, keepdim, true); }
Tensor max(const Tensor& x) { return extreme_all(x, false); }
Tensor min(const Tensor& x) { return extreme_all(x, true); }

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  const int64_t d = wrap_dim(dim, x.dim(), "argmax");
  return kernels::max_dim(x.detach(), d, keepdim).second;
}

Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) {
  const int64_t d = wrap_dim(dim, x.dim(), "argmin");
  return kernels::max_dim(x.detach(), d, keepdim, true).second;
}

namespace {

// var/std's reduced dims and divisor max(0, n - correction) (PyTorch's: n <= correction gives inf,
// or NaN for 0 / 0), after checking the input and the correction.
std::pair<std::vector<int64_t>, double> spread_dims(const Tensor& x, const std::vector<int64_t>& dims, double correction,
                                                    const char* op) {
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "{}: expected a floating input, got {}", op, dtype_name(x.dtype()));
  TANDEM_CHECK(std::isfinite(correction) && correction >= 0, ValueError,
               "{}: correction must be a finite number >= 0, got {}", op, correction);
  std::vector<int64_t> d = kernels::reduction_dims(dims, x.dim(), op);
  int64_t n = 1;
  for (int64_t k : d) n *= x.size(k);
  return {std::move(d), std::max(0.0, static_cast<double>(n) - correction)};
}

}  // namespace

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  const auto [d, denom] = spread_dims(x, dims, correction, "var");
  // Two passes, in f32 for 16-bit inputs (PyTorch accumulates them in f32 too), rounded once.
  const Tensor xc = is_reduced_float(x.dtype()) ? x.to(kFloat32) : x;
  const Tensor dev = sub(xc, mean(xc, d, /*keepdim=*/true));
  const Tensor v = div(sum(mul(dev, dev), d, keepdim), denom);
  return v.to(x.dtype());
}

Tensor std(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  const auto [d, denom] = spread_dims(x, dims, correction, "std");
  // Its own backward, PyTorch's std_backward: g / (2 std) * 2 (x - mean) / denom, and 0 where
  // the std is 0 (sqrt's backward there is g / 0, and a constant slice's gradient came out NaN).
  Tensor dev, s_keep;
  {
    NoGradGuard no_grad;
    const Tensor xc = is_reduced_float(x.dtype()) ? x.detach().to(kFloat32) : x.detach();
    dev = sub(xc, mean(xc, d, /*keepdim=*/true));
    s_keep = sqrt(div(sum(mul(dev, dev), d, /*keepdim=*/true), denom));
  }
  const Shape out_shape = kernels::reduced_shape(x.shape(), d, keepdim);
  Tensor out = s_keep.reshape(out_shape).to(x.dtype());
  if (out.is_same(s_keep) || out.storage() == s_keep.storage()) out = out.clone();  // (its own storage)
  record("StdBackward", {x}, {out}, [dev, s_keep, denom, in_dtype = x.dtype()](const G& g) {
    const Tensor gk = g[0].to(s_keep.dtype()).reshape(s_keep.shape());
    const Tensor coef = kernels::binary_op(gk, s_keep, "std backward", [denom](auto gg, auto ss) {
      using T = decltype(gg);
      return ss == T(0) ? T(0) : gg / (ss * static_cast<T>(denom));
    });
    return G{mul(dev, coef).to(in_dtype)};
  });
  return out;
}

}  // namespace tandem::ops
