#include "tandem/kernels/cpu/channel_math.h"

// No fused multiply-add contraction: these loops are memory-bound, and with separate roundings
// the results equal the scalar code's bit for bit on every CPU (an FMA here changed W2's eval
// logits after 5 AdamW steps by 7e-4 of their scale against PyTorch, from 5e-5).
#pragma GCC optimize("fp-contract=off")

namespace tandem::kernels {
namespace {

// Element i as f32: an f32 input as is, a bf16 one widened exactly by its own conversion (half.h:
// its bits are the top half of the f32's), in registers: the loops vectorise it into a
// zero-extend and a shift.
template <class In>
inline float ld(const In* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// C == 1 (a run of one NCHW channel): 16 independent partial sums, so the loop vectorises; they
// are folded at the end of the block.
constexpr int kLanes = 16;

#define TANDEM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

template <class In>
TANDEM_CLONES void sum_rows(const In* __restrict u, int64_t rows, int64_t C, float* __restrict acc) {
  if (C == 1) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += ld(u, i + l);
    float s = 0;
    for (; i < rows; ++i) s += ld(u, i);
    for (int l = 0; l < kLanes; ++l) s += part[l];
    acc[0] += s;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const In* row = u + r * C;
    for (int64_t c = 0; c < C; ++c) acc[c] += ld(row, c);
  }
}

template <class In>
TANDEM_CLONES void sum_sq_dev_rows(const In* __restrict x, int64_t rows, int64_t C, const float* __restrict m,
                                   float* __restrict acc) {
  if (C == 1) {
    const float mu = m[0];
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float d = ld(x, i + l) - mu;
        part[l] += d * d;
      }
    float s = 0;
    for (; i < rows; ++i) s += (ld(x, i) - mu) * (ld(x, i) - mu);
    for (int l = 0; l < kLanes; ++l) s += part[l];
    acc[0] += s;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const In* row = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float d = ld(row, c) - m[c];
      acc[c] += d * d;
    }
  }
}

// The mask is a select on loaded values, not a branch (about half the lanes are masked, at random):
// g is loaded whatever the mask says, so the loop has no control flow to vectorise around.
template <bool kMask, class In>
TANDEM_CLONES void sum_grad_rows(const In* __restrict g, const In* __restrict y, const In* __restrict x,
                                 int64_t rows, int64_t C, const float* __restrict m, float* __restrict sg,
                                 float* __restrict sgx) {
  if (C == 1) {
    const float mu = m[0];
    float pg[kLanes] = {}, pgx[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float gl = ld(g, i + l);
        const float gv = kMask ? (!(ld(y, i + l) <= 0.0f) ? gl : 0.0f) : gl;  // NaN passes, as PyTorch's
        pg[l] += gv;
        pgx[l] += gv * (ld(x, i + l) - mu);
      }
    float a = 0, b = 0;
    for (; i < rows; ++i) {
      const float gl = ld(g, i);
      const float gv = kMask ? (!(ld(y, i) <= 0.0f) ? gl : 0.0f) : gl;
      a += gv;
      b += gv * (ld(x, i) - mu);
    }
    for (int l = 0; l < kLanes; ++l) {
      a += pg[l];
      b += pgx[l];
    }
    sg[0] += a;
    sgx[0] += b;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const In* gr = g + r * C;
    const In* yr = kMask ? y + r * C : nullptr;
    const In* xr = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float gl = ld(gr, c);
      const float gv = kMask ? (!(ld(yr, c) <= 0.0f) ? gl : 0.0f) : gl;  // NaN passes, as above
      sg[c] += gv;
      sgx[c] += gv * (ld(xr, c) - m[c]);
    }
  }
}

template <bool kMask, bool kV, bool kRelu, class In>
TANDEM_CLONES void affine_rows(float* __restrict out, const In* __restrict u, const In* __restrict y,
                               const In* __restrict v, int64_t rows, int64_t C, const float* __restrict ku,
                               const float* __restrict kv, const float* __restrict k0) {
  if (C == 1) {
    const float a = ku[0], b = kV ? kv[0] : 0.0f, z = k0[0];
    for (int64_t i = 0; i < rows; ++i) {
      const float ul = ld(u, i);
      const float uv = kMask ? (!(ld(y, i) <= 0.0f) ? ul : 0.0f) : ul;
      float r = a * uv;
      if constexpr (kV) r += b * ld(v, i);
      r += z;
      out[i] = kRelu ? (!(r <= 0.0f) ? r : 0.0f) : r;  // NaN passes, as PyTorch's relu
    }
    return;
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t base = row * C;
    for (int64_t c = 0; c < C; ++c) {
      const float ul = ld(u, base + c);
      const float uv = kMask ? (!(ld(y, base + c) <= 0.0f) ? ul : 0.0f) : ul;
      float r = ku[c] * uv;
      if constexpr (kV) r += kv[c] * ld(v, base + c);
      r += k0[c];
      out[base + c] = kRelu ? (!(r <= 0.0f) ? r : 0.0f) : r;
    }
  }
}

template <class In>
void sum_grad(const In* g, const In* y, const In* x, int64_t rows, int64_t C, const float* m, float* sg, float* sgx) {
  if (y) sum_grad_rows<true>(g, y, x, rows, C, m, sg, sgx);
  else sum_grad_rows<false>(g, y, x, rows, C, m, sg, sgx);
}

template <class In>
void affine(float* out, const In* u, const In* y, const In* v, int64_t rows, int64_t C, const float* ku,
            const float* kv, const float* k0, bool relu) {
  auto go = [&](auto fn) { fn(out, u, y, v, rows, C, ku, kv, k0); };
  if (y) {
    if (v) relu ? go(affine_rows<true, true, true, In>) : go(affine_rows<true, true, false, In>);
    else relu ? go(affine_rows<true, false, true, In>) : go(affine_rows<true, false, false, In>);
  } else {
    if (v) relu ? go(affine_rows<false, true, true, In>) : go(affine_rows<false, true, false, In>);
    else relu ? go(affine_rows<false, false, true, In>) : go(affine_rows<false, false, false, In>);
  }
}

}  // namespace

void channel_sum(const float* u, int64_t rows, int64_t C, float* acc) { sum_rows(u, rows, C, acc); }
void channel_sum(const bfloat16* u, int64_t rows, int64_t C, float* acc) { sum_rows(u, rows, C, acc); }

void channel_sum_sq_dev(const float* x, int64_t rows, int64_t C, const float* m, float* acc) {
  sum_sq_dev_rows(x, rows, C, m, acc);
}
void channel_sum_sq_dev(const bfloat16* x, int64_t rows, int64_t C, const float* m, float* acc) {
  sum_sq_dev_rows(x, rows, C, m, acc);
}

void channel_sum_grad(const float* g, const float* y, const float* x, int64_t rows, int64_t C, const float* m,
                      float* sg, float* sgx) {
  sum_grad(g, y, x, rows, C, m, sg, sgx);
}
void channel_sum_grad(const bfloat16* g, const bfloat16* y, const bfloat16* x, int64_t rows, int64_t C,
                      const float* m, float* sg, float* sgx) {
  sum_grad(g, y, x, rows, C, m, sg, sgx);
}

void channel_affine(float* out, const float* u, const float* y, const float* v, int64_t rows, int64_t C,
                    const float* ku, const float* kv, const float* k0, bool relu) {
  affine(out, u, y, v, rows, C, ku, kv, k0, relu);
}
void channel_affine(float* out, const bfloat16* u, const bfloat16* y, const bfloat16* v, int64_t rows, int64_t C,
                    const float* ku, const float* kv, const float* k0, bool relu) {
  affine(out, u, y, v, rows, C, ku, kv, k0, relu);
}

}  // namespace tandem::kernels
