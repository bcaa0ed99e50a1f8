#include "tandem/kernels/cpu/row_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tandem/core/cpu_features.h"
#include "tandem/kernels/cpu/vec_math.h"

// GCC 12's avx512fintrin.h seeds some intrinsics (reductions, masked ops) with an "undefined"
// register and then warns about it being uninitialised in every caller: a header false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tandem::kernels {
namespace {

bool use_avx512() {
  static const bool yes = cpu_features().avx512f;
  return yes;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- AVX-512 bodies ---------------------------------------------------------------------------

#define TANDEM_AVX512 __attribute__((target("avx512f")))

// exp_approx (vec_math.h) on 16 lanes: the same clamp, Cody-Waite reduction and polynomial.
// The clamp keeps NaN (max/min return their second operand when either is NaN).
TANDEM_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

TANDEM_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

TANDEM_AVX512 void zero_tail_avx512(float* row, int64_t n, int64_t width) {
  for (int64_t j = n; j < width; j += 16) _mm512_mask_storeu_ps(row + j, tail_mask(width - j), _mm512_setzero_ps());
}

TANDEM_AVX512 float softmax_row_avx512(float* row, int64_t n, int64_t width, float scale) {
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    mx = _mm512_mask_max_ps(mx, k, mx, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + j), vs));
  }
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, row + j), vs, vm));
    acc = _mm512_mask_add_ps(acc, k, acc, e);
    _mm512_mask_storeu_ps(row + j, k, e);
  }
  const float l = _mm512_reduce_add_ps(acc);
  const __m512 inv = _mm512_set1_ps(1.0f / l);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    _mm512_mask_storeu_ps(row + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + j), inv));
  }
  zero_tail_avx512(row, n, width);
  return m + std::log(l);
}

TANDEM_AVX512 void exp_shifted_row_avx512(float* row, int64_t n, int64_t width, float scale, float lse) {
  const __m512 vs = _mm512_set1_ps(scale), vl = _mm512_set1_ps(lse);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    _mm512_mask_storeu_ps(row + j, k, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, row + j), vs, vl)));
  }
  zero_tail_avx512(row, n, width);
}

TANDEM_AVX512 void softmax_grad_row_avx512(float* ds, const float* p, int64_t n, float delta, float scale) {
  const __m512 vd = _mm512_set1_ps(delta), vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, ds + j), vd);
    _mm512_mask_storeu_ps(ds + j, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + j), d), vs));
  }
}

TANDEM_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + j), _mm512_maskz_loadu_ps(k, b + j), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

TANDEM_AVX512 void add_into_avx512(float* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    _mm512_mask_storeu_ps(dst + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, dst + j), _mm512_maskz_loadu_ps(k, src + j)));
  }
}

TANDEM_AVX512 void row_moments_avx512(const float* x, int64_t n, double eps, double& mean, double& rstd) {
  double s = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 256) {
    const int64_t j1 = std::min(n, j0 + 256);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j += 16) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(tail_mask(j1 - j), x + j));
    s += _mm512_reduce_add_ps(acc);
  }
  const double m = s / static_cast<double>(n);
  const __m512 vm = _mm512_set1_ps(static_cast<float>(m));
  double v = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 256) {
    const int64_t j1 = std::min(n, j0 + 256);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j += 16) {
      const __mmask16 k = tail_mask(j1 - j);
      const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + j), vm);
      acc = _mm512_fmadd_ps(d, d, acc);
    }
    v += _mm512_reduce_add_ps(acc);
  }
  mean = m;
  rstd = 1.0 / std::sqrt(v / static_cast<double>(n) + eps);
}

TANDEM_AVX512 void layer_norm_row_avx512(const float* x, float* y, int64_t n, float mean, float rstd, const float* w,
                                         const float* b) {
  const __m512 vm = _mm512_set1_ps(mean), vs = _mm512_set1_ps(rstd);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    __m512 r = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm), vs);
    if (w) r = _mm512_mul_ps(r, _mm512_maskz_loadu_ps(k, w + j));
    if (b) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(k, b + j));
    _mm512_mask_storeu_ps(y + j, k, r);
  }
}

TANDEM_AVX512 void layer_norm_backward_row_avx512(const float* x, const float* gy, float* gx, int64_t n, float mean,
                                                  float rstd, const float* w, float* gw, float* gb) {
  const __m512 vm = _mm512_set1_ps(mean), vs = _mm512_set1_ps(rstd);
  __m512 s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 g = _mm512_maskz_loadu_ps(k, gy + j);
    const __m512 xh = _mm512_mul_ps(_mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + j), vm), vs);
    const __m512 dxh = w ? _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, w + j)) : g;
    s1 = _mm512_add_ps(s1, dxh);
    s2 = _mm512_fmadd_ps(dxh, xh, s2);
    if (gw) _mm512_mask_storeu_ps(gw + j, k, _mm512_fmadd_ps(g, xh, _mm512_maskz_loadu_ps(k, gw + j)));
    if (gb) _mm512_mask_storeu_ps(gb + j, k, _mm512_add_ps(g, _mm512_maskz_loadu_ps(k, gb + j)));
  }
  const float inv_n = 1.0f / static_cast<float>(n);
  const __m512 m1 = _mm512_set1_ps(_mm512_reduce_add_ps(s1) * inv_n), m2 = _mm512_set1_ps(_mm512_reduce_add_ps(s2) * inv_n);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 g = _mm512_maskz_loadu_ps(k, gy + j);
    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm), vs);
    const __m512 dxh = w ? _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, w + j)) : g;
    const __m512 r = _mm512_mul_ps(vs, _mm512_sub_ps(_mm512_sub_ps(dxh, m1), _mm512_mul_ps(xh, m2)));
    _mm512_mask_storeu_ps(gx + j, k, r);
  }
}

TANDEM_AVX512 void add_into_f64_avx512(double* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm512_storeu_pd(dst + j, _mm512_add_pd(_mm512_loadu_pd(dst + j), _mm512_cvtps_pd(_mm256_loadu_ps(src + j))));
  for (; j < n; ++j) dst[j] += static_cast<double>(src[j]);
}

// GELU (tanh form) as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): one exp16 and one
// division per 16 lanes (the auto-vectorised loop split the exp's clamp into three divisions).
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

TANDEM_AVX512 void gelu_tanh_avx512(const float* x, float* y, int64_t n) {
  const __m512 m2k = _mm512_set1_ps(-2.0f * kGeluK), c = _mm512_set1_ps(kGeluC), one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(c, v), _mm512_mul_ps(v, v), v);  // v + c v^3
    const __m512 e = exp16(_mm512_mul_ps(m2k, inner));
    _mm512_mask_storeu_ps(y + j, m, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
}

TANDEM_AVX512 void gelu_tanh_backward_avx512(const float* g, const float* x, float* gx, int64_t n) {
  const __m512 m2k = _mm512_set1_ps(-2.0f * kGeluK), c = _mm512_set1_ps(kGeluC), one = _mm512_set1_ps(1.0f);
  const __m512 k = _mm512_set1_ps(kGeluK), c3 = _mm512_set1_ps(3.0f * kGeluC), two = _mm512_set1_ps(2.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    const __m512 v2 = _mm512_mul_ps(v, v);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(c, v), v2, v);
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_mul_ps(m2k, inner))));
    const __m512 du = _mm512_mul_ps(k, _mm512_fmadd_ps(c3, v2, one));                // u'
    const __m512 t = _mm512_mul_ps(_mm512_mul_ps(two, v), _mm512_mul_ps(s, _mm512_sub_ps(one, s)));
    const __m512 d = _mm512_fmadd_ps(t, du, s);                                        // s + 2 v s (1 - s) u'
    _mm512_mask_storeu_ps(gx + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + j), d));
  }
}

#undef TANDEM_AVX512

}  // namespace

// ---- dispatch + portable bodies ------------------------------------------------------------------

float softmax_row_f32(float* row, int64_t n, int64_t width, float scale) {
  if (n <= 0) {
    std::fill(row, row + width, 0.0f);
    return kNegInf;
  }
  if (use_avx512()) return softmax_row_avx512(row, n, width, scale);
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j] * scale);
  float l = 0;
  for (int64_t j = 0; j < n; ++j) {
    row[j] = exp_approx(row[j] * scale - m);
    l += row[j];
  }
  const float inv = 1.0f / l;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  std::fill(row + n, row + width, 0.0f);
  return m + std::log(l);
}

void exp_shifted_row_f32(float* row, int64_t n, int64_t width, float scale, float lse) {
  n = std::max<int64_t>(n, 0);
  if (use_avx512()) return exp_shifted_row_avx512(row, n, width, scale, lse);
  for (int64_t j = 0; j < n; ++j) row[j] = exp_approx(row[j] * scale - lse);
  std::fill(row + n, row + width, 0.0f);
}

void softmax_grad_row_f32(float* ds, const float* p, int64_t n, float delta, float scale) {
  if (use_avx512()) return softmax_grad_row_avx512(ds, p, n, delta, scale);
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta) * scale;
}

float dot_f32(const float* a, const float* b, int64_t n) {
  if (use_avx512()) return dot_avx512(a, b, n);
  float s = 0;
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

void add_into_f32(float* dst, const float* src, int64_t n) {
  if (use_avx512()) return add_into_avx512(dst, src, n);
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
}

void add_into_f64_f32(double* dst, const float* src, int64_t n) {
  if (use_avx512()) return add_into_f64_avx512(dst, src, n);
  for (int64_t j = 0; j < n; ++j) dst[j] += static_cast<double>(src[j]);
}

void row_moments_f32(const float* x, int64_t n, double eps, double& mean, double& rstd) {
  if (n > 0 && use_avx512()) return row_moments_avx512(x, n, eps, mean, rstd);
  double s = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 256) {
    float b = 0;
    for (int64_t j = j0; j < std::min(n, j0 + 256); ++j) b += x[j];
    s += b;
  }
  const double m = n > 0 ? s / static_cast<double>(n) : 0.0;
  const float mf = static_cast<float>(m);
  double v = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 256) {
    float b = 0;
    for (int64_t j = j0; j < std::min(n, j0 + 256); ++j) b += (x[j] - mf) * (x[j] - mf);
    v += b;
  }
  mean = m;
  rstd = 1.0 / std::sqrt(v / static_cast<double>(std::max<int64_t>(n, 1)) + eps);
}

void layer_norm_row_f32(const float* x, float* y, int64_t n, float mean, float rstd, const float* w, const float* b) {
  if (use_avx512()) return layer_norm_row_avx512(x, y, n, mean, rstd, w, b);
  for (int64_t j = 0; j < n; ++j) {
    float r = (x[j] - mean) * rstd;
    if (w) r *= w[j];
    if (b) r += b[j];
    y[j] = r;
  }
}

void layer_norm_backward_row_f32(const float* x, const float* gy, float* gx, int64_t n, float mean, float rstd,
                                 const float* w, float* gw, float* gb) {
  if (n > 0 && use_avx512()) return layer_norm_backward_row_avx512(x, gy, gx, n, mean, rstd, w, gw, gb);
  float s1 = 0, s2 = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float xh = (x[j] - mean) * rstd, dxh = w ? gy[j] * w[j] : gy[j];
    s1 += dxh;
    s2 += dxh * xh;
    if (gw) gw[j] += gy[j] * xh;
    if (gb) gb[j] += gy[j];
  }
  const float inv_n = 1.0f / static_cast<float>(std::max<int64_t>(n, 1));
  s1 *= inv_n;
  s2 *= inv_n;
  for (int64_t j = 0; j < n; ++j) {
    const float xh = (x[j] - mean) * rstd, dxh = w ? gy[j] * w[j] : gy[j];
    gx[j] = rstd * (dxh - s1 - xh * s2);
  }
}

void gelu_tanh_row_f32(const float* x, float* y, int64_t n) {
  if (use_avx512()) return gelu_tanh_avx512(x, y, n);
  for (int64_t j = 0; j < n; ++j) {
    // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation where tanh(u) is near -1.
    const float v = x[j];
    y[j] = v / (1.0f + exp_approx(-2.0f * kGeluK * (v + kGeluC * v * v * v)));
  }
}

void gelu_tanh_backward_row_f32(const float* g, const float* x, float* gx, int64_t n) {
  if (use_avx512()) return gelu_tanh_backward_avx512(g, x, gx, n);
  for (int64_t j = 0; j < n; ++j) {
    // With s = sigmoid(2u): dy/dx = s + 2 x s (1 - s) u'.
    const float v = x[j];
    const float s = 1.0f / (1.0f + exp_approx(-2.0f * kGeluK * (v + kGeluC * v * v * v)));
    const float du = kGeluK * (1.0f + 3.0f * kGeluC * v * v);
    gx[j] = g[j] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}

}  // namespace tandem::kernels
