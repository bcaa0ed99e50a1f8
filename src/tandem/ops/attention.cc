#include "tandem/ops/attention.h"

#include <cmath>

#include "tandem/amp/policy.h"
#include "tandem/core/convert.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/attention.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/loss.h"
#include "tandem/ops/where.h"
#include "tandem/ops/elementwise.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

kernels::AttentionShape check_shapes(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  TANDEM_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), ShapeError,
               "scaled_dot_product_attention: q {}, k {}, v {} must have the same number (>= 2) of dims",
               shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  for (int64_t d = 0; d < q.dim() - 2; ++d) {
    TANDEM_CHECK(q.size(d) == k.size(d) && q.size(d) == v.size(d), ShapeError,
                 "scaled_dot_product_attention: leading dims differ: q {}, k {}, v {}", shape_str(q.shape()),
                 shape_str(k.shape()), shape_str(v.shape()));
  }
  TANDEM_CHECK(q.size(-1) == k.size(-1), ShapeError,
               "scaled_dot_product_attention: q's last dim {} differs from k's {} (q {}, k {})", q.size(-1), k.size(-1),
               shape_str(q.shape()), shape_str(k.shape()));
  TANDEM_CHECK(k.size(-2) == v.size(-2), ShapeError,
               "scaled_dot_product_attention: k has {} keys but v has {} values (k {}, v {})", k.size(-2), v.size(-2),
               shape_str(k.shape()), shape_str(v.shape()));
  TANDEM_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()), DTypeError,
               "scaled_dot_product_attention: expected q, k, v of one floating dtype, got {}, {}, {}",
               dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype()));
  const int64_t T = q.size(-2), S = k.size(-2);
  kernels::AttentionShape s;
  s.BH = 1;  // the leading dims (not numel / (T * D): a zero D or T would make it 0)
  for (int64_t d = 0; d < q.dim() - 2; ++d) s.BH *= q.size(d);
  s.T = T;
  s.S = S;
  s.D = q.size(-1);
  s.Dv = v.size(-1);
  s.causal = causal;
  return s;
}

// t as a contiguous tensor of dtype `acc`. A strided view whose last dim is dense (the heads of
// a fused qkv projection, (B, H, T, D) over a (B, T, 3, H, D) buffer) is converted row by row
// with direct addressing: the generic strided copy pays an index decomposition and a dispatch
// per 64-element row.
Tensor to_dense(const Tensor& t_in, DType acc) {
  const Tensor t = t_in.detach();
  if (t.is_contiguous() || t.dim() < 2 || t.dim() > 4 || t.stride(-1) != 1) return t.to(acc).contiguous();
  Tensor out = empty(t.shape(), acc);
  Shape shp = t.shape(), st = t.strides();
  while (shp.size() < 4) {  // leading size-1 dims
    shp.insert(shp.begin(), 1);
    st.insert(st.begin(), 0);
  }
  const int64_t n = shp[3];
  const size_t in_es = t.element_size(), out_es = out.element_size();
  const char* src = static_cast<const char*>(t.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  int64_t row = 0;
  for (int64_t a = 0; a < shp[0]; ++a)
    for (int64_t b = 0; b < shp[1]; ++b)
      for (int64_t c = 0; c < shp[2]; ++c, ++row) {
        const int64_t off = a * st[0] + b * st[1] + c * st[2];
        convert(src + static_cast<size_t>(off) * in_es, t.dtype(), dst + static_cast<size_t>(row * n) * out_es, acc, n);
      }
  return out;
}

// t as a kernel operand of dtype acc with H heads: t itself when the kernel can read it in place
// (dtype acc, 3-d or 4-d, unit stride along D), else a contiguous copy; `layout` says where its
// rows are.
Tensor operand(const Tensor& t_in, DType acc, int64_t H, kernels::HeadLayout& layout) {
  const Tensor t = t_in.detach();
  const bool unit = t.size(-1) <= 1 || t.stride(-1) == 1;
  if (t.dtype() == acc && unit && t.dim() == 4) {
    layout = {t.stride(0), t.stride(1), t.stride(2)};
    return t;
  }
  if (t.dtype() == acc && unit && t.dim() == 3 && H == 1) {
    layout = {t.stride(0), 0, t.stride(1)};
    return t;
  }
  Tensor d = to_dense(t, acc);
  layout = kernels::contiguous_heads(H, t.size(-2), t.size(-1));
  return d;
}

// q, k, v are the three (B, H, T, D) pieces of one (B, T, 3, H, D) buffer (a fused qkv
// projection split and viewed as heads).
bool is_packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || k.shape() != q.shape() || v.shape() != q.shape()) return false;
  if (q.storage() != k.storage() || q.storage() != v.storage() || q.dtype() != k.dtype() || q.dtype() != v.dtype()) return false;
  const int64_t H = q.size(1), T = q.size(2), D = q.size(3);
  const Shape want{T * 3 * H * D, D, 3 * H * D, 1};
  return q.strides() == want && k.strides() == want && v.strides() == want && k.offset() == q.offset() + H * D &&
         v.offset() == q.offset() + 2 * H * D;
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale_opt) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::scaled_dot_product_attention, [](const auto&... args) { return scaled_dot_product_attention(args...); }, q, k, v, causal, scale_opt);
  kernels::AttentionShape s = check_shapes(q, k, v, causal);
  // (D == 0: every score is 0 whatever the scale; 1, not 1/sqrt(0) = inf, which made 0 * inf = NaN.)
  const double scale = scale_opt.value_or(s.D > 0 ? 1.0 / std::sqrt(static_cast<double>(s.D)) : 1.0);
  // bf16 runs in bf16 on AMX tiles or AVX512-BF16 where the CPU has them (attention.h), else in f32.
  const bool native_bf16 = q.dtype() == kBFloat16 && k.dtype() == kBFloat16 && v.dtype() == kBFloat16 &&
                           kernels::attention_bf16_native();
  const DType acc = q.dtype() == kFloat64 ? kFloat64 : native_bf16 ? kBFloat16 : kFloat32;
  // (B, H, T, D) operands: 4-d tensors keep their heads; others are (BH, 1, T, D).
  s.H = q.dim() == 4 ? q.size(1) : 1;
  const Tensor qc = operand(q, acc, s.H, s.q), kc = operand(k, acc, s.H, s.k), vc = operand(v, acc, s.H, s.v);
  Shape oshape = q.shape();
  oshape.back() = s.Dv;
  // A 4-d output is stored (B, T, H, Dv), as PyTorch's CPU flash attention returns it: the usual
  // y.transpose(1, 2).contiguous().view(B, T, H * Dv) that follows is then free.
  Tensor out;
  if (q.dim() == 4) {
    const int64_t H = s.H, T = s.T, Dv = s.Dv;
    out = empty_strided(oshape, {T * H * Dv, Dv, H * Dv, 1}, acc);
    s.out = {T * H * Dv, Dv, H * Dv};
  } else {
    out = empty(oshape, acc);
    s.out = kernels::contiguous_heads(s.H, s.T, s.Dv);
  }
  Tensor lse = empty({s.BH * s.T}, acc == kFloat64 ? kFloat64 : kFloat32);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kernels::attention_forward<T>(static_cast<const T*>(qc.data_ptr()), static_cast<const T*>(kc.data_ptr()),
                                  static_cast<const T*>(vc.data_ptr()), static_cast<T*>(out.data_ptr()),
                                  static_cast<T*>(lse.data_ptr()), s, static_cast<T>(scale));
  };
  if (acc == kFloat64) {
    run(double{});
  } else if (acc == kBFloat16) {
    kernels::attention_forward_bf16(static_cast<const uint16_t*>(qc.data_ptr()), static_cast<const uint16_t*>(kc.data_ptr()),
                                    static_cast<const uint16_t*>(vc.data_ptr()), static_cast<uint16_t*>(out.data_ptr()),
                                    lse.data_ptr<float>(), s, static_cast<float>(scale));
  } else {
    run(float{});
  }
  Tensor result;
  if (q.dtype() != acc) {  // same strides, so one conversion over the dense buffer
    result = empty_strided(out.shape(), out.strides(), q.dtype());
    convert(out.data_ptr(), acc, result.data_ptr(), q.dtype(), out.numel());
  } else {
    result = make_view(out, out.shape(), out.strides(), out.offset());
  }
  const bool packed = is_packed_qkv(q, k, v);
  record("ScaledDotProductAttentionBackward", {q, k, v}, {result},
         [qc, kc, vc, out, lse, s, scale, packed, dq_t = q.dtype(), qs = q.shape(), ks = k.shape(), vs = v.shape(),
          q_strides = q.strides()](const G& g) {
           const DType acc = qc.dtype();
           kernels::AttentionShape sb = s;
           const Tensor go = operand(g[0], acc, s.H, sb.dout);
           // Gradients: for q, k, v packed in one (B, T, 3, H, D) projection, one buffer of that
           // layout (the split's backward then passes it on whole, no copy); else contiguous.
           Tensor dq, dk, dv, packed_buf;
           if (packed) {
             const int64_t B = qs[0], H = qs[1], T = qs[2], D = qs[3];
             packed_buf = empty({B, T, 3 * H * D}, acc);
             dq = make_view(packed_buf, qs, q_strides, 0);
             dk = make_view(packed_buf, ks, q_strides, H * D);
             dv = make_view(packed_buf, vs, q_strides, 2 * H * D);
             sb.dq = sb.dk = sb.dv = {T * 3 * H * D, D, 3 * H * D};
           } else {
             dq = empty(qs, acc), dk = empty(ks, acc), dv = empty(vs, acc);
             sb.dq = kernels::contiguous_heads(s.H, s.T, s.D);
             sb.dk = kernels::contiguous_heads(s.H, s.S, s.D);
             sb.dv = kernels::contiguous_heads(s.H, s.S, s.Dv);
           }
           auto run = [&](auto tag) {
             using T = decltype(tag);
             kernels::attention_backward<T>(
                 static_cast<const T*>(qc.data_ptr()), static_cast<const T*>(kc.data_ptr()),
                 static_cast<const T*>(vc.data_ptr()), static_cast<const T*>(out.data_ptr()),
                 static_cast<const T*>(lse.data_ptr()), static_cast<const T*>(go.data_ptr()), static_cast<T*>(dq.data_ptr()),
                 static_cast<T*>(dk.data_ptr()), static_cast<T*>(dv.data_ptr()), sb, static_cast<T>(scale));
           };
           if (acc == kFloat64) {
             run(double{});
           } else if (acc == kBFloat16) {
             kernels::attention_backward_bf16(
                 static_cast<const uint16_t*>(qc.data_ptr()), static_cast<const uint16_t*>(kc.data_ptr()),
                 static_cast<const uint16_t*>(vc.data_ptr()), static_cast<const uint16_t*>(out.data_ptr()),
                 lse.data_ptr<float>(), static_cast<const uint16_t*>(go.data_ptr()),
                 static_cast<uint16_t*>(dq.data_ptr()), static_cast<uint16_t*>(dk.data_ptr()),
                 static_cast<uint16_t*>(dv.data_ptr()), sb, static_cast<float>(scale));
           } else {
             run(float{});
           }
           if (dq_t == acc) return G{dq, dk, dv};
           if (packed) {  // one conversion of the whole buffer
             Tensor low = empty(packed_buf.shape(), dq_t);
             convert(packed_buf.data_ptr(), acc, low.data_ptr(), dq_t, packed_buf.numel());
             return G{make_view(low, qs, q_strides, 0), make_view(low, ks, q_strides, dk.offset()),
                      make_view(low, vs, q_strides, dv.offset())};
           }
           return G{dq.to(dq_t), dk.to(dq_t), dv.to(dq_t)};
         }, {qc, kc, vc, out});
  return result;
}

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                              std::optional<double> scale_opt) {
  const kernels::AttentionShape s = check_shapes(q, k, v, causal);
  // (D == 0: every score is 0 whatever the scale; 1, not 1/sqrt(0) = inf, which made 0 * inf = NaN.)
  const double scale = scale_opt.value_or(s.D > 0 ? 1.0 / std::sqrt(static_cast<double>(s.D)) : 1.0);
  Tensor scores = mul(matmul(q, k.transpose(-1, -2)), scale);
  if (causal) {
    Tensor above = empty({s.T, s.S}, kBool);
    bool* p = above.data_ptr<bool>();
    for (int64_t i = 0; i < s.T; ++i)
      for (int64_t j = 0; j < s.S; ++j) p[i * s.S + j] = j > i;
    scores = masked_fill(scores, above, -INFINITY);
  }
  return matmul(softmax(scores, -1), v);
}

}  // namespace tandem::ops
