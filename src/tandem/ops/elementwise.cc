// Elementwise ops, each forward with its backward beside it.
#include "tandem/ops/elementwise.h"

#include <cmath>

#include "tandem/amp/policy.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/activation.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/kernels/cpu/reduce.h"

namespace tandem::ops {

using autograd::record;
using kernels::binary_op;
using kernels::unary_op;
using G = std::vector<Tensor>;

namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)

}  // namespace

DType result_type(const Tensor& a, const Tensor& b) {
  const auto category = [](DType d) { return d == kBool ? 0 : is_floating(d) ? 2 : 1; };
  const bool a0 = a.dim() == 0, b0 = b.dim() == 0;
  if (a0 != b0) {
    const DType dimensioned = a0 ? b.dtype() : a.dtype(), zero_dim = a0 ? a.dtype() : b.dtype();
    if (category(zero_dim) <= category(dimensioned)) return dimensioned;
  }
  return promote_types(a.dtype(), b.dtype());
}

namespace {

// Promotes both operands to their common dtype, result_type's (differentiably).
std::pair<Tensor, Tensor> promote(const Tensor& a, const Tensor& b, const char* op) {
  TANDEM_CHECK(a.defined() && b.defined(), ValueError, "{}: undefined tensor operand", op);
  const DType dt = result_type(a, b);
  TANDEM_CHECK(is_floating(dt), DTypeError, "{}: expected floating-point tensors, got {} and {}", op,
               dtype_name(a.dtype()), dtype_name(b.dtype()));
  return {a.to(dt), b.to(dt)};
}

void check_floating(const Tensor& x, const char* op) {
  TANDEM_CHECK(x.defined(), ValueError, "{}: undefined tensor", op);
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "{}: expected a floating-point tensor, got {}", op,
               dtype_name(x.dtype()));
}

}  // namespace

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  TANDEM_CHECK(lead >= 0, ShapeError, "sum_to: cannot reduce shape {} to {}", shape_str(g.shape()), shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.size(d) != 1)) dims.push_back(d);
  }
  if (dims.empty()) return g.reshape(shape);
  Tensor s = kernels::sum(g, dims, /*keepdim=*/false, g.dtype());
  return s.reshape(shape);
}

// ---- binary ----

Tensor add(const Tensor& a0, const Tensor& b0, double alpha) {
  auto [a, b] = promote(a0, b0, "add");
  const float af = static_cast<float>(alpha);
  Tensor out = alpha == 1.0 ? binary_op(a, b, "add", [](auto x, auto y) { return x + y; })
                            : binary_op(a, b, "add", [af, alpha](auto x, auto y) {
                                using T = decltype(x);
                                return x + static_cast<T>(std::is_same_v<T, float> ? af : alpha) * y;
                              });
  record("AddBackward", {a, b}, {out}, [sa = a.shape(), sb = b.shape(), alpha](const G& g) {
    return G{sum_to(g[0], sa), sum_to(alpha == 1.0 ? g[0] : mul(g[0], alpha), sb)};
  });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b, double alpha) { return add(a, b, -alpha); }

Tensor mul(const Tensor& a0, const Tensor& b0) {
  auto [a, b] = promote(a0, b0, "mul");
  Tensor out = binary_op(a, b, "mul", [](auto x, auto y) { return x * y; });
  record("MulBackward", {a, b}, {out}, [a = a.detach(), b = b.detach(), ra = a.requires_grad(), rb = b.requires_grad()](const G& g) {
    return G{ra ? sum_to(mul(g[0], b), a.shape()) : Tensor(), rb ? sum_to(mul(g[0], a), b.shape()) : Tensor()};
  }, {b.requires_grad() ? a : Tensor(), a.requires_grad() ? b : Tensor()});
  return out;
}

Tensor div(const Tensor& a0, const Tensor& b0) {
  auto [a, b] = promote(a0, b0, "div");
  Tensor out = binary_op(a, b, "div", [](auto x, auto y) { return x / y; });
  record("DivBackward", {a, b}, {out}, [a = a.detach(), b = b.detach(), rb = b.requires_grad()](const G& g) {
    Tensor ga = sum_to(div(g[0], b), a.shape());
    Tensor gb;
    if (rb) {
      gb = sum_to(kernels::ternary_op(g[0], a, b, "div backward",
                                      [](auto gg, auto x, auto y) { return -gg * x / (y * y); }),
                  b.shape());
    }
    return G{ga, gb};
  }, {b.requires_grad() ? a : Tensor(), b});
  return out;
}

Tensor add(const Tensor& a, double b) {
  check_floating(a, "add");
  Tensor out = unary_op(a, "add", [b](auto x) { return x + static_cast<decltype(x)>(b); });
  record("AddScalarBackward", {a}, {out}, [](const G& g) { return G{g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double b) {
  check_floating(a, "mul");
  Tensor out = unary_op(a, "mul", [b](auto x) { return x * static_cast<decltype(x)>(b); });
  record("MulScalarBackward", {a}, {out}, [b](const G& g) { return G{mul(g[0], b)}; });
  return out;
}

Tensor div(const Tensor& a, double b) {
  check_floating(a, "div");
  Tensor out = unary_op(a, "div", [b](auto x) { return x / static_cast<decltype(x)>(b); });
  record("DivScalarBackward", {a}, {out}, [b](const G& g) { return G{div(g[0], b)}; });
  return out;
}

Tensor rsub(const Tensor& a, double b) {
  check_floating(a, "rsub");
  Tensor out = unary_op(a, "rsub", [b](auto x) { return static_cast<decltype(x)>(b) - x; });
  record("RsubBackward", {a}, {out}, [](const G& g) { return G{neg(g[0])}; });
  return out;
}

// ---- unary ----

Tensor neg(const Tensor& x) {
  check_floating(x, "neg");
  Tensor out = unary_op(x, "neg", [](auto v) { return -v; });
  record("NegBackward", {x}, {out}, [](const G& g) { return G{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& x) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::exp, [](const auto&... args) { return exp(args...); }, x);
  check_floating(x, "exp");
  Tensor out = unary_op(x, "exp", [](auto v) { return std::exp(v); });
  record("ExpBackward", {x}, {out}, [y = out.detach()](const G& g) { return G{mul(g[0], y)}; }, {out});
  return out;
}

Tensor log(const Tensor& x) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::log, [](const auto&... args) { return log(args...); }, x);
  check_floating(x, "log");
  Tensor out = unary_op(x, "log", [](auto v) { return std::log(v); });
  record("LogBackward", {x}, {out}, [x = x.detach()](const G& g) { return G{div(g[0], x)}; }, {x});
  return out;
}

Tensor sqrt(const Tensor& x) {
  check_floating(x, "sqrt");
  Tensor out = unary_op(x, "sqrt", [](auto v) { return std::sqrt(v); });
  record("SqrtBackward", {x}, {out}, [y = out.detach()](const G& g) {
    return G{binary_op(g[0], y, "sqrt backward", [](auto gg, auto yy) { return gg / (yy + yy); })};
  }, {out});
  return out;
}

Tensor rsqrt(const Tensor& x) {
  check_floating(x, "rsqrt");
  Tensor out = unary_op(x, "rsqrt", [](auto v) { return decltype(v)(1) / std::sqrt(v); });
  record("RsqrtBackward", {x}, {out}, [y = out.detach()](const G& g) {
    return G{binary_op(g[0], y, "rsqrt backward", [](auto gg, auto yy) { return decltype(gg)(-0.5) * gg * yy * yy * yy; })};
  }, {out});
  return out;
}

Tensor square(const Tensor& x) {
  check_floating(x, "square");
  Tensor out = unary_op(x, "square", [](auto v) { return v * v; });
  record("SquareBackward", {x}, {out}, [x = x.detach()](const G& g) {
    return G{binary_op(g[0], x, "square backward", [](auto gg, auto xx) { return decltype(gg)(2) * gg * xx; })};
  }, {x});
  return out;
}

Tensor abs(const Tensor& x) {
  check_floating(x, "abs");
  Tensor out = unary_op(x, "abs", [](auto v) { return std::abs(v); });
  record("AbsBackward", {x}, {out}, [x = x.detach()](const G& g) {
    return G{binary_op(g[0], x, "abs backward", [](auto gg, auto xx) {
      using T = decltype(gg);
      return xx > T(0) ? gg : (xx < T(0) ? -gg : T(0));
    })};
  }, {x});
  return out;
}

Tensor pow(const Tensor& x, double p) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::pow, [](const auto&... args) { return pow(args...); }, x, p);
  check_floating(x, "pow");
  Tensor out = unary_op(x, "pow", [p](auto v) { return std::pow(v, static_cast<decltype(v)>(p)); });
  record("PowBackward", {x}, {out}, [x = x.detach(), p](const G& g) {
    if (p == 0.0) return G{zeros(x.shape(), g[0].dtype())};
    return G{binary_op(g[0], x, "pow backward", [p](auto gg, auto xx) {
      using T = decltype(gg);
      return gg * static_cast<T>(p) * std::pow(xx, static_cast<T>(p - 1.0));
    })};
  }, {x});
  return out;
}

Tensor pow(const Tensor& x0, const Tensor& e0) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::pow, [](const auto&... args) { return pow(args...); }, x0, e0);
  auto [x, e] = promote(x0, e0, "pow");
  Tensor out = binary_op(x, e, "pow", [](auto a, auto b) { return std::pow(a, b); });
  record("PowTensorBackward", {x, e}, {out}, [x = x.detach(), e = e.detach(), y = out.detach()](const G& g) {
    Tensor gx = kernels::ternary_op(g[0], x, e, "pow backward", [](auto gg, auto a, auto b) {
      using T = decltype(gg);
      return b == T(0) ? T(0) : gg * b * std::pow(a, b - T(1));
    });
    // d/de x^e = x^e log x, taken as 0 where x == 0 and e >= 0 (PyTorch's convention); there
    // x^e is 0 or 1, while e < 0 makes it inf (and the gradient -inf, as PyTorch's).
    Tensor ge = kernels::ternary_op(g[0], x, y, "pow backward", [](auto gg, auto a, auto yy) {
      using T = decltype(gg);
      return a == T(0) && !std::isinf(static_cast<double>(yy)) ? T(0) : gg * yy * std::log(a);
    });
    return G{sum_to(gx, x.shape()), sum_to(ge, e.shape())};
  }, {x, e, out});
  return out;
}

Tensor relu_backward(const Tensor& grad, const Tensor& result) {
  // PyTorch's threshold_backward: the gradient passes unless the result is <= 0 (a NaN passes).
  return binary_op(grad, result, "relu backward",
                   [](auto gg, auto y) { return !(y <= decltype(y)(0)) ? gg : decltype(gg)(0); });
}

Tensor relu(const Tensor& x) {
  check_floating(x, "relu");
  // NaN passes through, as PyTorch's relu (clamp_min(x, 0)): a diverging activation stays visible.
  Tensor out = unary_op(x, "relu", [](auto v) { return !(v <= decltype(v)(0)) ? v : decltype(v)(0); });
  record("ReluBackward", {x}, {out}, [y = out.detach()](const G& g) { return G{relu_backward(g[0], y)}; }, {out});
  return out;
}

Tensor gelu_backward(const Tensor& grad, const Tensor& x, std::string_view approximate) {
  if (approximate == "tanh" && (x.dtype() == kFloat32 || is_reduced_float(x.dtype())) && grad.dtype() == x.dtype() &&
      x.is_non_overlapping_and_dense() && grad.shape() == x.shape() && grad.strides() == x.strides()) {
    Tensor out = empty_like(x);
    if (x.dtype() == kFloat32) {
      kernels::gelu_tanh_backward_f32(grad.data_ptr<float>(), x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
    } else {
      kernels::gelu_tanh_backward_reduced(grad.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), x.dtype());
    }
    return out;
  }
  if (approximate == "tanh") {
    return binary_op(grad, x, "gelu backward", [](auto gg, auto v) {
      using T = decltype(v);
      const T k = static_cast<T>(kSqrt2OverPi), c = static_cast<T>(0.044715);
      const T inner = k * (v + c * v * v * v);
      const T t = std::tanh(inner);
      const T d_inner = k * (T(1) + T(3) * c * v * v);
      return gg * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * d_inner);
    });
  }
  return binary_op(grad, x, "gelu backward", [](auto gg, auto v) {
    using T = decltype(v);
    const T cdf = T(0.5) * (T(1) + std::erf(v * static_cast<T>(kInvSqrt2)));
    const T pdf = static_cast<T>(kInvSqrt2Pi) * std::exp(T(-0.5) * v * v);
    return gg * (cdf + v * pdf);
  });
}

Tensor gelu(const Tensor& x, std::string_view approximate) {
  check_floating(x, "gelu");
  TANDEM_CHECK(approximate == "none" || approximate == "tanh", ValueError,
               "gelu: approximate must be \"none\" or \"tanh\", got \"{}\"", approximate);
  Tensor out;
  if (approximate == "tanh" && x.dtype() == kFloat32 && x.is_non_overlapping_and_dense()) {
    out = empty_like(x);  // fused, vectorised (libm's tanhf is a scalar call)
    kernels::gelu_tanh_f32(x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
  } else if (approximate == "tanh" && is_reduced_float(x.dtype()) && x.is_non_overlapping_and_dense()) {
    out = empty_like(x);
    kernels::gelu_tanh_reduced(x.data_ptr(), out.data_ptr(), x.numel(), x.dtype());
  } else if (approximate == "tanh") {
    out = unary_op(x, "gelu", [](auto v) {
      using T = decltype(v);
      const T k = static_cast<T>(kSqrt2OverPi), c = static_cast<T>(0.044715);
      return T(0.5) * v * (T(1) + std::tanh(k * (v + c * v * v * v)));
    });
  } else {
    out = unary_op(x, "gelu", [](auto v) {
      using T = decltype(v);
      return T(0.5) * v * (T(1) + std::erf(v * static_cast<T>(kInvSqrt2)));
    });
  }
  record("GeluBackward", {x}, {out}, [x = x.detach(), approx = std::string(approximate)](const G& g) {
    return G{gelu_backward(g[0], x, approx)};
  }, {x});
  return out;
}

Tensor sigmoid(const Tensor& x) {
  check_floating(x, "sigmoid");
  Tensor out = unary_op(x, "sigmoid", [](auto v) {
    using T = decltype(v);
    return T(1) / (T(1) + std::exp(-v));
  });
  record("SigmoidBackward", {x}, {out}, [y = out.detach()](const G& g) {
    return G{binary_op(g[0], y, "sigmoid backward", [](auto gg, auto yy) { return gg * yy * (decltype(yy)(1) - yy); })};
  }, {out});
  return out;
}

Tensor tanh(const Tensor& x) {
  check_floating(x, "tanh");
  Tensor out = unary_op(x, "tanh", [](auto v) { return std::tanh(v); });
  record("TanhBackward", {x}, {out}, [y = out.detach()](const G& g) {
    return G{binary_op(g[0], y, "tanh backward", [](auto gg, auto yy) { return gg * (decltype(yy)(1) - yy * yy); })};
  }, {out});
  return out;
}

Tensor clamp(const Tensor& x, double lo, double hi) {
  check_floating(x, "clamp");
  TANDEM_CHECK(lo <= hi, ValueError, "clamp: min {} is greater than max {}", lo, hi);
  Tensor out = unary_op(x, "clamp", [lo, hi](auto v) {
    using T = decltype(v);
    return std::min(std::max(v, static_cast<T>(lo)), static_cast<T>(hi));
  });
  record("ClampBackward", {x}, {out}, [x = x.detach(), lo, hi](const G& g) {
    return G{binary_op(g[0], x, "clamp backward", [lo, hi](auto gg, auto v) {
      using T = decltype(v);
      return (v >= static_cast<T>(lo) && v <= static_cast<T>(hi)) ? gg : T(0);
    })};
  }, {x});
  return out;
}

// ---- comparisons ----

Tensor eq(const Tensor& a, const Tensor& b) {
  const Shape shape = kernels::broadcast_shapes(a.shape(), b.shape(), "eq");
  const Tensor ad = a.detach().to(kFloat64).expand(shape).contiguous();
  const Tensor bd = b.detach().to(kFloat64).expand(shape).contiguous();
  Tensor out = empty(shape, kBool);
  const double* pa = ad.data_ptr<double>();
  const double* pb = bd.data_ptr<double>();
  bool* o = out.data_ptr<bool>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = pa[i] == pb[i];
  return out;
}

Tensor gt(const Tensor& a, double b) {
  const Tensor ad = a.detach().to(kFloat64).contiguous();
  Tensor out = empty(a.shape(), kBool);
  const double* pa = ad.data_ptr<double>();
  bool* o = out.data_ptr<bool>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = pa[i] > b;
  return out;
}

int64_t count_equal(const Tensor& a, const Tensor& b) {
  const Tensor e = eq(a, b);
  const bool* p = e.data_ptr<bool>();
  int64_t n = 0;
  for (int64_t i = 0; i < e.numel(); ++i) n += p[i];
  return n;
}

}  // namespace tandem::ops

namespace tandem {
Tensor operator+(const Tensor& a, const Tensor& b) { return ops::add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return ops::sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return ops::mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return ops::div(a, b); }
Tensor operator+(const Tensor& a, double b) { return ops::add(a, b); }
Tensor operator-(const Tensor& a, double b) { return ops::add(a, -b); }
Tensor operator*(const Tensor& a, double b) { return ops::mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return ops::div(a, b); }
Tensor operator+(double a, const Tensor& b) { return ops::add(b, a); }
Tensor operator-(double a, const Tensor& b) { return ops::rsub(b, a); }
Tensor operator*(double a, const Tensor& b) { return ops::mul(b, a); }
Tensor operator-(const Tensor& a) { return ops::neg(a); }
}  // namespace tandem
