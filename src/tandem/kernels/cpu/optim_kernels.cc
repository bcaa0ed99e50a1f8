#include "tandem/kernels/cpu/optim_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tandem/core/cpu_features.h"
#include "tandem/core/parallel.h"

#include <immintrin.h>

// GCC 12's avx512fintrin.h seeds masked intrinsics with an "undefined" register and then warns
// about it being uninitialised in every caller: a header false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tandem::kernels {
namespace {

constexpr int64_t kGrain = 1 << 16;

// The per-case loops are templated on the flags so that each compiles to a branch-free,
// vectorised body.
template <bool kMomentum, bool kNesterov, bool kFirst, bool kDecay, bool kMaximize>
__attribute__((target_clones("avx512f", "avx2", "default")))
void sgd_loop(float* __restrict p, const float* __restrict g, float* __restrict buf, int64_t n, float lr, float momentum,
              float one_minus_dampening, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    float d = kMaximize ? -g[i] : g[i];
    if constexpr (kDecay) d = d + wd * p[i];
    if constexpr (kMomentum) {
      const float b = kFirst ? d : buf[i] * momentum + one_minus_dampening * d;
      buf[i] = b;
      d = kNesterov ? d + momentum * b : b;
    }
    p[i] = p[i] + (-lr) * d;
  }
}

template <bool kMomentum, bool kNesterov, bool kFirst, bool kDecay>
void sgd_dispatch_maximize(float* p, const float* g, float* buf, int64_t n, const SgdParams& o) {
  auto run = [&](auto loop) { loop(p, g, buf, n, o.lr, o.momentum, o.one_minus_dampening, o.weight_decay); };
  if (o.maximize) run(sgd_loop<kMomentum, kNesterov, kFirst, kDecay, true>);
  else run(sgd_loop<kMomentum, kNesterov, kFirst, kDecay, false>);
}

template <bool kMomentum, bool kNesterov, bool kFirst>
void sgd_dispatch_decay(float* p, const float* g, float* buf, int64_t n, const SgdParams& o) {
  if (o.weight_decay != 0) sgd_dispatch_maximize<kMomentum, kNesterov, kFirst, true>(p, g, buf, n, o);
  else sgd_dispatch_maximize<kMomentum, kNesterov, kFirst, false>(p, g, buf, n, o);
}

template <bool kDecoupled, bool kDecay, bool kAmsgrad, bool kMaximize>
__attribute__((target_clones("avx512f", "avx2", "default")))
void adam_loop(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
               float* __restrict vmax, int64_t n, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
               float wd, float decay, float eps, float bc2_sqrt, float neg_step) {
  for (int64_t i = 0; i < n; ++i) {
    float gv = kMaximize ? -g[i] : g[i];
    float pv = p[i];
    if constexpr (kDecay) {
      if constexpr (kDecoupled) pv = pv * decay;
      else gv = gv + wd * pv;
    }
    // exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1), as torch 1.13's _single_tensor_adam
    const float mv = m[i] * beta1 + one_minus_beta1 * gv;
    const float vv = v[i] * beta2 + one_minus_beta2 * gv * gv;
    m[i] = mv;
    v[i] = vv;
    float s = vv;
    if constexpr (kAmsgrad) {
      s = std::max(vmax[i], vv);
      vmax[i] = s;
    }
    const float denom = std::sqrt(s) / bc2_sqrt + eps;
    p[i] = pv + neg_step * mv / denom;
  }
}

// The same update on 16 lanes with explicit AVX-512 (the compiler keeps adam_loop scalar: std::sqrt
// may set errno). Same operations in the same order; the tail runs masked through the same code.
template <bool kDecoupled, bool kDecay, bool kAmsgrad, bool kMaximize>
__attribute__((target("avx512f"))) void adam_loop_avx512(float* __restrict p, const float* __restrict g,
                                                         float* __restrict m, float* __restrict v,
                                                         float* __restrict vmax, int64_t n, float beta1,
                                                         float one_minus_beta1, float beta2, float one_minus_beta2,
                                                         float wd, float decay, float eps, float bc2_sqrt,
                                                         float neg_step) {
  const __m512 b1 = _mm512_set1_ps(beta1), omb1 = _mm512_set1_ps(one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(beta2), omb2 = _mm512_set1_ps(one_minus_beta2);
  const __m512 wdv = _mm512_set1_ps(wd), decayv = _mm512_set1_ps(decay), epsv = _mm512_set1_ps(eps);
  const __m512 bc2 = _mm512_set1_ps(bc2_sqrt), step = _mm512_set1_ps(neg_step);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t left = n - i;
    const __mmask16 k = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
    if constexpr (kMaximize) gv = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(INT32_MIN)));
    __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
    if constexpr (kDecay) {
      if constexpr (kDecoupled) pv = _mm512_mul_ps(pv, decayv);
      else gv = _mm512_add_ps(gv, _mm512_mul_ps(wdv, pv));
    }
    const __m512 mv = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, m + i), b1), _mm512_mul_ps(omb1, gv));
    const __m512 vv =
        _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, v + i), b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv));
    _mm512_mask_storeu_ps(m + i, k, mv);
    _mm512_mask_storeu_ps(v + i, k, vv);
    __m512 sv = vv;
    if constexpr (kAmsgrad) {
      sv = _mm512_max_ps(vv, _mm512_maskz_loadu_ps(k, vmax + i));  // std::max(vmax, vv), NaN included
      _mm512_mask_storeu_ps(vmax + i, k, sv);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(sv), bc2), epsv);
    _mm512_mask_storeu_ps(p + i, k, _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(step, mv), denom)));
  }
}

template <bool kDecoupled, bool kDecay, bool kAmsgrad>
void adam_dispatch(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamParams& o) {
  static const bool avx512 = cpu_features().avx512f;
  auto run = [&](auto loop) {
    loop(p, g, m, v, vmax, n, o.beta1, o.one_minus_beta1, o.beta2, o.one_minus_beta2, o.weight_decay, o.decoupled_decay,
         o.eps, o.bias_correction2_sqrt, -o.step_size);
  };
  if (avx512) {
    if (o.maximize) run(adam_loop_avx512<kDecoupled, kDecay, kAmsgrad, true>);
    else run(adam_loop_avx512<kDecoupled, kDecay, kAmsgrad, false>);
    return;
  }
  if (o.maximize) run(adam_loop<kDecoupled, kDecay, kAmsgrad, true>);
  else run(adam_loop<kDecoupled, kDecay, kAmsgrad, false>);
}

}  // namespace

void sgd_update_f32(float* p, const float* g, float* buf, int64_t n, const SgdParams& o) {
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    float* pp = p + lo;
    const float* gp = g + lo;
    float* bp = buf ? buf + lo : nullptr;
    const int64_t len = hi - lo;
    if (o.momentum == 0) {
      sgd_dispatch_decay<false, false, false>(pp, gp, bp, len, o);
    } else if (o.first_step) {
      if (o.nesterov) sgd_dispatch_decay<true, true, true>(pp, gp, bp, len, o);
      else sgd_dispatch_decay<true, false, true>(pp, gp, bp, len, o);
    } else {
      if (o.nesterov) sgd_dispatch_decay<true, true, false>(pp, gp, bp, len, o);
      else sgd_dispatch_decay<true, false, false>(pp, gp, bp, len, o);
    }
  });
}

namespace {

// Elements [lo, hi) of one tensor, on the calling thread.
void adam_range(float* p, const float* g, float* m, float* v, float* vmax, int64_t lo, int64_t hi, const AdamParams& o) {
  float* vm = vmax ? vmax + lo : nullptr;
  const int64_t len = hi - lo;
  const bool decay = o.weight_decay != 0;
  auto go = [&](auto fn) { fn(p + lo, g + lo, m + lo, v + lo, vm, len, o); };
  if (o.decoupled) {
    if (decay) o.amsgrad ? go(adam_dispatch<true, true, true>) : go(adam_dispatch<true, true, false>);
    else o.amsgrad ? go(adam_dispatch<true, false, true>) : go(adam_dispatch<true, false, false>);
  } else {
    if (decay) o.amsgrad ? go(adam_dispatch<false, true, true>) : go(adam_dispatch<false, true, false>);
    else o.amsgrad ? go(adam_dispatch<false, false, true>) : go(adam_dispatch<false, false, false>);
  }
}

}  // namespace

void adam_update_f32(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamParams& o) {
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) { adam_range(p, g, m, v, vmax, lo, hi, o); });
}

void adam_update_multi_f32(const std::vector<AdamTensor>& ts) {
  // Elements are numbered across tensors; each chunk walks the tensors it overlaps.
  std::vector<int64_t> start(ts.size() + 1, 0);
  for (size_t i = 0; i < ts.size(); ++i) start[i + 1] = start[i] + ts[i].n;
  parallel_for(0, start.back(), kGrain, [&](int64_t lo, int64_t hi) {
    size_t t = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), lo) - start.begin()) - 1;
    for (; t < ts.size() && start[t] < hi; ++t) {
      const AdamTensor& a = ts[t];
      const int64_t b = std::max(lo, start[t]) - start[t], e = std::min(hi, start[t + 1]) - start[t];
      if (b < e) adam_range(a.p, a.g, a.m, a.v, a.vmax, b, e, a.params);
    }
  });
}

}  // namespace tandem::kernels
