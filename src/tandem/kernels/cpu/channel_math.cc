#include "tandem/kernels/cpu/channel_math.h"

// No fused multiply-add contraction: these loops are memory-bound, and with separate roundings
// the results equal the scalar code's bit for bit on every CPU (an FMA here changed W2's eval
// logits after 5 AdamW steps by 7e-4 of their scale against PyTorch, from 5e-5).
#pragma GCC optimize("fp-contract=off")

namespace tandem::kernels {
namespace {

// C == 1 (a run of one NCHW channel): 16 independent partial sums, so the loop vectorises; they
// are folded at the end of the block.
constexpr int kLanes = 16;

#define TANDEM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

TANDEM_CLONES void sum_rows(const float* __restrict u, int64_t rows, int64_t C, float* __restrict acc) {
  if (C == 1) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += u[i + l];
    float s = 0;
    for (; i < rows; ++i) s += u[i];
    for (int l = 0; l < kLanes; ++l) s += part[l];
    acc[0] += s;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = u + r * C;
    for (int64_t c = 0; c < C; ++c) acc[c] += row[c];
  }
}

TANDEM_CLONES void sum_sq_dev_rows(const float* __restrict x, int64_t rows, int64_t C, const float* __restrict m,
                                   float* __restrict acc) {
  if (C == 1) {
    const float mu = m[0];
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float d = x[i + l] - mu;
        part[l] += d * d;
      }
    float s = 0;
    for (; i < rows; ++i) s += (x[i] - mu) * (x[i] - mu);
    for (int l = 0; l < kLanes; ++l) s += part[l];
    acc[0] += s;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float d = row[c] - m[c];
      acc[c] += d * d;
    }
  }
}

// The mask is a select on loaded values, not a branch (about half the lanes are masked, at random).
template <bool kMask>
TANDEM_CLONES void sum_grad_rows(const float* __restrict g, const float* __restrict y, const float* __restrict x,
                                 int64_t rows, int64_t C, const float* __restrict m, float* __restrict sg,
                                 float* __restrict sgx) {
  if (C == 1) {
    const float mu = m[0];
    float pg[kLanes] = {}, pgx[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= rows; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float gv = kMask ? (y[i + l] > 0.0f ? g[i + l] : 0.0f) : g[i + l];
        pg[l] += gv;
        pgx[l] += gv * (x[i + l] - mu);
      }
    float a = 0, b = 0;
    for (; i < rows; ++i) {
      const float gv = kMask ? (y[i] > 0.0f ? g[i] : 0.0f) : g[i];
      a += gv;
      b += gv * (x[i] - mu);
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
    const float* gr = g + r * C;
    const float* yr = kMask ? y + r * C : nullptr;
    const float* xr = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float gv = kMask ? (yr[c] > 0.0f ? gr[c] : 0.0f) : gr[c];
      sg[c] += gv;
      sgx[c] += gv * (xr[c] - m[c]);
    }
  }
}

template <bool kMask, bool kV, bool kRelu>
TANDEM_CLONES void affine_rows(float* __restrict out, const float* __restrict u, const float* __restrict y,
                               const float* __restrict v, int64_t rows, int64_t C, const float* __restrict ku,
                               const float* __restrict kv, const float* __restrict k0) {
  if (C == 1) {
    const float a = ku[0], b = kV ? kv[0] : 0.0f, z = k0[0];
    for (int64_t i = 0; i < rows; ++i) {
      const float uv = kMask ? (y[i] > 0.0f ? u[i] : 0.0f) : u[i];
      float r = a * uv;
      if constexpr (kV) r += b * v[i];
      r += z;
      out[i] = kRelu ? (r > 0.0f ? r : 0.0f) : r;
    }
    return;
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t base = row * C;
    for (int64_t c = 0; c < C; ++c) {
      const float uv = kMask ? (y[base + c] > 0.0f ? u[base + c] : 0.0f) : u[base + c];
      float r = ku[c] * uv;
      if constexpr (kV) r += kv[c] * v[base + c];
      r += k0[c];
      out[base + c] = kRelu ? (r > 0.0f ? r : 0.0f) : r;
    }
  }
}

}  // namespace

void channel_sum_f32(const float* u, int64_t rows, int64_t C, float* acc) { sum_rows(u, rows, C, acc); }

void channel_sum_sq_dev_f32(const float* x, int64_t rows, int64_t C, const float* m, float* acc) {
  sum_sq_dev_rows(x, rows, C, m, acc);
}

void channel_sum_grad_f32(const float* g, const float* y, const float* x, int64_t rows, int64_t C, const float* m,
                          float* sg, float* sgx) {
  if (y) sum_grad_rows<true>(g, y, x, rows, C, m, sg, sgx);
  else sum_grad_rows<false>(g, y, x, rows, C, m, sg, sgx);
}

void channel_affine_f32(float* out, const float* u, const float* y, const float* v, int64_t rows, int64_t C,
                        const float* ku, const float* kv, const float* k0, bool relu) {
  auto go = [&](auto fn) { fn(out, u, y, v, rows, C, ku, kv, k0); };
  if (y) {
    if (v) relu ? go(affine_rows<true, true, true>) : go(affine_rows<true, true, false>);
    else relu ? go(affine_rows<true, false, true>) : go(affine_rows<true, false, false>);
  } else {
    if (v) relu ? go(affine_rows<false, true, true>) : go(affine_rows<false, true, false>);
    else relu ? go(affine_rows<false, false, true>) : go(affine_rows<false, false, false>);
  }
}

}  // namespace tandem::kernels
