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
  return {q.numel() / std::max<int64_t>(T * q.size(-1), 1), T, S, q.size(-1), v.size(-1), causal};
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

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale_opt) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::scaled_dot_product_attention, [](const auto&... args) { return scaled_dot_product_attention(args...); }, q, k, v, causal, scale_opt);
  const kernels::AttentionShape s = check_shapes(q, k, v, causal);
  const double scale = scale_opt.value_or(1.0 / std::sqrt(static_cast<double>(s.D)));
  const DType acc = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const Tensor qc = to_dense(q, acc), kc = to_dense(k, acc), vc = to_dense(v, acc);
  Shape oshape = q.shape();
  oshape.back() = s.Dv;
  Tensor out = empty(oshape, acc);
  Tensor lse = empty({s.BH * s.T}, acc);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kernels::attention_forward<T>(static_cast<const T*>(qc.data_ptr()), static_cast<const T*>(kc.data_ptr()),
                                  static_cast<const T*>(vc.data_ptr()), static_cast<T*>(out.data_ptr()),
                                  static_cast<T*>(lse.data_ptr()), s, static_cast<T>(scale));
  };
  if (acc == kFloat64) run(double{});
  else run(float{});
  Tensor result;
  if (q.dtype() != acc && out.dim() == 4) {
    // (B, H, T, Dv) stored as (B, T, H, Dv), as PyTorch's CPU flash attention returns it: the
    // usual y.transpose(1, 2).contiguous().view(B, T, H * Dv) that follows is then free.
    const int64_t B = out.size(0), H = out.size(1), T = out.size(2), Dv = out.size(3);
    result = empty_strided(out.shape(), {T * H * Dv, Dv, H * Dv, 1}, q.dtype());
    const float* po = out.data_ptr<float>();
    char* pr = static_cast<char*>(result.data_ptr());
    const size_t es = result.element_size();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t)
          convert(po + ((b * H + h) * T + t) * Dv, kFloat32, pr + static_cast<size_t>(((b * T + t) * H + h) * Dv) * es,
                  q.dtype(), Dv);
  } else {
    result = out.to(q.dtype());
    if (result.is_same(out)) result = make_view(out, out.shape(), out.strides(), out.offset());
  }
  record("ScaledDotProductAttentionBackward", {q, k, v}, {result},
         [qc, kc, vc, out, lse, s, scale, dq_t = q.dtype(), qs = q.shape(), ks = k.shape(), vs = v.shape()](const G& g) {
           const DType acc = qc.dtype();
           const Tensor go = to_dense(g[0], acc);
           Tensor dq = empty(qs, acc), dk = empty(ks, acc), dv = empty(vs, acc);
           auto run = [&](auto tag) {
             using T = decltype(tag);
             kernels::attention_backward<T>(
                 static_cast<const T*>(qc.data_ptr()), static_cast<const T*>(kc.data_ptr()),
                 static_cast<const T*>(vc.data_ptr()), static_cast<const T*>(out.data_ptr()),
                 static_cast<const T*>(lse.data_ptr()), static_cast<const T*>(go.data_ptr()), static_cast<T*>(dq.data_ptr()),
                 static_cast<T*>(dk.data_ptr()), static_cast<T*>(dv.data_ptr()), s, static_cast<T>(scale));
           };
           if (acc == kFloat64) run(double{});
           else run(float{});
           return G{dq.to(dq_t), dk.to(dq_t), dv.to(dq_t)};
         });
  return result;
}

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                              std::optional<double> scale_opt) {
  const kernels::AttentionShape s = check_shapes(q, k, v, causal);
  const double scale = scale_opt.value_or(1.0 / std::sqrt(static_cast<double>(s.D)));
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
