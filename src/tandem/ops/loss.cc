// Softmax, log_softmax and losses, each forward with its backward beside it.
#include "tandem/ops/loss.h"

#include <cmath>
#include <limits>

#include "tandem/amp/policy.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/reduce.h"
#include "tandem/ops/where.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

enum class Reduction { none, mean, sum };

Reduction parse_reduction(std::string_view r, const char* op) {
  if (r == "mean") return Reduction::mean;
  if (r == "sum") return Reduction::sum;
  if (r == "none") return Reduction::none;
  throw ValueError(fmt::format("{}: reduction must be \"mean\", \"sum\" or \"none\", got \"{}\"", op, r));
}

// Moves `dim` last and makes the data contiguous: rows of length C.
Tensor rows_along(const Tensor& x, int64_t dim) {
  if (dim == x.dim() - 1) return x.detach().contiguous();
  return x.detach().transpose(dim, -1).contiguous();
}

Tensor restore_dim(const Tensor& rows, int64_t dim, int64_t ndim) {
  if (dim == ndim - 1) return rows;
  return rows.transpose(dim, -1).contiguous();
}

// Row-wise softmax (log = false) or log-softmax on contiguous rows of length C.
template <class T>
void softmax_rows(const T* in, T* out, int64_t rows, int64_t C, bool log) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* x = in + r * C;
      T* y = out + r * C;
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t c = 0; c < C; ++c) m = std::max(m, static_cast<Acc>(x[c]));
      Acc s = 0;
      for (int64_t c = 0; c < C; ++c) s += std::exp(static_cast<Acc>(x[c]) - m);
      if (log) {
        const Acc lse = m + std::log(s);
        for (int64_t c = 0; c < C; ++c) y[c] = static_cast<T>(static_cast<Acc>(x[c]) - lse);
      } else {
        const Acc inv = Acc(1) / s;
        for (int64_t c = 0; c < C; ++c) y[c] = static_cast<T>(std::exp(static_cast<Acc>(x[c]) - m) * inv);
      }
    }
  });
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "{}: expected a floating-point tensor, got {}",
               log ? "log_softmax" : "softmax", dtype_name(x.dtype()));
  if (x.dim() == 0) return softmax_impl(x.reshape({1}), 0, log).reshape({});
  dim = wrap_dim(dim, x.dim(), log ? "log_softmax" : "softmax");
  const Tensor rows = rows_along(x, dim);
  const int64_t C = x.size(dim);
  Tensor y = empty(rows.shape(), x.dtype());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "softmax", [&] {
    softmax_rows(static_cast<const scalar_t*>(rows.data_ptr()), static_cast<scalar_t*>(y.data_ptr()),
                 rows.numel() / std::max<int64_t>(C, 1), C, log);
  });
  return restore_dim(y, dim, x.dim());
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::softmax, [](const auto&... args) { return softmax(args...); }, x, dim);
  Tensor y = softmax_impl(x, dim, false);
  if (x.dim() == 0) return y;
  const int64_t d = wrap_dim(dim, x.dim(), "softmax");
  record("SoftmaxBackward", {x}, {y}, [y = y.detach(), d](const G& g) {
    // dx = y * (g - sum(g * y))
    Tensor gy = mul(g[0], y);
    return G{sub(gy, mul(y, sum(gy, {d}, true)))};
  }, {y});
  return y;
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::log_softmax, [](const auto&... args) { return log_softmax(args...); }, x, dim);
  Tensor y = softmax_impl(x, dim, true);
  if (x.dim() == 0) return y;
  const int64_t d = wrap_dim(dim, x.dim(), "log_softmax");
  record("LogSoftmaxBackward", {x}, {y}, [y = y.detach(), d](const G& g) {
    // dx = g - exp(y) * sum(g)
    return G{sub(g[0], mul(exp(y), sum(g[0], {d}, true)))};
  }, {y});
  return y;
}

namespace {

// (N, C, d1, ...) -> (N, d1, ..., C) and back.
Tensor classes_last(const Tensor& x) {
  Shape perm{0};
  for (int64_t d = 2; d < x.dim(); ++d) perm.push_back(d);
  perm.push_back(1);
  return x.permute(perm);
}

Tensor classes_second(const Tensor& x) {
  Shape perm{0, x.dim() - 1};
  for (int64_t d = 1; d < x.dim() - 1; ++d) perm.push_back(d);
  return x.permute(perm);
}

// Input as (rows, C) logits and target as (rows) indices, whatever the input layout.
struct Flat {
  Tensor x;       // (R, C), contiguous, input dtype
  Tensor target;  // (R), int64, contiguous
  Shape loss_shape;  // shape of the unreduced loss
};

Flat flatten_classes(const Tensor& input, const Tensor& target, const char* op) {
  TANDEM_CHECK(is_floating(input.dtype()), DTypeError, "{}: expected floating-point input, got {}", op,
               dtype_name(input.dtype()));
  TANDEM_CHECK(target.dtype() == kInt64 || target.dtype() == kInt32, DTypeError,
               "{}: expected int64 class-index targets, got {} (probabilities as targets are not supported)", op,
               dtype_name(target.dtype()));
  Flat f;
  if (input.dim() == 1) {
    TANDEM_CHECK(target.dim() == 0, ShapeError, "{}: for input of shape {} expected a 0-d target, got {}", op,
                 shape_str(input.shape()), shape_str(target.shape()));
    f.x = input.detach().reshape({1, input.size(0)}).contiguous();
    f.loss_shape = {};
  } else {
    TANDEM_CHECK(input.dim() >= 2, ShapeError, "{}: expected input of shape (N, C) or (N, C, d1, ...), got {}", op,
                 shape_str(input.shape()));
    Shape expect{input.size(0)};
    for (int64_t d = 2; d < input.dim(); ++d) expect.push_back(input.size(d));
    TANDEM_CHECK(target.shape() == expect, ShapeError, "{}: input of shape {} needs a target of shape {}, got {}", op,
                 shape_str(input.shape()), shape_str(expect), shape_str(target.shape()));
    const int64_t C = input.size(1);
    f.x = input.dim() == 2 ? input.detach().contiguous() : classes_last(input.detach()).reshape({-1, C}).contiguous();
    f.loss_shape = expect;
  }
  f.target = target.to(kInt64).contiguous().reshape({-1});
  return f;
}

}  // namespace

namespace {

// cross_entropy with class weights, composed of differentiable ops in the accumulation dtype:
// loss_r = -(1 - eps) w[t_r] logp[r, t_r] - eps / C sum_c w_c logp[r, c] (0 for ignored rows);
// "mean" divides the sum by sum_r w[t_r] over the rows not ignored (PyTorch's nll_loss and its
// label-smoothing term both normalise so).
Tensor weighted_cross_entropy(const Tensor& input, const Flat& f, const CrossEntropyOptions& o, Reduction red, DType acc_dt) {
  const int64_t R = f.x.size(0), C = f.x.size(1);
  const Tensor& w = o.weight;
  TANDEM_CHECK(w.dim() == 1 && w.size(0) == C, ShapeError,
               "cross_entropy: weight must be a 1-d tensor of {} class weights, got shape {}", C, shape_str(w.shape()));
  TANDEM_CHECK(is_floating(w.dtype()), DTypeError, "cross_entropy: weight must be floating-point, got {}",
               dtype_name(w.dtype()));
  TANDEM_CHECK(!(autograd::is_grad_enabled() && w.requires_grad()), AutogradError,
               "cross_entropy: weight requires grad, but the loss is not differentiable with respect to its class "
               "weights (nor is PyTorch's); pass weight.detach()");
  const std::vector<double> wv = w.to_vector();
  const int64_t* t = f.target.data_ptr<int64_t>();
  // Constants: each kept row's target as a mask (a selection, not a product with a one-hot: a
  // class at -inf would make -inf * 0 = NaN), its weight, and the rows kept.
  Tensor target_mask = zeros({R, C}, kBool), kept_mask = zeros({R}, kBool);
  auto* tm = static_cast<uint8_t*>(target_mask.data_ptr());
  auto* km = static_cast<uint8_t*>(kept_mask.data_ptr());
  std::vector<double> row_weight(static_cast<size_t>(R), 0.0);
  double total_weight = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (t[r] == o.ignore_index) continue;
    tm[r * C + t[r]] = 1;
    km[r] = 1;
    row_weight[static_cast<size_t>(r)] = wv[static_cast<size_t>(t[r])];
    total_weight += wv[static_cast<size_t>(t[r])];
  }
  // The input as (R, C) rows, differentiably (f.x is a detached copy).
  Tensor rows;
  if (input.dim() == 1) rows = input.reshape({1, C});
  else if (input.dim() == 2) rows = input;
  else rows = classes_last(input).reshape({R, C});
  const Tensor logp = log_softmax(rows.to(acc_dt), 1);
  const Tensor zero = zeros({}, acc_dt);
  const double eps = o.label_smoothing;
  const Tensor target_logp = sum(where(target_mask, logp, zero), {1});  // logp[r, t_r], 0 when ignored
  Tensor per_row = mul(mul(target_logp, tensor(row_weight, {R}, acc_dt)), -(1.0 - eps));
  if (eps > 0) {
    const Tensor smooth = sum(mul(logp, w.detach().to(acc_dt).reshape({1, C})), {1});
    per_row = sub(per_row, mul(where(kept_mask, smooth, zero), eps / static_cast<double>(C)));
  }
  if (red == Reduction::none) return per_row.reshape(f.loss_shape);
  const Tensor total = sum(per_row);
  return red == Reduction::sum ? total : div(total, total_weight);
}

}  // namespace

Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& o) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::cross_entropy, [](const auto&... args) { return cross_entropy(args...); }, input, target, o);
  const Reduction red = parse_reduction(o.reduction, "cross_entropy");
  TANDEM_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, ValueError,
               "cross_entropy: label_smoothing must be in [0, 1], got {}", o.label_smoothing);
  Flat f = flatten_classes(input, target, "cross_entropy");
  const int64_t R = f.x.size(0), C = f.x.size(1);
  const DType acc_dt = input.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const int64_t* t = f.target.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TANDEM_CHECK(t[r] == o.ignore_index || (t[r] >= 0 && t[r] < C), ValueError,
                 "cross_entropy: target {} at position {} is out of range for {} classes", t[r], r, C);
  }
  if (o.weight.defined()) return weighted_cross_entropy(input, f, o, red, acc_dt);
  // ---- forward: per-row loss from log-softmax (kept as probabilities for backward) ----
  Tensor probs = empty({R, C}, acc_dt);
  Tensor row_loss = empty({R}, acc_dt);
  int64_t count = 0;
  for (int64_t r = 0; r < R; ++r) count += t[r] != o.ignore_index;
  const double eps = o.label_smoothing;
  TANDEM_DISPATCH_FLOATING(input.dtype(), "cross_entropy", [&] {
    using T = scalar_t;
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* x = static_cast<const T*>(f.x.data_ptr());
    Acc* p = static_cast<Acc*>(probs.data_ptr());
    Acc* l = static_cast<Acc*>(row_loss.data_ptr());
    parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = x + r * C;
        Acc* pr = p + r * C;
        Acc m = -std::numeric_limits<Acc>::infinity();
        for (int64_t c = 0; c < C; ++c) m = std::max(m, static_cast<Acc>(xr[c]));
        Acc s = 0;
        for (int64_t c = 0; c < C; ++c) {
          pr[c] = std::exp(static_cast<Acc>(xr[c]) - m);
          s += pr[c];
        }
        const Acc lse = m + std::log(s), inv = Acc(1) / s;
        Acc sum_logp = 0;
        for (int64_t c = 0; c < C; ++c) {
          pr[c] *= inv;
          sum_logp += static_cast<Acc>(xr[c]) - lse;
        }
        if (t[r] == o.ignore_index) {
          l[r] = 0;
          continue;
        }
        const Acc nll = lse - static_cast<Acc>(xr[t[r]]);
        // (Without smoothing the sum of log-probabilities is not used: a class at -inf made it
        // -inf, and 0 * -inf = NaN where PyTorch's loss is finite.)
        l[r] = eps == 0 ? nll
                        : static_cast<Acc>(1.0 - eps) * nll - static_cast<Acc>(eps / static_cast<double>(C)) * sum_logp;
      }
    });
  });
  Tensor out;
  if (red == Reduction::none) {
    out = row_loss.reshape(f.loss_shape);
  } else {
    double total = 0;
    const std::vector<double> v = row_loss.to_vector();
    for (double x : v) total += x;
    out = scalar_tensor(red == Reduction::sum ? total : total / static_cast<double>(count), acc_dt);
  }
  // ---- backward: p - (1 - eps) * onehot(t) - eps / C, zero for ignored rows ----
  record("CrossEntropyBackward", {input}, {out},
         [probs, tgt = f.target, in_shape = input.shape(), in_dtype = input.dtype(), red, count, eps, ii = o.ignore_index,
          C, R](const G& g) {
           Tensor gx = empty({R, C}, probs.dtype());
           const Tensor gl = g[0].contiguous();
           const int64_t* t = tgt.data_ptr<int64_t>();
           auto run = [&](auto tag) {
             using A = decltype(tag);
             const A* p = static_cast<const A*>(probs.data_ptr());
             A* d = static_cast<A*>(gx.data_ptr());
             const double* gd = nullptr;
             std::vector<double> gv = gl.to_vector();
             gd = gv.data();
             const A off = static_cast<A>(eps / static_cast<double>(C)), on = static_cast<A>(1.0 - eps);
             for (int64_t r = 0; r < R; ++r) {
               A* dr = d + r * C;
               if (t[r] == ii) {
                 for (int64_t c = 0; c < C; ++c) dr[c] = 0;
                 continue;
               }
               const A scale = static_cast<A>(red == Reduction::none ? gd[r]
                                              : red == Reduction::sum ? gd[0]
                                                                      : gd[0] / static_cast<double>(count));
               const A* pr = p + r * C;
               for (int64_t c = 0; c < C; ++c) dr[c] = scale * (pr[c] - off);
               dr[t[r]] -= scale * on;
             }
           };
           if (probs.dtype() == kFloat64) run(double{});
           else run(float{});
           Tensor result;
           if (in_shape.size() <= 2) {
             result = gx.reshape(in_shape);
           } else {
             Shape moved{in_shape[0]};
             for (size_t d = 2; d < in_shape.size(); ++d) moved.push_back(in_shape[d]);
             moved.push_back(C);
             result = classes_second(gx.reshape(moved)).contiguous();
           }
           return G{result.to(in_dtype)};
         }, {f.target});
  return out;
}

Tensor nll_loss(const Tensor& input, const Tensor& target, const NllLossOptions& o) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::nll_loss, [](const auto&... args) { return nll_loss(args...); }, input, target, o);
  const Reduction red = parse_reduction(o.reduction, "nll_loss");
  Flat f = flatten_classes(input, target, "nll_loss");
  const int64_t R = f.x.size(0), C = f.x.size(1);
  const int64_t* t = f.target.data_ptr<int64_t>();
  const DType acc_dt = input.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor row_loss = empty({R}, acc_dt);
  int64_t count = 0;
  const std::vector<double> xv = f.x.to_vector();
  {
    std::vector<double> lv(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      TANDEM_CHECK(t[r] == o.ignore_index || (t[r] >= 0 && t[r] < C), ValueError,
                   "nll_loss: target {} at position {} is out of range for {} classes", t[r], r, C);
      lv[r] = t[r] == o.ignore_index ? 0.0 : -xv[static_cast<size_t>(r * C + t[r])];
      count += t[r] != o.ignore_index;
    }
    row_loss = tensor(lv, {R}, acc_dt);
  }
  Tensor out;
  if (red == Reduction::none) {
    out = row_loss.reshape(f.loss_shape);
  } else {
    double total = 0;
    for (double x : row_loss.to_vector()) total += x;
    out = scalar_tensor(red == Reduction::sum ? total : total / static_cast<double>(count), acc_dt);
  }
  record("NllLossBackward", {input}, {out},
         [tgt = f.target, in_shape = input.shape(), in_dtype = input.dtype(), red, count, ii = o.ignore_index, C, R](const G& g) {
           std::vector<double> gx(static_cast<size_t>(R * C), 0.0);
           const std::vector<double> gv = g[0].to_vector();
           const int64_t* t = tgt.data_ptr<int64_t>();
           for (int64_t r = 0; r < R; ++r) {
             if (t[r] == ii) continue;
             const double scale = red == Reduction::none ? gv[r] : red == Reduction::sum ? gv[0] : gv[0] / count;
             gx[static_cast<size_t>(r * C + t[r])] = -scale;
           }
           Tensor result = tensor(gx, {R, C}, in_dtype);
           if (in_shape.size() <= 2) return G{result.reshape(in_shape)};
           Shape moved{in_shape[0]};
           for (size_t d = 2; d < in_shape.size(); ++d) moved.push_back(in_shape[d]);
           moved.push_back(C);
           return G{classes_second(result.reshape(moved)).contiguous()};
         }, {f.target});
  return out;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, std::string_view reduction) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::mse_loss, [](const auto&... args) { return mse_loss(args...); }, input, target, reduction);
  const Reduction red = parse_reduction(reduction, "mse_loss");
  TANDEM_CHECK(input.shape() == target.shape(), ShapeError, "mse_loss: input shape {} and target shape {} differ",
               shape_str(input.shape()), shape_str(target.shape()));
  Tensor d = sub(input, target);
  Tensor sq = square(d);
  if (red == Reduction::none) return sq;
  return red == Reduction::sum ? sum(sq) : mean(sq);
}

}  // namespace tandem::ops
