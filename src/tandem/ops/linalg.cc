// matmul and linear, with their backward beside them. Transposes are strided views handed to
// oneDNN, never copies.
#include "tandem/ops/linalg.h"

#include <algorithm>

#include "tandem/amp/policy.h"
#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/channel_math.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/kernels/cpu/reduce.h"
#include "tandem/kernels/cpu/row_math.h"
#include "tandem/core/convert.h"
#include "tandem/ops/elementwise.h"

namespace tandem::ops {

using autograd::record;
using G = std::vector<Tensor>;

namespace {

void check_pair(const Tensor& a, const Tensor& b, const char* op) {
  TANDEM_CHECK(a.dtype() == b.dtype(), DTypeError, "{}: expected both operands to have the same dtype, got {} and {}", op,
               dtype_name(a.dtype()), dtype_name(b.dtype()));
  TANDEM_CHECK(is_floating(a.dtype()), DTypeError, "{}: expected floating-point operands, got {}", op,
               dtype_name(a.dtype()));
}

// (M, K) @ (K, N) on 2-d views, no autograd.
Tensor mm_raw(const Tensor& a, const Tensor& b) {
  return kernels::gemm(a.unsqueeze(0), b.unsqueeze(0), Tensor(), a.dtype()).squeeze(0);
}

// Bias gradient of linear: the column sums of g2 (M, N). 16-bit gradients: rows widened to f32
// and added into an f32 accumulator row by row, folded into f64 every 4096 rows (kernels::sum's
// order and precision for these dtypes, vectorised); other dtypes through sum_to.
Tensor bias_grad(const Tensor& g2, int64_t N) {
  if (!is_reduced_float(g2.dtype()) || !g2.is_contiguous()) return sum_to(g2, {N});
  using kernels::kFoldEvery;
  const int64_t M = g2.size(0);
  std::vector<float> acc(static_cast<size_t>(N));
  std::vector<double> total(static_cast<size_t>(N), 0.0);
  std::vector<float> row(static_cast<size_t>(N));
  const char* p = static_cast<const char*>(g2.data_ptr());
  const size_t es = g2.element_size();
  for (int64_t r0 = 0; r0 < M; r0 += kFoldEvery) {
    const int64_t rows = std::min(kFoldEvery, M - r0);
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (g2.dtype() == kBFloat16 && N > 1) {
      // The same sums in the same order (each column row by row), each row widened in registers.
      kernels::channel_sum(reinterpret_cast<const bfloat16*>(p + static_cast<size_t>(r0 * N) * es), rows, N, acc.data());
    } else {
      for (int64_t r = r0; r < r0 + rows; ++r) {
        convert(p + static_cast<size_t>(r * N) * es, g2.dtype(), row.data(), kFloat32, N);
        kernels::add_into_f32(acc.data(), row.data(), N);
      }
    }
    for (int64_t c = 0; c < N; ++c) total[c] += static_cast<double>(acc[c]);
  }
  for (int64_t c = 0; c < N; ++c) acc[c] = static_cast<float>(total[c]);
  Tensor out = empty({N}, g2.dtype());
  convert(acc.data(), kFloat32, out.data_ptr(), g2.dtype(), N);
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::matmul, [](const auto&... args) { return matmul(args...); }, a, b);
  check_pair(a, b, "matmul");
  TANDEM_CHECK(a.dim() >= 1 && b.dim() >= 1, ShapeError, "matmul: both operands need at least 1 dim, got {} and {}",
               shape_str(a.shape()), shape_str(b.shape()));
  // Vectors become matrices, and the added dims are dropped from the result. The inner sizes
  // are checked here so that the error names the caller's shapes, not the promoted ones.
  if (a.dim() == 1 || b.dim() == 1) {
    const int64_t kb = b.dim() == 1 ? b.size(0) : b.size(-2);
    TANDEM_CHECK(a.size(-1) == kb, ShapeError, "matmul: shapes {} and {} cannot be multiplied (inner sizes {} and {})",
                 shape_str(a.shape()), shape_str(b.shape()), a.size(-1), kb);
    const Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;
    const Tensor b2 = b.dim() == 1 ? b.unsqueeze(-1) : b;
    Tensor r = matmul(a2, b2);
    if (b.dim() == 1) r = r.squeeze(-1);
    if (a.dim() == 1) r = r.squeeze(a2.dim() == 2 && b.dim() == 1 ? 0 : -2);
    return r;
  }
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  TANDEM_CHECK(b.size(-2) == K, ShapeError, "matmul: shapes {} and {} cannot be multiplied ({}x{} and {}x{})",
               shape_str(a.shape()), shape_str(b.shape()), M, K, b.size(-2), N);
  const Shape ab(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  const Shape batch = kernels::broadcast_shapes(ab, bb, "matmul");
  const int64_t B = shape_numel(batch);
  Shape ea = batch, eb = batch;
  ea.insert(ea.end(), {M, K});
  eb.insert(eb.end(), {K, N});
  // Broadcast and flatten batch dims (copies only when a batch dim is broadcast or strided).
  auto as3 = [&](const Tensor& t, const Shape& e, int64_t r, int64_t c) {
    Tensor x = t.detach();
    if (x.shape() != e) x = x.expand(e);
    return x.dim() == 3 ? x : x.reshape({B, r, c});
  };
  Tensor out = kernels::gemm(as3(a, ea, M, K), as3(b, eb, K, N), Tensor(), a.dtype());
  Shape oshape = batch;
  oshape.insert(oshape.end(), {M, N});
  out = out.view(oshape);
  out = make_view(out, out.shape(), out.strides(), out.offset());
  record("MatmulBackward", {a, b}, {out}, [a = a.detach(), b = b.detach(), ra = a.requires_grad(), rb = b.requires_grad()](const G& g) {
    Tensor ga, gb;
    if (ra) ga = sum_to(matmul(g[0], b.transpose(-1, -2)), a.shape());
    if (rb) gb = sum_to(matmul(a.transpose(-1, -2), g[0]), b.shape());
    return G{ga, gb};
  }, {b.requires_grad() ? a : Tensor(), a.requires_grad() ? b : Tensor()});
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::linear, [](const auto&... args) { return linear(args...); }, x, weight, bias);
  check_pair(x, weight, "linear");
  TANDEM_CHECK(weight.dim() == 2, ShapeError, "linear: weight must be 2-d (out_features, in_features), got {}",
               shape_str(weight.shape()));
  TANDEM_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), ShapeError,
               "linear: input of shape {} has {} features, weight {} expects {}", shape_str(x.shape()),
               x.dim() ? x.size(-1) : 0, shape_str(weight.shape()), weight.size(1));
  if (bias.defined()) {
    TANDEM_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), ShapeError,
                 "linear: bias of shape {} for weight {} (expected [{}])", shape_str(bias.shape()),
                 shape_str(weight.shape()), weight.size(0));
  }
  const int64_t in = weight.size(1), outf = weight.size(0);
  // (M from the batch dims, not -1: with in == 0 reshape could not infer it.)
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  const Tensor x2 = x.detach().reshape({rows, in});
  const int64_t M = x2.size(0);
  // y = x W^T (+ b): W^T is W's transposed view, bias added by oneDNN in the same pass.
  Tensor y = kernels::gemm(x2.unsqueeze(0), weight.detach().t().unsqueeze(0), bias.defined() ? bias.detach() : Tensor(),
                           x.dtype());
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(outf);
  Tensor out = make_view(y, oshape, contiguous_strides(oshape), 0);
  const bool rx = x.requires_grad(), rw = weight.requires_grad(), rb = bias.defined() && bias.requires_grad();
  std::vector<Tensor> inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  record("LinearBackward", inputs, {out}, [x2, w = weight.detach(), xshape = x.shape(), rx, rw, rb, has_bias = bias.defined(), M, outf](const G& g) {
    const Tensor g2 = g[0].reshape({M, outf});
    G grads(has_bias ? 3 : 2);
    if (rx) grads[0] = mm_raw(g2, w).view(xshape);     // (M, out) @ (out, in)
    if (rw) {                                          // (out, M) @ (M, in)
      // Straight into the weight's gradient destination when one is offered (a DDP bucket slot).
      if (Tensor d = autograd::take_output_destination(1, w.shape(), g2.dtype()); d.defined()) {
        Tensor c = d.view({1, outf, w.size(1)});
        kernels::gemm_into(g2.t().unsqueeze(0), x2.unsqueeze(0), Tensor(), c);
        grads[1] = d;
      } else if (Tensor r = g2.dtype() == kBFloat16 ? autograd::take_rounded_output_destination(1, w.shape(), kBFloat16)
                                                    : Tensor();
                 r.defined()) {
        // Autocast's bf16 copy of an f32 weight: the bf16 product is written widened into the
        // f32 weight's destination in one pass, and the cast back passes it through.
        Tensor c = r.view({1, outf, w.size(1)});
        kernels::gemm_into_rounded_bf16(g2.t().unsqueeze(0), x2.unsqueeze(0), c);
        grads[1] = r;
      } else {
        grads[1] = mm_raw(g2.t(), x2);
      }
    }
    if (rb) grads[2] = bias_grad(g2, outf);
    return grads;
  }, {rw ? x2 : Tensor(), rx ? weight : Tensor()});
  return out;
}

}  // namespace tandem::ops
