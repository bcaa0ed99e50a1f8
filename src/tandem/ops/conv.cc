// conv2d and the pools, with their backward beside them.
#include "tandem/ops/conv.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/amp/policy.h"
#include "tandem/autograd/node.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/conv.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dOptions& o) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::conv2d, [](const auto&... args) { return conv2d(args...); }, x, weight, bias, o);
  const kernels::Conv2dParams p{o.stride, o.padding, o.dilation, o.groups};
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "conv2d: expected a floating input, got {}", dtype_name(x.dtype()));
  Tensor y = kernels::conv2d_forward(x.detach(), weight.detach(), bias.defined() ? bias.detach() : bias, p);
  std::vector<Tensor> inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  record("Conv2dBackward", inputs, {y},
         [x = x.detach(), w = weight.detach(), p, has_bias = bias.defined(), rx = x.requires_grad(),
          rw = weight.requires_grad() || (bias.defined() && bias.requires_grad())](const G& g) {
           G grads(has_bias ? 3 : 2);
           if (rx) grads[0] = kernels::conv2d_backward_input(g[0], w, x.shape(), p);
           if (rw) {
             auto [gw, gb] = kernels::conv2d_backward_weight(g[0], x, w.shape(), has_bias, p);
             grads[1] = gw;
             if (has_bias) grads[2] = gb;
           }
           return grads;
         },
         {weight.requires_grad() || (bias.defined() && bias.requires_grad()) ? x : Tensor(),
          x.requires_grad() ? weight : Tensor()});
  return y;
}

namespace {

struct Window {
  int64_t N, C, H, W, OH, OW;
  std::array<int64_t, 2> k, s, pad, dil;
};

int64_t pooled_size(int64_t in, int64_t k, int64_t s, int64_t pad, int64_t dil, bool ceil_mode) {
  const int64_t span = dil * (k - 1) + 1;
  const int64_t num = in + 2 * pad - span;
  if (num < 0) return 0;  // the window does not fit (C++ would truncate e.g. -1 / 2 to 0, one output)
  int64_t out = (ceil_mode ? (num + s - 1) / s : num / s) + 1;
  // PyTorch: the last window must start inside the input or the left padding.
  if (ceil_mode && (out - 1) * s >= in + pad) --out;
  return out;
}

Window make_window(const Tensor& x, const Pool2dOptions& o, const char* op, bool with_dilation) {
  TANDEM_CHECK(x.dim() == 4, ShapeError, "{}: expected a 4-d input (N, C, H, W), got {}", op, shape_str(x.shape()));
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "{}: expected a floating input, got {}", op, dtype_name(x.dtype()));
  Window w;
  w.N = x.size(0), w.C = x.size(1), w.H = x.size(2), w.W = x.size(3);
  for (int i = 0; i < 2; ++i) {
    w.k[i] = o.kernel_size[i];
    w.s[i] = o.stride[i] == 0 ? o.kernel_size[i] : o.stride[i];
    w.pad[i] = o.padding[i];
    w.dil[i] = with_dilation ? o.dilation[i] : 1;
    TANDEM_CHECK(w.k[i] >= 1, ValueError, "{}: kernel_size ({}, {}) must be >= 1", op, o.kernel_size[0],
                 o.kernel_size[1]);
    TANDEM_CHECK(w.s[i] >= 1, ValueError, "{}: stride ({}, {}) must be >= 1 (or 0 for the kernel size)", op,
                 o.stride[0], o.stride[1]);
    TANDEM_CHECK(w.dil[i] >= 1, ValueError, "{}: dilation ({}, {}) must be >= 1", op, o.dilation[0], o.dilation[1]);
    TANDEM_CHECK(w.pad[i] >= 0, ValueError, "{}: padding ({}, {}) must be >= 0", op, o.padding[0], o.padding[1]);
    TANDEM_CHECK(w.pad[i] * 2 <= w.k[i], ValueError,
                 "{}: padding ({}, {}) must be at most half the kernel size ({}, {})", op, o.padding[0], o.padding[1],
                 o.kernel_size[0], o.kernel_size[1]);
  }
  w.OH = pooled_size(w.H, w.k[0], w.s[0], w.pad[0], w.dil[0], o.ceil_mode);
  w.OW = pooled_size(w.W, w.k[1], w.s[1], w.pad[1], w.dil[1], o.ceil_mode);
  TANDEM_CHECK(w.OH >= 1 && w.OW >= 1, ShapeError, "{}: input {} is too small for kernel ({}, {})", op,
               shape_str(x.shape()), w.k[0], w.k[1]);
  return w;
}

}  // namespace

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& o) {
  const Window w = make_window(x, o, "max_pool2d", true);
  const Tensor xc = x.detach().contiguous();
  Tensor y = empty({w.N, w.C, w.OH, w.OW}, x.dtype());
  Tensor argmax = empty({w.N, w.C, w.OH, w.OW}, kInt64);  // flat index into the (H, W) plane
  TANDEM_DISPATCH_FLOATING(x.dtype(), "max_pool2d", [&] {
    using T = scalar_t;
    const T* px = static_cast<const T*>(xc.data_ptr());
    T* py = static_cast<T*>(y.data_ptr());
    int64_t* pi = argmax.data_ptr<int64_t>();
    parallel_for(0, w.N * w.C, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t nc = lo; nc < hi; ++nc) {
        const T* plane = px + nc * w.H * w.W;
        for (int64_t oh = 0; oh < w.OH; ++oh)
          for (int64_t ow = 0; ow < w.OW; ++ow) {
            compute_t<T> best = -std::numeric_limits<compute_t<T>>::infinity();
            int64_t best_i = -1;
            for (int64_t kh = 0; kh < w.k[0]; ++kh) {
              const int64_t ih = oh * w.s[0] - w.pad[0] + kh * w.dil[0];
              if (ih < 0 || ih >= w.H) continue;
              for (int64_t kw = 0; kw < w.k[1]; ++kw) {
                const int64_t iw = ow * w.s[1] - w.pad[1] + kw * w.dil[1];
                if (iw < 0 || iw >= w.W) continue;
                const compute_t<T> v = static_cast<compute_t<T>>(plane[ih * w.W + iw]);
                if (best_i < 0 || v > best || std::isnan(v)) {
                  best = v;
                  best_i = ih * w.W + iw;
                  if (std::isnan(v)) goto done;
                }
              }
            }
          done:
            const int64_t out = (nc * w.OH + oh) * w.OW + ow;
            py[out] = static_cast<T>(best);
            pi[out] = best_i;
          }
      }
    });
  });
  record("MaxPool2dBackward", {x}, {y}, [argmax, w, dt = x.dtype()](const G& g) {
    Tensor gx = empty({w.N, w.C, w.H, w.W}, dt);
    const Tensor gy = g[0].to(dt).contiguous();
    TANDEM_DISPATCH_FLOATING(dt, "max_pool2d backward", [&] {
      using T = scalar_t;
      using Acc = compute_t<T>;
      const T* pg = static_cast<const T*>(gy.data_ptr());
      T* px = static_cast<T*>(gx.data_ptr());
      const int64_t* pi = argmax.data_ptr<int64_t>();
      const int64_t plane_out = w.OH * w.OW, plane_in = w.H * w.W;
      // Overlapping windows add several gradients into one input element: summed per plane in
      // f32 for 16-bit types and rounded once (a bf16 running sum loses bits at every add).
      parallel_for(0, w.N * w.C, 1, [&](int64_t lo, int64_t hi) {
        std::vector<Acc> acc(static_cast<size_t>(plane_in));
        for (int64_t nc = lo; nc < hi; ++nc) {
          std::fill(acc.begin(), acc.end(), Acc(0));
          for (int64_t i = 0; i < plane_out; ++i) {
            // -1: a dilated window whose taps all fall in the padding (output -inf, no gradient).
            const int64_t src = pi[nc * plane_out + i];
            if (src >= 0) acc[static_cast<size_t>(src)] += static_cast<Acc>(pg[nc * plane_out + i]);
          }
          for (int64_t j = 0; j < plane_in; ++j) px[nc * plane_in + j] = static_cast<T>(acc[static_cast<size_t>(j)]);
        }
      });
    });
    return G{gx};
  });
  return y;
}

namespace {

// The averaging windows of avg_pool2d / adaptive_avg_pool2d: for output (oh, ow), rows
// [h0, h1) x cols [w0, w1) of the input, divided by `div`.
struct AvgPlan {
  int64_t N, C, H, W, OH, OW;
  std::vector<int64_t> h0, h1, w0, w1;
  std::vector<double> div;  // per (oh, ow)
};

Tensor avg_forward(const Tensor& x, const AvgPlan& a) {
  const Tensor xc = x.detach().contiguous();
  Tensor y = empty({a.N, a.C, a.OH, a.OW}, x.dtype());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", [&] {
    using T = scalar_t;
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = static_cast<const T*>(xc.data_ptr());
    T* py = static_cast<T*>(y.data_ptr());
    parallel_for(0, a.N * a.C, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t nc = lo; nc < hi; ++nc) {
        const T* plane = px + nc * a.H * a.W;
        for (int64_t oh = 0; oh < a.OH; ++oh)
          for (int64_t ow = 0; ow < a.OW; ++ow) {
            Acc s = 0;
            for (int64_t ih = a.h0[oh]; ih < a.h1[oh]; ++ih)
              for (int64_t iw = a.w0[ow]; iw < a.w1[ow]; ++iw) s += static_cast<Acc>(plane[ih * a.W + iw]);
            py[(nc * a.OH + oh) * a.OW + ow] = static_cast<T>(s / static_cast<Acc>(a.div[oh * a.OW + ow]));
          }
      }
    });
  });
  return y;
}

Tensor avg_backward(const Tensor& g, const AvgPlan& a, DType dt) {
  Tensor gx = empty({a.N, a.C, a.H, a.W}, dt);
  const Tensor gy = g.to(dt).contiguous();
  TANDEM_DISPATCH_FLOATING(dt, "avg_pool2d backward", [&] {
    using T = scalar_t;
    using Acc = compute_t<T>;
    const T* pg = static_cast<const T*>(gy.data_ptr());
    T* px = static_cast<T*>(gx.data_ptr());
    const int64_t plane_in = a.H * a.W;
    // Overlapping windows (stride < kernel, adaptive bins that share a row) add into one input
    // element: summed per plane in f32 for 16-bit types and rounded once.
    parallel_for(0, a.N * a.C, 1, [&](int64_t lo, int64_t hi) {
      std::vector<Acc> acc(static_cast<size_t>(plane_in));
      for (int64_t nc = lo; nc < hi; ++nc) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t oh = 0; oh < a.OH; ++oh)
          for (int64_t ow = 0; ow < a.OW; ++ow) {
            const Acc v = static_cast<Acc>(pg[(nc * a.OH + oh) * a.OW + ow]) / static_cast<Acc>(a.div[oh * a.OW + ow]);
            for (int64_t ih = a.h0[oh]; ih < a.h1[oh]; ++ih)
              for (int64_t iw = a.w0[ow]; iw < a.w1[ow]; ++iw) acc[static_cast<size_t>(ih * a.W + iw)] += v;
          }
        for (int64_t j = 0; j < plane_in; ++j) px[nc * plane_in + j] = static_cast<T>(acc[static_cast<size_t>(j)]);
      }
    });
  });
  return gx;
}

Tensor avg_op(const Tensor& x, const AvgPlan& a, const char* name) {
  Tensor y = avg_forward(x, a);
  record(name, {x}, {y}, [a, dt = x.dtype()](const G& g) { return G{avg_backward(g[0], a, dt)}; });
  return y;
}

}  // namespace

Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& o) {
  const Window w = make_window(x, o, "avg_pool2d", false);
  AvgPlan a{w.N, w.C, w.H, w.W, w.OH, w.OW, {}, {}, {}, {}, {}};
  std::vector<int64_t> ph0, ph1, pw0, pw1;  // padded window bounds (for count_include_pad)
  for (int64_t oh = 0; oh < w.OH; ++oh) {
    const int64_t start = oh * w.s[0] - w.pad[0];
    const int64_t end = std::min(start + w.k[0], w.H + w.pad[0]);
    ph0.push_back(start), ph1.push_back(end);
    a.h0.push_back(std::max<int64_t>(start, 0)), a.h1.push_back(std::min(end, w.H));
  }
  for (int64_t ow = 0; ow < w.OW; ++ow) {
    const int64_t start = ow * w.s[1] - w.pad[1];
    const int64_t end = std::min(start + w.k[1], w.W + w.pad[1]);
    pw0.push_back(start), pw1.push_back(end);
    a.w0.push_back(std::max<int64_t>(start, 0)), a.w1.push_back(std::min(end, w.W));
  }
  for (int64_t oh = 0; oh < w.OH; ++oh)
    for (int64_t ow = 0; ow < w.OW; ++ow) {
      const double n = o.count_include_pad ? static_cast<double>((ph1[oh] - ph0[oh]) * (pw1[ow] - pw0[ow]))
                                           : static_cast<double>((a.h1[oh] - a.h0[oh]) * (a.w1[ow] - a.w0[ow]));
      a.div.push_back(n);
    }
  return avg_op(x, a, "AvgPool2dBackward");
}

namespace {

bool is_channels_last(const Tensor& x) {
  if (x.dim() != 4 || x.is_contiguous() || !x.is_non_overlapping_and_dense()) return false;
  const Shape cl = kernels::channels_last_strides(x.shape());
  for (int d = 0; d < 4; ++d) {
    if (x.size(d) != 1 && x.stride(d) != cl[d]) return false;
  }
  return true;
}

// Global average pooling (output 1 x 1), the CNN's "mean over H, W": one pass over x in its own
// layout (a channels-last activation is read as rows of C, no transposing copy), accumulated in
// f32 (f64 for f64) and rounded once; the gradient is written back in x's layout, so the layers
// before it keep channels-last end to end.
Tensor global_avg_pool(const Tensor& x_in) {
  Tensor x = x_in.detach();
  const bool cl = is_channels_last(x);
  if (!cl) x = x.contiguous();
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const DType dt = x.dtype();
  Tensor y = empty({N, C, 1, 1}, dt);
  TANDEM_DISPATCH_FLOATING(dt, "adaptive_avg_pool2d", [&] {
    using T = scalar_t;
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = static_cast<const T*>(x.data_ptr());
    T* py = static_cast<T*>(y.data_ptr());
    parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
      std::vector<Acc> acc(static_cast<size_t>(C));
      for (int64_t n = lo; n < hi; ++n) {
        if (cl) {
          std::fill(acc.begin(), acc.end(), Acc(0));
          for (int64_t i = 0; i < HW; ++i) {
            const T* row = px + (n * HW + i) * C;
            for (int64_t c = 0; c < C; ++c) acc[c] += static_cast<Acc>(static_cast<compute_t<T>>(row[c]));
          }
          for (int64_t c = 0; c < C; ++c) py[n * C + c] = static_cast<T>(acc[c] / static_cast<Acc>(HW));
        } else {
          for (int64_t c = 0; c < C; ++c) {
            const T* plane = px + (n * C + c) * HW;
            Acc s = 0;
            for (int64_t i = 0; i < HW; ++i) s += static_cast<Acc>(static_cast<compute_t<T>>(plane[i]));
            py[n * C + c] = static_cast<T>(s / static_cast<Acc>(HW));
          }
        }
      }
    });
  });
  record("AdaptiveAvgPool2dBackward", {x_in}, {y}, [shape = x.shape(), cl, dt](const G& g) {
    const int64_t N = shape[0], C = shape[1], HW = shape[2] * shape[3];
    const Tensor gy = g[0].to(dt).contiguous();
    Tensor gx = cl ? empty_strided(shape, kernels::channels_last_strides(shape), dt) : empty(shape, dt);
    TANDEM_DISPATCH_FLOATING(dt, "adaptive_avg_pool2d backward", [&] {
      using T = scalar_t;
      using Acc = compute_t<T>;
      const T* pg = static_cast<const T*>(gy.data_ptr());
      T* px = static_cast<T*>(gx.data_ptr());
      parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
        std::vector<T> v(static_cast<size_t>(C));
        for (int64_t n = lo; n < hi; ++n) {
          for (int64_t c = 0; c < C; ++c) v[c] = static_cast<T>(static_cast<Acc>(pg[n * C + c]) / static_cast<Acc>(HW));
          if (cl) {
            for (int64_t i = 0; i < HW; ++i) std::copy(v.begin(), v.end(), px + (n * HW + i) * C);
          } else {
            for (int64_t c = 0; c < C; ++c) std::fill(px + (n * C + c) * HW, px + (n * C + c + 1) * HW, v[c]);
          }
        }
      });
    });
    return G{gx};
  });
  return y;
}

}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> out) {
  TANDEM_CHECK(x.dim() == 4, ShapeError, "adaptive_avg_pool2d: expected a 4-d input (N, C, H, W), got {}",
               shape_str(x.shape()));
  TANDEM_CHECK(out[0] >= 1 && out[1] >= 1, ValueError, "adaptive_avg_pool2d: output size ({}, {}) must be positive",
               out[0], out[1]);
  TANDEM_CHECK(is_floating(x.dtype()), DTypeError, "adaptive_avg_pool2d: expected a floating input, got {}",
               dtype_name(x.dtype()));
  if (out[0] == 1 && out[1] == 1) return global_avg_pool(x);  // an empty plane: NaN, as PyTorch's mean
  TANDEM_CHECK(x.size(2) >= 1 && x.size(3) >= 1, ShapeError,
               "adaptive_avg_pool2d: input {} has an empty spatial dim: no values to average into ({}, {}) bins",
               shape_str(x.shape()), out[0], out[1]);
  AvgPlan a{x.size(0), x.size(1), x.size(2), x.size(3), out[0], out[1], {}, {}, {}, {}, {}};
  for (int64_t i = 0; i < out[0]; ++i) {
    a.h0.push_back(i * a.H / out[0]);
    a.h1.push_back(((i + 1) * a.H + out[0] - 1) / out[0]);
  }
  for (int64_t i = 0; i < out[1]; ++i) {
    a.w0.push_back(i * a.W / out[1]);
    a.w1.push_back(((i + 1) * a.W + out[1] - 1) / out[1]);
  }
  for (int64_t oh = 0; oh < out[0]; ++oh)
    for (int64_t ow = 0; ow < out[1]; ++ow)
      a.div.push_back(static_cast<double>((a.h1[oh] - a.h0[oh]) * (a.w1[ow] - a.w0[ow])));
  return avg_op(x, a, "AdaptiveAvgPool2dBackward");
}

}  // namespace tandem::ops
