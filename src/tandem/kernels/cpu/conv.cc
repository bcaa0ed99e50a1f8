#include "tandem/kernels/cpu/conv.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/dnnl_common.h"
#include "tandem/kernels/cpu/kernel_timing.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/kernels/cpu/row_math.h"

namespace tandem::kernels {

Shape channels_last_strides(const Shape& s) {
  const int64_t C = s[1], H = s[2], W = s[3];
  return {H * W * C, 1, W * C, C};
}

Tensor to_channels_last(const Tensor& x) {
  const Shape st = channels_last_strides(x.shape());
  bool already = true;
  for (int64_t d = 0; d < 4; ++d) already &= x.size(d) == 1 || x.stride(d) == st[d];
  if (already) return x;
  Tensor out = empty_strided(x.shape(), st, x.dtype());
  copy_into(out, x);
  return out;
}

Shape conv2d_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p) {
  TANDEM_CHECK(x.size() == 4, ShapeError, "conv2d: expected a 4-d input (N, C, H, W), got {}", shape_str(x));
  TANDEM_CHECK(w.size() == 4, ShapeError, "conv2d: expected a 4-d weight (O, C/groups, KH, KW), got {}", shape_str(w));
  TANDEM_CHECK(w[0] >= 1 && w[1] >= 1 && w[2] >= 1 && w[3] >= 1, ShapeError,
               "conv2d: every dim of the weight {} (O, C/groups, KH, KW) must be >= 1", shape_str(w));
  TANDEM_CHECK(p.groups >= 1 && x[1] % p.groups == 0 && w[0] % p.groups == 0, ValueError,
               "conv2d: groups={} must divide the input channels {} and output channels {}", p.groups, x[1], w[0]);
  TANDEM_CHECK(w[1] * p.groups == x[1], ShapeError,
               "conv2d: weight {} with groups={} expects {} input channels, but the input {} has {}", shape_str(w),
               p.groups, w[1] * p.groups, shape_str(x), x[1]);
  Shape out{x[0], w[0], 0, 0};
  for (int i = 0; i < 2; ++i) {
    TANDEM_CHECK(p.stride[i] >= 1 && p.dilation[i] >= 1 && p.padding[i] >= 0, ValueError,
                 "conv2d: stride ({}, {}) and dilation ({}, {}) must be >= 1 and padding ({}, {}) >= 0", p.stride[0],
                 p.stride[1], p.dilation[0], p.dilation[1], p.padding[0], p.padding[1]);
    const int64_t span = p.dilation[i] * (w[2 + i] - 1) + 1;
    const int64_t in = x[2 + i] + 2 * p.padding[i];
    TANDEM_CHECK(in >= span, ShapeError,
                 "conv2d: the kernel ({}x{}, dilation {}) is larger than the padded input ({}x{}) of {}", w[2], w[3],
                 p.dilation[i], x[2] + 2 * p.padding[0], x[3] + 2 * p.padding[1], shape_str(x));
    out[2 + i] = (in - span) / p.stride[i] + 1;
  }
  return out;
}

namespace {

// 2 x multiply-adds of a convolution pass with output shape ys and weight shape ws (padding
// taps included, as oneDNN computes them): the same for forward, input and weight gradients.
double conv_flops(const Shape& ys, const Shape& ws) {
  return 2.0 * static_cast<double>(ys[0] * ys[1] * ys[2] * ys[3]) * static_cast<double>(ws[1] * ws[2] * ws[3]);
}

// Whether a bf16 convolution runs widened (bf16_products.h: where VDPBF16PS is slower than f32
// FMAs or absent): the operands widened exactly, oneDNN's f32 convolution, the result rounded
// once, the f32 conv's layouts kept (channels-last in and out).
bool bf16_widened(DType dt) { return dt == kBFloat16 && bf16_products() == Bf16Products::widened; }

// t (f32, dense) rounded to bf16 in the same layout (a channels-last output stays channels-last).
Tensor rounded_to_bf16(const Tensor& t) {
  Tensor out = empty_strided(t.shape(), t.strides(), kBFloat16);
  convert(t.data_ptr(), kFloat32, out.data_ptr(), kBFloat16, t.numel());
  return out;
}

// ---- f64 reference loops (NCHW, contiguous) ----

// Visits every (x element, w element, y element) triple of the convolution: the f64 passes.
template <class F>
void conv_f64_visit(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, F f) {
  const int64_t N = xs[0], C = xs[1], H = xs[2], W = xs[3];
  const int64_t O = ws[0], Cg = ws[1], KH = ws[2], KW = ws[3];
  const int64_t OH = ys[2], OW = ys[3], Og = O / p.groups;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) {
      const int64_t g = o / Og;
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow)
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t kh = 0; kh < KH; ++kh) {
              const int64_t ih = oh * p.stride[0] - p.padding[0] + kh * p.dilation[0];
              if (ih < 0 || ih >= H) continue;
              for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t iw = ow * p.stride[1] - p.padding[1] + kw * p.dilation[1];
                if (iw < 0 || iw >= W) continue;
                f(((n * C + g * Cg + c) * H + ih) * W + iw, ((o * Cg + c) * KH + kh) * KW + kw,
                  ((n * O + o) * OH + oh) * OW + ow);
              }
            }
    }
}

// The f64 forward (the gradcheck reference path): y = bias, then every visited triple adds x * w.
void conv_f64(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, const Conv2dParams& p) {
  const int64_t O = y.size(1), HW = y.size(2) * y.size(3);
  const double* px = x.data_ptr<double>();
  const double* pw = w.data_ptr<double>();
  double* py = y.data_ptr<double>();
  for (int64_t i = 0; i < y.numel(); ++i) py[i] = b.defined() ? b.data_ptr<double>()[(i / HW) % O] : 0.0;
  conv_f64_visit(x.shape(), w.shape(), y.shape(), p, [&](int64_t xi, int64_t wi, int64_t yi) { py[yi] += px[xi] * pw[wi]; });
}

// ---- oneDNN ----

using tag = dnnl::memory::format_tag;
using dims = dnnl::memory::dims;

struct Geometry {
  dims x, w, b, y, strides, dilates, pad_l, pad_r;
  bool grouped;
};

Geometry geometry(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p) {
  Geometry g;
  g.x = {xs[0], xs[1], xs[2], xs[3]};
  g.y = {ys[0], ys[1], ys[2], ys[3]};
  g.grouped = p.groups > 1;
  g.w = g.grouped ? dims{p.groups, ws[0] / p.groups, ws[1], ws[2], ws[3]} : dims{ws[0], ws[1], ws[2], ws[3]};
  g.b = {ws[0]};
  g.strides = {p.stride[0], p.stride[1]};
  g.dilates = {p.dilation[0] - 1, p.dilation[1] - 1};
  g.pad_l = {p.padding[0], p.padding[1]};
  g.pad_r.resize(2);
  for (int i = 0; i < 2; ++i) {
    // oneDNN wants the right padding that makes its output size formula give exactly ys.
    g.pad_r[i] = (ys[2 + i] - 1) * p.stride[i] + (ws[2 + i] - 1) * p.dilation[i] + 1 - xs[2 + i] - p.padding[i];
  }
  return g;
}

struct Plan {
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd;
  dnnl::convolution_backward_weights bwd_weights;
  bool has_bwd_data = false, has_bwd_weights = false;
};

std::mutex plans_mu;
std::unordered_map<std::string, std::shared_ptr<Plan>>& plans() {
  static auto* m = new std::unordered_map<std::string, std::shared_ptr<Plan>>;
  return *m;
}

std::shared_ptr<Plan> plan_for(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, DType dt,
                               bool bias, const Geometry& g) {
  // oneDNN fixes a primitive's thread count when it is made: make it with this thread's share
  // (get_num_threads()) and key the plan by it, so set_num_threads() takes effect.
  dnnl_sync_threads();
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}", shape_str(xs), shape_str(ws), p.stride[0], p.stride[1],
                                      p.padding[0], p.padding[1], p.dilation[0], p.dilation[1],
                                      fmt::format("{}|{}|{}|{}", p.groups, static_cast<int>(dt), bias, get_num_threads()));
  std::lock_guard<std::mutex> lock(plans_mu);
  auto it = plans().find(key);
  if (it != plans().end()) return it->second;
  const auto t = dnnl_type(dt, "conv2d");
  const dnnl::memory::desc x_md(g.x, t, tag::nhwc), y_md(g.y, t, tag::nhwc), w_md(g.w, t, tag::any);
  const dnnl::memory::desc b_md(g.b, t, tag::x);
  auto plan = std::make_shared<Plan>();
  auto desc = bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                                     x_md, w_md, b_md, y_md, g.strides, g.dilates, g.pad_l, g.pad_r)
                   : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                                     x_md, w_md, y_md, g.strides, g.dilates, g.pad_l, g.pad_r);
  plan->fwd_pd = dnnl::convolution_forward::primitive_desc(desc, dnnl_engine());
  plan->fwd = dnnl::convolution_forward(plan->fwd_pd);
  plans().emplace(key, plan);
  return plan;
}

dnnl::memory::desc plain_weights_md(const Geometry& g, DType dt) {
  return dnnl::memory::desc(g.w, dnnl_type(dt, "conv2d"), g.grouped ? tag::goihw : tag::oihw);
}

// Memory for `want` holding the plain weights `w`: w itself when the layouts agree, else a
// reordered copy kept alive by `holder`.
dnnl::memory weights_as(const Tensor& w, const Geometry& g, const dnnl::memory::desc& want, Tensor& holder) {
  const dnnl::memory::desc plain = plain_weights_md(g, w.dtype());
  dnnl::memory user(plain, dnnl_engine(), w.data_ptr());
  if (want == plain) return user;
  holder = empty({static_cast<int64_t>(want.get_size())}, kUInt8);
  dnnl::memory dst(want, dnnl_engine(), holder.data_ptr());
  dnnl::reorder(user, dst).execute(dnnl_stream(), user, dst);
  return dst;
}

// ---- bf16 weight gradient as GEMMs over im2col blocks ----
//
// oneDNN 2.6's AMX backward-weights kernel runs the shapes of small CNNs (3x3, 32-128 channels,
// 7-28 pixels) at a fifth of its AMX matmul rate, slower than its f32 kernel. Works as follows:
// the output pixels p = (n, oh, ow) are taken in blocks; each block's receptive fields are
// gathered into cols (rows, KH*KW*C), bf16, laid out (kh, kw, c) so that every tap is one
// contiguous run of C channels of the channels-last input (zeros where the tap falls in the
// padding); then dW (O, KH*KW*C) += gy_block^T (O, rows) @ cols, in f32. The f32 sum is rounded
// once into (O, C, KH, KW) at the end, as oneDNN's own kernel rounds its f32 accumulators.
bool use_im2col_weight_grad(DType dt, const Shape& xs, const Shape& ws, const Conv2dParams& p) {
  // C*KH*KW >= 64: the GEMM's inner size; below it (a 1-channel stem) oneDNN's kernels win.
  return dt == kBFloat16 && p.groups == 1 && xs[1] * ws[2] * ws[3] >= 64;
}

std::pair<Tensor, Tensor> conv2d_backward_weight_im2col(const Tensor& gy, const Tensor& x, const Shape& ws,
                                                        const Shape& ys, bool with_bias, const Conv2dParams& p) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t O = ws[0], KH = ws[2], KW = ws[3], OH = ys[2], OW = ys[3];
  const int64_t K = KH * KW * C, P = N * OH * OW;
  // Rows per block: cols of about 1 MiB (stays in L2 between its write and the GEMM's read).
  const int64_t R = std::min(P, std::max<int64_t>(64, (int64_t{1} << 20) / (K * 2)));
  const auto* px = static_cast<const uint16_t*>(x.data_ptr());   // (N, H, W, C) bf16 bits
  const auto* pg = static_cast<const uint16_t*>(gy.data_ptr());  // (N, OH, OW, O)
  // On AMX the products accumulate into acc directly; elsewhere each block's goes through part.
  const bool amx = amx_bf16_enabled();
  Tensor cols = empty({1, R, K}, kBFloat16), acc = zeros({O, K}, kFloat32);
  Tensor part = amx ? Tensor() : empty({1, O, K}, kFloat32);
  auto* pc = static_cast<uint16_t*>(cols.data_ptr());
  float* pacc = acc.data_ptr<float>();
  const float* ppart = amx ? nullptr : part.data_ptr<float>();
  for (int64_t p0 = 0; p0 < P; p0 += R) {
    const int64_t rows = std::min(R, P - p0);
    // ---- gather: cols[r] = the receptive field of output pixel p0 + r ----
    parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t q = p0 + r, n = q / (OH * OW), oh = (q / OW) % OH, ow = q % OW;
        uint16_t* dst = pc + r * K;
        for (int64_t kh = 0; kh < KH; ++kh, dst += KW * C) {
          const int64_t ih = oh * p.stride[0] - p.padding[0] + kh * p.dilation[0];
          if (ih < 0 || ih >= H) {
            std::memset(dst, 0, static_cast<size_t>(KW * C) * 2);
            continue;
          }
          const int64_t iw0 = ow * p.stride[1] - p.padding[1];
          if (p.dilation[1] == 1) {
            // Undilated taps of one kernel row are adjacent pixels of the channels-last row: the
            // taps inside the image are one contiguous run, copied at once; padding is zeros.
            const int64_t lo = std::clamp<int64_t>(-iw0, 0, KW), hi = std::clamp<int64_t>(W - iw0, lo, KW);
            if (lo > 0) std::memset(dst, 0, static_cast<size_t>(lo * C) * 2);
            if (hi > lo) std::memcpy(dst + lo * C, px + ((n * H + ih) * W + iw0 + lo) * C, static_cast<size_t>((hi - lo) * C) * 2);
            if (hi < KW) std::memset(dst + hi * C, 0, static_cast<size_t>((KW - hi) * C) * 2);
            continue;
          }
          for (int64_t kw = 0; kw < KW; ++kw) {
            const int64_t iw = iw0 + kw * p.dilation[1];
            if (iw < 0 || iw >= W) std::memset(dst + kw * C, 0, static_cast<size_t>(C) * 2);
            else std::memcpy(dst + kw * C, px + ((n * H + ih) * W + iw) * C, static_cast<size_t>(C) * 2);
          }
        }
      }
    });
    // ---- dW += gy_block^T @ cols ----
    if (amx) {
      amx_gemm_bf16('T', 'N', O, K, rows, pg + p0 * O, O, pc, K, nullptr, true, pacc, false, K);
      continue;
    }
    const Tensor a = from_blob(const_cast<uint16_t*>(pg + p0 * O), {1, O, rows}, {O * rows, 1, O}, kBFloat16);
    const Tensor b = rows == R ? cols : from_blob(pc, {1, rows, K}, {rows * K, K, 1}, kBFloat16);
    gemm_into(a, b, Tensor(), part);
    add_into_f32(pacc, ppart, O * K);
  }
  // ---- round once into (O, C, KH, KW) ----
  Tensor gw = empty(ws, kBFloat16);
  auto* pw = static_cast<bfloat16*>(gw.data_ptr());
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t t = 0; t < KH * KW; ++t) pw[(o * C + c) * KH * KW + t] = static_cast<bfloat16>(pacc[(o * KH * KW + t) * C + c]);
  Tensor gb;
  if (with_bias) {  // column sums of gy (P, O), f32, rounded once
    std::vector<float> sum(static_cast<size_t>(O), 0.0f), row(static_cast<size_t>(O));
    for (int64_t q = 0; q < P; ++q) {
      convert(pg + q * O, kBFloat16, row.data(), kFloat32, O);
      add_into_f32(sum.data(), row.data(), O);
    }
    gb = empty({O}, kBFloat16);
    convert(sum.data(), kFloat32, gb.data_ptr(), kBFloat16, O);
  }
  return {gw, gb};
}

}  // namespace

Tensor conv2d_forward(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Conv2dParams& p) {
  const Shape ys = conv2d_output_shape(x0.shape(), w0.shape(), p);
  TANDEM_CHECK(x0.dtype() == w0.dtype(), DTypeError, "conv2d: input ({}) and weight ({}) dtypes differ",
               dtype_name(x0.dtype()), dtype_name(w0.dtype()));
  if (b0.defined()) {
    TANDEM_CHECK(b0.dim() == 1 && b0.size(0) == w0.size(0), ShapeError, "conv2d: bias of shape {} for {} output channels",
                 shape_str(b0.shape()), w0.size(0));
  }
  const DType dt = x0.dtype();
  if (dt == kFloat64) {
    Tensor y = empty(ys, kFloat64);
    conv_f64(x0.contiguous(), w0.contiguous(), b0.defined() ? b0.to(kFloat64).contiguous() : b0, y, p);
    return y;
  }
  if (dt == kFloat16) {  // no f16 convolution on this CPU: exact widening, one rounding at the end
    return conv2d_forward(x0.to(kFloat32), w0.to(kFloat32), b0.defined() ? b0.to(kFloat32) : b0, p).to(kFloat16);
  }
  TANDEM_CHECK(dt == kFloat32 || dt == kBFloat16, DTypeError, "conv2d: expected a floating input, got {}", dtype_name(dt));
  if (bf16_widened(dt)) {  // the bias rounded to bf16 first, as the bf16 convolution reads it
    const Tensor b = b0.defined() ? widened_to_f32(b0.to(dt).contiguous()) : b0;
    return rounded_to_bf16(conv2d_forward(widened_to_f32(to_channels_last(x0)), widened_to_f32(w0.contiguous()), b, p));
  }
  const Tensor x = to_channels_last(x0), w = w0.contiguous();
  const Tensor b = b0.defined() ? b0.to(dt).contiguous() : b0;
  const Geometry g = geometry(x.shape(), w.shape(), ys, p);
  auto plan = plan_for(x.shape(), w.shape(), ys, p, dt, b.defined(), g);
  Tensor y = empty_strided(ys, channels_last_strides(ys), dt);
  dnnl_sync_threads();
  Tensor w_holder;
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, dnnl::memory(plan->fwd_pd.src_desc(), dnnl_engine(), x.data_ptr())},
      {DNNL_ARG_WEIGHTS, weights_as(w, g, plan->fwd_pd.weights_desc(), w_holder)},
      {DNNL_ARG_DST, dnnl::memory(plan->fwd_pd.dst_desc(), dnnl_engine(), y.data_ptr())}};
  if (b.defined()) args.emplace(DNNL_ARG_BIAS, dnnl::memory(plan->fwd_pd.bias_desc(), dnnl_engine(), b.data_ptr()));
  const KernelTimer timer(KernelKind::conv, conv_flops(ys, w.shape()));
  plan->fwd.execute(dnnl_stream(), args);
  dnnl_stream().wait();
  return y;
}

Tensor conv2d_backward_input(const Tensor& gy0, const Tensor& w0, const Shape& xs, const Conv2dParams& p) {
  const DType dt = w0.dtype();
  const Shape ys = conv2d_output_shape(xs, w0.shape(), p);
  if (dt == kFloat64) {
    const Tensor gy = gy0.to(kFloat64).contiguous(), w = w0.contiguous();
    Tensor gx = zeros(xs, kFloat64);
    const double* pg = gy.data_ptr<double>();
    const double* pw = w.data_ptr<double>();
    double* px = gx.data_ptr<double>();
    conv_f64_visit(xs, w.shape(), ys, p, [&](int64_t xi, int64_t wi, int64_t yi) { px[xi] += pg[yi] * pw[wi]; });
    return gx;
  }
  if (dt == kFloat16) return conv2d_backward_input(gy0.to(kFloat32), w0.to(kFloat32), xs, p).to(kFloat16);
  if (bf16_widened(dt)) {
    return rounded_to_bf16(conv2d_backward_input(widened_to_f32(to_channels_last(gy0.to(dt))),
                                                 widened_to_f32(w0.contiguous()), xs, p));
  }
  const Tensor gy = to_channels_last(gy0.to(dt)), w = w0.contiguous();
  const Geometry g = geometry(xs, w.shape(), ys, p);
  auto plan = plan_for(xs, w.shape(), ys, p, dt, false, g);
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    if (!plan->has_bwd_data) {
      const auto t = dnnl_type(dt, "conv2d");
      dnnl::convolution_backward_data::desc desc(
          dnnl::algorithm::convolution_direct, dnnl::memory::desc(g.x, t, tag::nhwc), dnnl::memory::desc(g.w, t, tag::any),
          dnnl::memory::desc(g.y, t, tag::nhwc), g.strides, g.dilates, g.pad_l, g.pad_r);
      plan->bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(desc, dnnl_engine(), plan->fwd_pd);
      plan->bwd_data = dnnl::convolution_backward_data(plan->bwd_data_pd);
      plan->has_bwd_data = true;
    }
  }
  Tensor gx = empty_strided(xs, channels_last_strides(xs), dt);
  dnnl_sync_threads();
  Tensor w_holder;
  const KernelTimer timer(KernelKind::conv, conv_flops(ys, w.shape()));
  plan->bwd_data.execute(dnnl_stream(),
                         {{DNNL_ARG_DIFF_DST, dnnl::memory(plan->bwd_data_pd.diff_dst_desc(), dnnl_engine(), gy.data_ptr())},
                          {DNNL_ARG_WEIGHTS, weights_as(w, g, plan->bwd_data_pd.weights_desc(), w_holder)},
                          {DNNL_ARG_DIFF_SRC, dnnl::memory(plan->bwd_data_pd.diff_src_desc(), dnnl_engine(), gx.data_ptr())}});
  dnnl_stream().wait();
  return gx;
}

std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& gy0, const Tensor& x0, const Shape& ws, bool with_bias,
                                                 const Conv2dParams& p) {
  const DType dt = x0.dtype();
  const Shape ys = conv2d_output_shape(x0.shape(), ws, p);
  if (dt == kFloat64) {
    const Tensor gy = gy0.to(kFloat64).contiguous(), x = x0.contiguous();
    Tensor gw = zeros(ws, kFloat64);
    const double* pg = gy.data_ptr<double>();
    const double* px = x.data_ptr<double>();
    double* pw = gw.data_ptr<double>();
    conv_f64_visit(x.shape(), ws, ys, p, [&](int64_t xi, int64_t wi, int64_t yi) { pw[wi] += pg[yi] * px[xi]; });
    Tensor gb;
    if (with_bias) {
      gb = zeros({ws[0]}, kFloat64);
      double* pb = gb.data_ptr<double>();
      const int64_t O = ws[0], HW = ys[2] * ys[3];
      for (int64_t n = 0; n < ys[0]; ++n)
        for (int64_t o = 0; o < O; ++o)
          for (int64_t i = 0; i < HW; ++i) pb[o] += pg[(n * O + o) * HW + i];
    }
    return {gw, gb};
  }
  if (dt == kFloat16) {
    auto [gw, gb] = conv2d_backward_weight(gy0.to(kFloat32), x0.to(kFloat32), ws, with_bias, p);
    return {gw.to(kFloat16), gb.defined() ? gb.to(kFloat16) : gb};
  }
  if (bf16_widened(dt)) {
    auto [gw, gb] = conv2d_backward_weight(widened_to_f32(to_channels_last(gy0.to(dt))),
                                           widened_to_f32(to_channels_last(x0)), ws, with_bias, p);
    return {rounded_to_bf16(gw), gb.defined() ? rounded_to_bf16(gb) : gb};
  }
  const Tensor gy = to_channels_last(gy0.to(dt)), x = to_channels_last(x0);
  if (use_im2col_weight_grad(dt, x.shape(), ws, p)) return conv2d_backward_weight_im2col(gy, x, ws, ys, with_bias, p);
  const Geometry g = geometry(x.shape(), ws, ys, p);
  auto plan = plan_for(x.shape(), ws, ys, p, dt, with_bias, g);
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    if (!plan->has_bwd_weights) {
      const auto t = dnnl_type(dt, "conv2d");
      const dnnl::memory::desc x_md(g.x, t, tag::nhwc), y_md(g.y, t, tag::nhwc), w_md(g.w, t, tag::any);
      auto desc = with_bias ? dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, x_md, w_md,
                                                                       dnnl::memory::desc(g.b, t, tag::x), y_md, g.strides,
                                                                       g.dilates, g.pad_l, g.pad_r)
                            : dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, x_md, w_md,
                                                                       y_md, g.strides, g.dilates, g.pad_l, g.pad_r);
      plan->bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(desc, dnnl_engine(), plan->fwd_pd);
      plan->bwd_weights = dnnl::convolution_backward_weights(plan->bwd_weights_pd);
      plan->has_bwd_weights = true;
    }
  }
  Tensor gw = empty(ws, dt);
  const dnnl::memory::desc plain = plain_weights_md(g, dt);
  const dnnl::memory::desc want = plan->bwd_weights_pd.diff_weights_desc();
  Tensor holder;
  dnnl::memory gw_user(plain, dnnl_engine(), gw.data_ptr());
  dnnl::memory gw_mem = gw_user;
  if (!(want == plain)) {
    holder = empty({static_cast<int64_t>(want.get_size())}, kUInt8);
    gw_mem = dnnl::memory(want, dnnl_engine(), holder.data_ptr());
  }
  Tensor gb = with_bias ? empty({ws[0]}, dt) : Tensor();
  dnnl_sync_threads();
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, dnnl::memory(plan->bwd_weights_pd.src_desc(), dnnl_engine(), x.data_ptr())},
      {DNNL_ARG_DIFF_DST, dnnl::memory(plan->bwd_weights_pd.diff_dst_desc(), dnnl_engine(), gy.data_ptr())},
      {DNNL_ARG_DIFF_WEIGHTS, gw_mem}};
  if (with_bias) {
    args.emplace(DNNL_ARG_DIFF_BIAS, dnnl::memory(plan->bwd_weights_pd.diff_bias_desc(), dnnl_engine(), gb.data_ptr()));
  }
  const KernelTimer timer(KernelKind::conv, conv_flops(ys, ws));
  plan->bwd_weights.execute(dnnl_stream(), args);
  if (!(want == plain)) dnnl::reorder(gw_mem, gw_user).execute(dnnl_stream(), gw_mem, gw_user);
  dnnl_stream().wait();
  return {gw, gb};
}

}  // namespace tandem::kernels
