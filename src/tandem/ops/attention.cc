#include "tandem/ops/attention.h"

#include <cmath>

#include "tandem/amp/policy.h"
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

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale_opt) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::scaled_dot_product_attention, [](const auto&... args) { return scaled_dot_product_attention(args...); }, q, k, v, causal, scale_opt);
  const kernels::AttentionShape s = check_shapes(q, k, v, causal);
  const double scale = scale_opt.value_or(1.0 / std::sqrt(static_cast<double>(s.D)));
  const DType acc = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const Tensor qc = q.detach().to(acc).contiguous(), kc = k.detach().to(acc).contiguous(), vc = v.detach().to(acc).contiguous();
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
  Tensor result = out.to(q.dtype());
  if (result.is_same(out)) result = make_view(out, out.shape(), out.strides(), out.offset());
  record("ScaledDotProductAttentionBackward", {q, k, v}, {result},
         [qc, kc, vc, out, lse, s, scale, dq_t = q.dtype(), qs = q.shape(), ks = k.shape(), vs = v.shape()](const G& g) {
           const DType acc = qc.dtype();
           const Tensor go = g[0].to(acc).contiguous();
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
