// batch_norm, layer_norm and group_norm with their backward beside them.
//
// All three are written over one view of the data, (outer, C, inner): element (o, c, i) at
// o * C * inner + c * inner + i. An NCHW-contiguous tensor is (N, C, H*W); a channels-last one
// is (N*H*W, C, 1); layer_norm rows are (rows, 1, D). Statistics are taken per channel c
// (batch_norm) or per outer index (layer/group norm).
#include "tandem/ops/norm.h"

#include <algorithm>
#include <array>
#include <tuple>
#include <atomic>
#include <cmath>
#include <mutex>
#include <memory>
#include <vector>

#include "tandem/amp/policy.h"
#include "tandem/autograd/node.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/channel_math.h"
#include "tandem/kernels/cpu/conv.h"
#include "tandem/kernels/cpu/row_math.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

struct Layout {
  int64_t outer, C, inner;
};

// x (N, C, *) as (outer, C, inner), with x possibly replaced by a contiguous copy.
Layout channel_layout(Tensor& x) {
  const int64_t N = x.size(0), C = x.dim() > 1 ? x.size(1) : 1;
  const int64_t S = x.numel() / std::max<int64_t>(N * C, 1);
  if (x.dim() == 4 && !x.is_contiguous() && x.is_non_overlapping_and_dense() && x.stride(1) == 1) {
    const Shape cl = kernels::channels_last_strides(x.shape());
    bool channels_last = true;
    for (int d = 0; d < 4; ++d) channels_last &= x.size(d) == 1 || x.stride(d) == cl[d];
    if (channels_last) return {N * S, C, 1};
  }
  x = x.contiguous();
  return {N, C, S};
}

template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// ---- f64 (gradcheck): plain loops, f64 throughout ----

// Per-channel mean and biased variance in f64: a pass for the mean, then one for the squared
// deviations from it (no E[x^2] - E[x]^2 cancellation).
template <class T>
void channel_stats_f64(const T* x, const Layout& l, std::vector<double>& mean, std::vector<double>& var) {
  const double n = static_cast<double>(l.outer * l.inner);
  mean.assign(static_cast<size_t>(l.C), 0.0);
  var.assign(static_cast<size_t>(l.C), 0.0);
  for (int64_t o = 0; o < l.outer; ++o)
    for (int64_t c = 0; c < l.C; ++c)
      for (int64_t i = 0; i < l.inner; ++i) mean[c] += static_cast<double>(x[(o * l.C + c) * l.inner + i]);
  for (auto& m : mean) m /= n;
  for (int64_t o = 0; o < l.outer; ++o)
    for (int64_t c = 0; c < l.C; ++c)
      for (int64_t i = 0; i < l.inner; ++i) {
        const double d = static_cast<double>(x[(o * l.C + c) * l.inner + i]) - mean[c];
        var[c] += d * d;
      }
  for (auto& v : var) v /= n;
}

// ---- f32, bf16, f16: blocks through the vectorised kernels of channel_math.h ----

// The view in blocks: 64 whole rows of a channels-last (outer, C) view, or runs of up to 256
// elements of one channel of an NCHW view. Sums are taken in f32 within a block and folded into
// f64 after it, so long channels keep their precision.
struct Blocks {
  const Layout& l;
  static constexpr int64_t kRows = 64, kRun = 256;
  int64_t per_channel() const { return (l.inner + kRun - 1) / kRun; }
  int64_t count() const { return l.inner == 1 ? (l.outer + kRows - 1) / kRows : l.outer * l.C * per_channel(); }
  int64_t max_elems() const { return l.inner == 1 ? kRows * l.C : kRun; }
  // Block b: first element index, rows (run length), columns (C or 1), first channel.
  struct Block {
    int64_t base, rows, cols, c;
  };
  Block operator[](int64_t b) const {
    if (l.inner == 1) {
      const int64_t m0 = b * kRows;
      return {m0 * l.C, std::min(kRows, l.outer - m0), l.C, 0};
    }
    const int64_t pc = per_channel(), oc = b / pc, i0 = (b % pc) * kRun;
    return {oc * l.inner + i0, std::min(kRun, l.inner - i0), 1, oc % l.C};
  }
};

// What the kernels read for an input stored as T: f32 and bf16 as they are (a bf16 input is
// widened in the kernels' registers), f16 through an f32 copy of each block.
template <class T>
using KernelIn = std::conditional_t<std::is_same_v<T, bfloat16>, bfloat16, float>;

// p[base, base + n) as the kernels read it: the memory itself, or an f16 block widened into scratch.
template <class T>
const KernelIn<T>* kernel_in(const T* p, int64_t base, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, KernelIn<T>>) {
    return p + base;
  } else {
    convert(p + base, dtype_of<T>::value, scratch.data(), kFloat32, n);
    return scratch.data();
  }
}

// Visits every block on the calling thread with its inputs as the kernels read them;
// fn(block, const KernelIn<T>*...).
template <class T, class F, class... P>
void visit_blocks(const Layout& l, F fn, const P*... ins) {
  const Blocks bl{l};
  std::array<std::vector<float>, sizeof...(P)> scratch;
  if constexpr (!std::is_same_v<T, KernelIn<T>>)
    for (auto& s : scratch) s.resize(static_cast<size_t>(bl.max_elems()));
  const int64_t nb = bl.count();
  for (int64_t b = 0; b < nb; ++b) {
    const Blocks::Block k = bl[b];
    const int64_t n = k.rows * k.cols;
    size_t j = 0;  // a braced list evaluates left to right: input i gets scratch i
    const std::array<const KernelIn<T>*, sizeof...(P)> f{kernel_in<T>(ins, k.base, n, scratch[j++])...};
    std::apply([&](auto... fp) { fn(k, fp...); }, f);
  }
}

// Per-channel mean and biased variance: a pass for the mean, then one for the squared deviations
// from it (no E[x^2] - E[x]^2 cancellation).
template <class T>
void channel_stats(const T* x, const Layout& l, std::vector<double>& mean, std::vector<double>& var) {
  const double n = static_cast<double>(l.outer * l.inner);
  const int64_t C = l.C;
  mean.assign(static_cast<size_t>(C), 0.0);
  var.assign(static_cast<size_t>(C), 0.0);
  std::vector<float> part(static_cast<size_t>(C)), mf(static_cast<size_t>(C));
  auto fold = [&](const Blocks::Block& k, std::vector<double>& into) {
    for (int64_t c = 0; c < k.cols; ++c) {
      into[k.c + c] += part[k.c + c];
      part[k.c + c] = 0.0f;
    }
  };
  visit_blocks<T>(l, [&](const Blocks::Block& k, const KernelIn<T>* xb) {
    kernels::channel_sum(xb, k.rows, k.cols, part.data() + k.c);
    fold(k, mean);
  }, x);
  for (int64_t c = 0; c < C; ++c) {
    mean[c] /= n;
    mf[c] = static_cast<float>(mean[c]);
  }
  visit_blocks<T>(l, [&](const Blocks::Block& k, const KernelIn<T>* xb) {
    kernels::channel_sum_sq_dev(xb, k.rows, k.cols, mf.data() + k.c, part.data() + k.c);
    fold(k, var);
  }, x);
  for (auto& v : var) v /= n;
}

// out = act(ku[c] * u' + kv[c] * v + k0[c]) over the whole view (see kernels::channel_affine),
// blocks spread over threads; 16-bit outputs rounded once from f32.
template <class T>
void channel_affine(const Layout& l, T* out, const T* u, const T* y, const T* v, const std::vector<float>& ku,
                    const std::vector<float>& kv, const std::vector<float>& k0, bool relu) {
  const Blocks bl{l};
  parallel_for(0, bl.count(), std::max<int64_t>(1, 16384 / bl.max_elems()), [&](int64_t lo, int64_t hi) {
    // Scratch: f32 blocks of f16 inputs, and of any 16-bit output before its rounding.
    const size_t m = static_cast<size_t>(bl.max_elems());
    std::vector<float> su, sy, sv, so;
    if constexpr (!std::is_same_v<T, KernelIn<T>>) {
      su.resize(m);
      if (y) sy.resize(m);
      if (v) sv.resize(m);
    }
    if constexpr (!std::is_same_v<T, float>) so.resize(m);
    for (int64_t b = lo; b < hi; ++b) {
      const Blocks::Block k = bl[b];
      const int64_t n = k.rows * k.cols;
      const KernelIn<T>* fu = kernel_in<T>(u, k.base, n, su);
      const KernelIn<T>* fy = y ? kernel_in<T>(y, k.base, n, sy) : nullptr;
      const KernelIn<T>* fv = v ? kernel_in<T>(v, k.base, n, sv) : nullptr;
      float* fo;
      if constexpr (std::is_same_v<T, float>) fo = out + k.base;
      else fo = so.data();
      kernels::channel_affine(fo, fu, fy, fv, k.rows, k.cols, ku.data() + k.c, kv.data() + k.c, k0.data() + k.c,
                              relu);
      if constexpr (!std::is_same_v<T, float>) convert(fo, kFloat32, out + k.base, dtype_of<T>::value, n);
    }
  });
}

std::vector<double> values_or(const Tensor& t, int64_t n, double fill) {
  return t.defined() ? t.to_vector() : std::vector<double>(static_cast<size_t>(n), fill);
}

void check_param(const Tensor& t, int64_t C, const char* what, const char* op) {
  if (!t.defined()) return;
  TANDEM_CHECK(t.numel() == C, ShapeError, "{}: {} has {} elements, expected {} (one per channel)", op, what, t.numel(), C);
}

}  // namespace

namespace {

// batch_norm, and with relu also the ReLU after it in the same passes: forward writes
// max(0, y) directly; backward masks the incoming gradient with (output > 0) inside the
// per-channel sums and the final affine pass, so neither the ReLU's output nor its gradient is
// ever a tensor of its own.
// group (SyncBatchNorm, training only): the statistics and the backward sums are the group's.
Tensor batch_norm_impl(const Tensor& x_in, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, bool training, double momentum, double eps, bool relu,
                       std::shared_ptr<const BatchNormGroupStats> group = nullptr) {
  TANDEM_CHECK(x_in.dim() >= 2, ShapeError, "batch_norm: expected an input of shape (N, C, *), got {}",
               shape_str(x_in.shape()));
  TANDEM_CHECK(is_floating(x_in.dtype()), DTypeError, "batch_norm: expected a floating input, got {}",
               dtype_name(x_in.dtype()));
  const int64_t C = x_in.size(1);
  check_param(weight, C, "weight", "batch_norm");
  check_param(bias, C, "bias", "batch_norm");
  check_param(running_mean, C, "running_mean", "batch_norm");
  check_param(running_var, C, "running_var", "batch_norm");
  TANDEM_CHECK(training || (running_mean.defined() && running_var.defined()), ValueError,
               "batch_norm: evaluation mode needs running_mean and running_var");
  Tensor x = x_in.detach();
  const Layout l = channel_layout(x);
  const int64_t count = l.outer * l.inner;
  // (Over a group the group's count decides: its stats hook checks it.)
  TANDEM_CHECK(!training || group != nullptr || count != 1, ValueError,
               "batch_norm: expected more than 1 value per channel when training, got input of shape {}",
               shape_str(x_in.shape()));
  // An empty batch (N = 0, or an empty spatial dim; over a group: on every rank), as PyTorch: an
  // empty output, the running stats untouched (no NaN mean of nothing), zero gradients for weight
  // and bias.
  auto empty_batch = [&] {
    Tensor y = empty_like(x);
    record(relu ? "BatchNormReluBackward" : "BatchNormBackward", {x_in, weight, bias}, {y},
           [shape = x.shape(), dt = x.dtype(), C, has_w = weight.defined(), has_b = bias.defined(),
            wdt = weight.defined() ? weight.dtype() : kFloat32, bdt = bias.defined() ? bias.dtype() : kFloat32](const G&) {
             return G{zeros(shape, dt), has_w ? zeros({C}, wdt) : Tensor(), has_b ? zeros({C}, bdt) : Tensor()};
           });
    return y;
  };
  if (count == 0 && group == nullptr) return empty_batch();
  // ---- statistics ----
  std::vector<double> mean, var;
  double total = static_cast<double>(count);  // values per channel behind the statistics
  if (training) {
    if (count > 0) {
      TANDEM_DISPATCH_FLOATING(x.dtype(), "batch_norm", [&] {
        using T = scalar_t;
        if constexpr (std::is_same_v<T, double>) channel_stats_f64(static_cast<const T*>(x.data_ptr()), l, mean, var);
        else channel_stats(static_cast<const T*>(x.data_ptr()), l, mean, var);
      });
    } else {  // an empty share of a group's batch
      mean.assign(static_cast<size_t>(C), 0.0);
      var.assign(static_cast<size_t>(C), 0.0);
    }
    if (group != nullptr) {
      group->stats(total, mean, var);
      // Every rank's batch is empty (each rank sees the same total, so all take this path and
      // none issues the backward all-reduce).
      if (total == 0) return empty_batch();
    }
    if (running_mean.defined() && running_var.defined()) {
      NoGradGuard no_grad;
      const double unbias = total / (total - 1);
      std::vector<double> rm = running_mean.to_vector(), rv = running_var.to_vector();
      for (int64_t c = 0; c < C; ++c) {
        rm[c] = (1 - momentum) * rm[c] + momentum * mean[c];
        rv[c] = (1 - momentum) * rv[c] + momentum * var[c] * unbias;
      }
      Tensor rmt = running_mean, rvt = running_var;
      rmt.copy_(tensor(rm, running_mean.shape(), kFloat64));
      rvt.copy_(tensor(rv, running_var.shape(), kFloat64));
    }
  } else {
    mean = running_mean.to_vector();
    var = running_var.to_vector();
  }
  std::vector<double> invstd(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) invstd[c] = 1.0 / std::sqrt(var[c] + eps);
  const std::vector<double> w = values_or(weight, C, 1.0), b = values_or(bias, C, 0.0);
  // ---- y = (x - mean) * invstd * w + b, as y = x * scale + shift per channel ----
  Tensor y = empty_like(x);
  TANDEM_DISPATCH_FLOATING(x.dtype(), "batch_norm", [&] {
    using T = scalar_t;
    std::vector<float> scale(static_cast<size_t>(C)), shift(static_cast<size_t>(C)), none(static_cast<size_t>(C), 0.0f);
    for (int64_t c = 0; c < C; ++c) {
      scale[c] = static_cast<float>(invstd[c] * w[c]);
      shift[c] = static_cast<float>(b[c] - mean[c] * invstd[c] * w[c]);
    }
    const T* px = static_cast<const T*>(x.data_ptr());
    if constexpr (std::is_same_v<T, double>) {
      T* py = static_cast<T*>(y.data_ptr());
      for (int64_t o = 0; o < l.outer; ++o)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < l.inner; ++i) {
            const int64_t k = (o * C + c) * l.inner + i;
            py[k] = (px[k] - mean[c]) * invstd[c] * w[c] + b[c];
            if (relu && py[k] <= 0) py[k] = 0;  // NaN passes, as PyTorch's relu
          }
    } else {
      channel_affine<T>(l, static_cast<T*>(y.data_ptr()), px, nullptr, nullptr, scale, none, shift, relu);
    }
  });
  std::vector<Tensor> inputs{x_in, weight, bias};
  // Without a gradient for x (a SyncBatchNorm applied to data, say), backward computes only the
  // weight's and bias's, this rank's own sums: no input gradient and, over a group, no all-reduce
  // (torch's SyncBatchNorm issues it only when the input needs a gradient).
  const bool need_gx = x_in.requires_grad();
  record(relu ? "BatchNormReluBackward" : "BatchNormBackward", inputs, {y},
         [x, l, mean, invstd, w, training, total, need_gx, grp = group, has_w = weight.defined(), has_b = bias.defined(), wdt = weight.defined() ? weight.dtype() : kFloat32,
          bdt = bias.defined() ? bias.dtype() : kFloat32, out = relu ? y.detach() : Tensor()](const G& g) {
           Tensor gy = g[0];
           if (gy.strides() != x.strides()) {
             Tensor same = empty_strided(x.shape(), x.strides(), gy.dtype());
             same.copy_(gy);
             gy = same;
           }
           gy = gy.to(x.dtype());
           const int64_t C = l.C;
           const double n = total;
           std::vector<double> sum_dy, sum_dy_xc;
           std::vector<double> own_dy, own_dy_xc;  // over a group: this process's sums (weight and bias)
           Tensor gx = need_gx ? empty_like(x) : Tensor();
           TANDEM_DISPATCH_FLOATING(x.dtype(), "batch_norm backward", [&] {
             using T = scalar_t;
             const T* px = static_cast<const T*>(x.data_ptr());
             const T* pg = static_cast<const T*>(gy.data_ptr());
             // The fused ReLU's mask: the gradient counts only where the output was positive.
             const T* pm = out.defined() ? static_cast<const T*>(out.data_ptr()) : nullptr;
             if constexpr (std::is_same_v<T, double>) {
               // f64 (gradcheck) accumulates in f64 throughout.
               sum_dy.assign(static_cast<size_t>(C), 0.0);
               sum_dy_xc.assign(static_cast<size_t>(C), 0.0);
               for (int64_t o = 0; o < l.outer; ++o)
                 for (int64_t c = 0; c < C; ++c)
                   for (int64_t i = 0; i < l.inner; ++i) {
                     const int64_t k = (o * C + c) * l.inner + i;
                     const double gk = pm && static_cast<double>(pm[k]) <= 0 ? 0.0 : static_cast<double>(pg[k]);
                     sum_dy[c] += gk;
                     sum_dy_xc[c] += gk * (px[k] - mean[c]);
                   }
             } else {
               // Per-channel sums of g' and g' * (x - mean), g' the (ReLU-masked) gradient.
               sum_dy.assign(static_cast<size_t>(C), 0.0);
               sum_dy_xc.assign(static_cast<size_t>(C), 0.0);
               std::vector<float> pa(static_cast<size_t>(C), 0.0f), pb(static_cast<size_t>(C), 0.0f),
                   mf(mean.begin(), mean.end());
               auto fold = [&](const Blocks::Block& k) {
                 for (int64_t c = k.c; c < k.c + k.cols; ++c) {
                   sum_dy[c] += pa[c];
                   sum_dy_xc[c] += pb[c];
                   pa[c] = pb[c] = 0.0f;
                 }
               };
               if (pm) {
                 visit_blocks<T>(l, [&](const Blocks::Block& k, const KernelIn<T>* gb, const KernelIn<T>* yb, const KernelIn<T>* xb) {
                   kernels::channel_sum_grad(gb, yb, xb, k.rows, k.cols, mf.data() + k.c, pa.data() + k.c, pb.data() + k.c);
                   fold(k);
                 }, pg, pm, px);
               } else {
                 visit_blocks<T>(l, [&](const Blocks::Block& k, const KernelIn<T>* gb, const KernelIn<T>* xb) {
                   kernels::channel_sum_grad(gb, static_cast<const KernelIn<T>*>(nullptr), xb, k.rows, k.cols, mf.data() + k.c, pa.data() + k.c, pb.data() + k.c);
                   fold(k);
                 }, pg, px);
               }
             }
             if (!need_gx) return;
             if (grp) {
               own_dy = sum_dy;
               own_dy_xc = sum_dy_xc;
               grp->grad_sums(sum_dy, sum_dy_xc);
             }
             // Training: gx = a * (gy - mean(gy) - xhat * mean(gy * xhat)), a = w * invstd; eval: a * gy.
             // Written as gx = k_gy * gy + k_x * x + k_0 per channel.
             std::vector<double> k_gy(static_cast<size_t>(C)), k_x(static_cast<size_t>(C)), k_0(static_cast<size_t>(C));
             for (int64_t c = 0; c < C; ++c) {
               const double a = w[c] * invstd[c];
               k_gy[c] = a;
               if (training) {
                 const double m_dy = sum_dy[c] / n, m_dyx = sum_dy_xc[c] * invstd[c] / n;
                 k_x[c] = -a * invstd[c] * m_dyx;
                 k_0[c] = -a * m_dy + a * invstd[c] * m_dyx * mean[c];
               } else {
                 k_x[c] = 0;
                 k_0[c] = 0;
               }
             }
             T* po = static_cast<T*>(gx.data_ptr());
             if constexpr (std::is_same_v<T, double>) {
               for (int64_t o = 0; o < l.outer; ++o)
                 for (int64_t c = 0; c < C; ++c)
                   for (int64_t i = 0; i < l.inner; ++i) {
                     const int64_t k = (o * C + c) * l.inner + i;
                     const double gk = pm && static_cast<double>(pm[k]) <= 0 ? 0.0 : static_cast<double>(pg[k]);
                     po[k] = k_gy[c] * gk + k_x[c] * px[k] + k_0[c];
                   }
             } else {
               const std::vector<float> fg(k_gy.begin(), k_gy.end()), fx(k_x.begin(), k_x.end()), f0(k_0.begin(), k_0.end());
               channel_affine<T>(l, po, pg, pm, px, fg, fx, f0, false);
             }
           });
           const std::vector<double>& dy_sums = grp && need_gx ? own_dy : sum_dy;
           const std::vector<double>& dy_xc_sums = grp && need_gx ? own_dy_xc : sum_dy_xc;
           std::vector<double> sum_dy_xhat(static_cast<size_t>(C));
           for (int64_t c = 0; c < C; ++c) sum_dy_xhat[c] = dy_xc_sums[c] * invstd[c];
           Tensor gw = has_w ? tensor(sum_dy_xhat, {C}, wdt) : Tensor();
           Tensor gb = has_b ? tensor(dy_sums, {C}, bdt) : Tensor();
           return G{gx, gw, gb};
         }, {x, relu ? y : Tensor()});
  return y;
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  return batch_norm_impl(x, running_mean, running_var, weight, bias, training, momentum, eps, false);
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, bool training, double momentum, double eps) {
  return batch_norm_impl(x, running_mean, running_var, weight, bias, training, momentum, eps, true);
}

Tensor batch_norm_over_group(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, double momentum, double eps, bool relu,
                             std::shared_ptr<const BatchNormGroupStats> group) {
  TANDEM_CHECK(group && group->stats && group->grad_sums, ValueError,
               "batch_norm_over_group: both group hooks must be set");
  return batch_norm_impl(x, running_mean, running_var, weight, bias, /*training=*/true, momentum, eps, relu,
                         std::move(group));
}

namespace {

// Row statistics and normalisation shared by layer_norm and group_norm: x viewed as rows of
// length D; row r's affine parameter for element j is w[chan(r, j)].
struct RowNorm {
  int64_t rows, D;
  Tensor x;                         // contiguous input
  std::vector<double> mean, rstd;   // per row
};

template <class T>
void row_stats(const T* x, int64_t rows, int64_t D, double eps, std::vector<double>& mean, std::vector<double>& rstd) {
  mean.resize(static_cast<size_t>(rows));
  rstd.resize(static_cast<size_t>(rows));
  parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>) {  // vectorised row kernel, same two-pass formula
      for (int64_t r = lo; r < hi; ++r) kernels::row_moments_f32(x + r * D, D, eps, mean[r], rstd[r]);
      return;
    }
    for (int64_t r = lo; r < hi; ++r) {
      // Partial sums in the input's accumulation type (f32 for f32/bf16/f16, vectorised) over
      // blocks of 256, gathered in f64.
      using P = Acc<T>;
      const T* p = x + r * D;
      double s = 0;
      for (int64_t j0 = 0; j0 < D; j0 += 256) {
        const int64_t j1 = std::min(D, j0 + 256);
        P b = 0;
#pragma omp simd reduction(+ : b)
        for (int64_t j = j0; j < j1; ++j) b += static_cast<P>(static_cast<compute_t<T>>(p[j]));
        s += b;
      }
      const double m = s / static_cast<double>(D);
      const P mp = static_cast<P>(m);
      double v = 0;
      for (int64_t j0 = 0; j0 < D; j0 += 256) {
        const int64_t j1 = std::min(D, j0 + 256);
        P b = 0;
#pragma omp simd reduction(+ : b)
        for (int64_t j = j0; j < j1; ++j) {
          const P d = static_cast<P>(static_cast<compute_t<T>>(p[j])) - mp;
          b += d * d;
        }
        v += b;
      }
      mean[r] = m;
      rstd[r] = 1.0 / std::sqrt(v / static_cast<double>(D) + eps);
    }
  });
}

// chan(r, j): index into w/b for row r, element j. `per_elem` (layer_norm): j; group_norm:
// channel = (r % G) * Cg + j / S.
struct AffineIndex {
  bool layer;  // layer_norm: index j
  int64_t G = 1, Cg = 1, S = 1;
  int64_t operator()(int64_t r, int64_t j) const { return layer ? j : (r % G) * Cg + j / S; }
};

Tensor row_norm_forward(const RowNorm& rn, const std::vector<double>& w, const std::vector<double>& b, const AffineIndex& ix,
                        const Shape& shape) {
  Tensor y = empty(shape, rn.x.dtype());
  if (ix.layer && rn.x.dtype() == kFloat32) {  // layer_norm in f32: the vectorised row kernel
    const std::vector<float> wf(w.begin(), w.end()), bf(b.begin(), b.end());
    const float* px = rn.x.data_ptr<float>();
    float* py = y.data_ptr<float>();
    parallel_for(0, rn.rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(rn.D, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        kernels::layer_norm_row_f32(px + r * rn.D, py + r * rn.D, rn.D, static_cast<float>(rn.mean[r]),
                                    static_cast<float>(rn.rstd[r]), wf.data(), bf.data());
    });
    return y;
  }
  TANDEM_DISPATCH_FLOATING(rn.x.dtype(), "layer_norm", [&] {
    using T = scalar_t;
    using A = Acc<T>;
    const T* px = static_cast<const T*>(rn.x.data_ptr());
    T* py = static_cast<T*>(y.data_ptr());
    std::vector<A> wa(w.begin(), w.end()), ba(b.begin(), b.end());
    parallel_for(0, rn.rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(rn.D, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const A m = static_cast<A>(rn.mean[r]), s = static_cast<A>(rn.rstd[r]);
        const T* p = px + r * rn.D;
        T* q = py + r * rn.D;
        if (ix.layer) {
          for (int64_t j = 0; j < rn.D; ++j) q[j] = static_cast<T>((static_cast<A>(p[j]) - m) * s * wa[j] + ba[j]);
        } else {
          for (int64_t j = 0; j < rn.D; ++j) {
            const int64_t c = ix(r, j);
            q[j] = static_cast<T>((static_cast<A>(p[j]) - m) * s * wa[c] + ba[c]);
          }
        }
      }
    });
  });
  return y;
}

// gx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = gy * w;
// gw[c] += gy * xhat, gb[c] += gy.
G row_norm_backward(const RowNorm& rn, const Tensor& gy_in, const std::vector<double>& w, const AffineIndex& ix,
                    int64_t nparams, bool need_w, bool need_b, DType wdt, DType bdt, const Shape& shape) {
  const Tensor gy = gy_in.to(rn.x.dtype()).contiguous();
  Tensor gx = empty(shape, rn.x.dtype());
  std::vector<double> gw(static_cast<size_t>(nparams), 0.0), gb(static_cast<size_t>(nparams), 0.0);
  if (ix.layer && rn.x.dtype() == kFloat32) {
    // layer_norm in f32: vectorised rows; gw, gb summed in f32 over blocks of kFlush rows, the
    // blocks gathered in f64 (as the generic path's per-element f64 sums, to f32 rounding).
    constexpr int64_t kFlush = 32;
    const std::vector<float> wf(w.begin(), w.end());
    const float* px = rn.x.data_ptr<float>();
    const float* pg = gy.data_ptr<float>();
    float* po = gx.data_ptr<float>();
    std::mutex mu;
    struct Part {
      int64_t lo;
      std::vector<double> dw, db;
    };
    std::vector<Part> parts;
    parallel_for(0, rn.rows, std::max<int64_t>(kFlush, 8192 / std::max<int64_t>(rn.D, 1)), [&](int64_t lo, int64_t hi) {
      std::vector<float> pw(static_cast<size_t>(rn.D)), pb(static_cast<size_t>(rn.D));
      std::vector<double> dw(static_cast<size_t>(rn.D), 0.0), db(static_cast<size_t>(rn.D), 0.0);
      for (int64_t r0 = lo; r0 < hi; r0 += kFlush) {
        std::fill(pw.begin(), pw.end(), 0.0f);
        std::fill(pb.begin(), pb.end(), 0.0f);
        for (int64_t r = r0; r < std::min(hi, r0 + kFlush); ++r)
          kernels::layer_norm_backward_row_f32(px + r * rn.D, pg + r * rn.D, po + r * rn.D, rn.D,
                                               static_cast<float>(rn.mean[r]), static_cast<float>(rn.rstd[r]), wf.data(),
                                               pw.data(), pb.data());
        for (int64_t j = 0; j < rn.D; ++j) {
          dw[j] += pw[j];
          db[j] += pb[j];
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      parts.push_back({lo, std::move(dw), std::move(db)});
    });
    // Chunks summed in row order, so the result does not depend on thread timing.
    std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.lo < b.lo; });
    for (const Part& part : parts)
      for (int64_t j = 0; j < rn.D; ++j) {
        gw[j] += part.dw[j];
        gb[j] += part.db[j];
      }
    return G{gx, need_w ? tensor(gw, {nparams}, wdt) : Tensor(), need_b ? tensor(gb, {nparams}, bdt) : Tensor()};
  }
  TANDEM_DISPATCH_FLOATING(rn.x.dtype(), "layer_norm backward", [&] {
    using T = scalar_t;
    using A = Acc<T>;
    const T* px = static_cast<const T*>(rn.x.data_ptr());
    const T* pg = static_cast<const T*>(gy.data_ptr());
    T* po = static_cast<T*>(gx.data_ptr());
    const int nthreads = get_num_threads();
    std::vector<std::vector<double>> gw_part(static_cast<size_t>(nthreads)), gb_part(static_cast<size_t>(nthreads));
    std::atomic<int> next_slot{0};
    parallel_for(0, rn.rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(rn.D, 1)), [&](int64_t lo, int64_t hi) {
      const int slot = next_slot++;
      auto& pw = gw_part[static_cast<size_t>(slot)];
      auto& pb = gb_part[static_cast<size_t>(slot)];
      pw.assign(static_cast<size_t>(nparams), 0.0);
      pb.assign(static_cast<size_t>(nparams), 0.0);
      std::vector<A> xhat(static_cast<size_t>(rn.D)), dxhat(static_cast<size_t>(rn.D));
      for (int64_t r = lo; r < hi; ++r) {
        const A m = static_cast<A>(rn.mean[r]), s = static_cast<A>(rn.rstd[r]);
        const T* p = px + r * rn.D;
        const T* g = pg + r * rn.D;
        A sum1 = 0, sum2 = 0;
        for (int64_t j = 0; j < rn.D; ++j) {
          const int64_t c = ix(r, j);
          const A gv = static_cast<A>(g[j]);
          xhat[j] = (static_cast<A>(p[j]) - m) * s;
          dxhat[j] = gv * static_cast<A>(w[c]);
          sum1 += dxhat[j];
          sum2 += dxhat[j] * xhat[j];
          pw[c] += static_cast<double>(gv * xhat[j]);
          pb[c] += static_cast<double>(gv);
        }
        const A inv_d = A(1) / static_cast<A>(rn.D);
        sum1 *= inv_d;
        sum2 *= inv_d;
        T* q = po + r * rn.D;
        for (int64_t j = 0; j < rn.D; ++j) q[j] = static_cast<T>(s * (dxhat[j] - sum1 - xhat[j] * sum2));
      }
    });
    for (int t = 0; t < next_slot.load(); ++t)
      for (int64_t c = 0; c < nparams; ++c) {
        gw[c] += gw_part[t][c];
        gb[c] += gb_part[t][c];
      }
  });
  return G{gx, need_w ? tensor(gw, {nparams}, wdt) : Tensor(), need_b ? tensor(gb, {nparams}, bdt) : Tensor()};
}

}  // namespace

Tensor layer_norm(const Tensor& x_in, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias, double eps) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::layer_norm, [](const auto&... args) { return layer_norm(args...); }, x_in, normalized_shape, weight, bias, eps);
  TANDEM_CHECK(is_floating(x_in.dtype()), DTypeError, "layer_norm: expected a floating input, got {}",
               dtype_name(x_in.dtype()));
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  bool ok = k >= 1 && k <= x_in.dim();
  for (int64_t i = 0; ok && i < k; ++i) ok = x_in.size(x_in.dim() - k + i) == normalized_shape[i];
  TANDEM_CHECK(ok, ShapeError, "layer_norm: normalized_shape {} does not match the trailing dims of input {}",
               shape_str(normalized_shape), shape_str(x_in.shape()));
  if (weight.defined())
    TANDEM_CHECK(weight.shape() == normalized_shape, ShapeError, "layer_norm: weight of shape {} for normalized_shape {}",
                 shape_str(weight.shape()), shape_str(normalized_shape));
  if (bias.defined())
    TANDEM_CHECK(bias.shape() == normalized_shape, ShapeError, "layer_norm: bias of shape {} for normalized_shape {}",
                 shape_str(bias.shape()), shape_str(normalized_shape));
  RowNorm rn;
  rn.D = shape_numel(normalized_shape);
  rn.rows = x_in.numel() / std::max<int64_t>(rn.D, 1);
  rn.x = x_in.detach().contiguous();
  TANDEM_DISPATCH_FLOATING(rn.x.dtype(), "layer_norm", [&] {
    row_stats(static_cast<const scalar_t*>(rn.x.data_ptr()), rn.rows, rn.D, eps, rn.mean, rn.rstd);
  });
  const std::vector<double> w = values_or(weight, rn.D, 1.0), b = values_or(bias, rn.D, 0.0);
  const AffineIndex ix{true};
  Tensor y = row_norm_forward(rn, w, b, ix, x_in.shape());
  record("LayerNormBackward", {x_in, weight, bias}, {y},
         [rn, w, ix, need_w = weight.defined() && weight.requires_grad(), need_b = bias.defined() && bias.requires_grad(),
          wdt = weight.defined() ? weight.dtype() : kFloat32, bdt = bias.defined() ? bias.dtype() : kFloat32,
          shape = x_in.shape(), nshape = normalized_shape](const G& g) {
           G r = row_norm_backward(rn, g[0], w, ix, rn.D, need_w, need_b, wdt, bdt, shape);
           if (r[1].defined()) r[1] = r[1].reshape(nshape);
           if (r[2].defined()) r[2] = r[2].reshape(nshape);
           return r;
         }, {rn.x});
  return y;
}

Tensor group_norm(const Tensor& x_in, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::group_norm, [](const auto&... args) { return group_norm(args...); }, x_in, num_groups, weight, bias, eps);
  TANDEM_CHECK(x_in.dim() >= 2, ShapeError, "group_norm: expected an input of shape (N, C, *), got {}",
               shape_str(x_in.shape()));
  TANDEM_CHECK(is_floating(x_in.dtype()), DTypeError, "group_norm: expected a floating input, got {}",
               dtype_name(x_in.dtype()));
  const int64_t N = x_in.size(0), C = x_in.size(1);
  TANDEM_CHECK(num_groups >= 1 && C % num_groups == 0, ValueError,
               "group_norm: num_groups={} must divide the number of channels {}", num_groups, C);
  check_param(weight, C, "weight", "group_norm");
  check_param(bias, C, "bias", "group_norm");
  RowNorm rn;
  const int64_t S = x_in.numel() / std::max<int64_t>(N * C, 1);
  rn.rows = N * num_groups;
  rn.D = (C / num_groups) * S;
  rn.x = x_in.detach().contiguous();
  TANDEM_DISPATCH_FLOATING(rn.x.dtype(), "group_norm", [&] {
    row_stats(static_cast<const scalar_t*>(rn.x.data_ptr()), rn.rows, rn.D, eps, rn.mean, rn.rstd);
  });
  const std::vector<double> w = values_or(weight, C, 1.0), b = values_or(bias, C, 0.0);
  const AffineIndex ix{false, num_groups, C / num_groups, S};
  Tensor y = row_norm_forward(rn, w, b, ix, x_in.shape());
  record("GroupNormBackward", {x_in, weight, bias}, {y},
         [rn, w, ix, C, need_w = weight.defined() && weight.requires_grad(), need_b = bias.defined() && bias.requires_grad(),
          wdt = weight.defined() ? weight.dtype() : kFloat32, bdt = bias.defined() ? bias.dtype() : kFloat32,
          shape = x_in.shape()](const G& g) { return row_norm_backward(rn, g[0], w, ix, C, need_w, need_b, wdt, bdt, shape); },
         {rn.x});
  return y;
}

}  // namespace tandem::ops
