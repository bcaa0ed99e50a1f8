#include "tandem/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/core/parallel.h"

namespace tandem::kernels {
namespace {

// s[j] = scale * <q, K[j]> for j < n. Multiversioned: AVX-512, AVX2 or baseline at load time.
template <class T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void scores(const T* __restrict q, const T* __restrict K, int64_t n, int64_t D, T scale, T* __restrict s) {
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = K + j * D;
    T acc = 0;
#pragma omp simd reduction(+ : acc)  // lets the compiler reassociate the sum and vectorise it
    for (int64_t d = 0; d < D; ++d) acc += q[d] * kj[d];
    s[j] = acc * scale;
  }
}

// out += sum_j p[j] * V[j]
template <class T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void mix(const T* __restrict p, const T* __restrict V, int64_t n, int64_t Dv, T* __restrict out) {
  for (int64_t j = 0; j < n; ++j) {
    const T pj = p[j];
    const T* vj = V + j * Dv;
    for (int64_t d = 0; d < Dv; ++d) out[d] += pj * vj[d];
  }
}

// y += a * x
template <class T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void axpy(T a, const T* __restrict x, int64_t n, T* __restrict y) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

template <class T>
__attribute__((target_clones("avx512f", "avx2", "default")))
T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

}  // namespace

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, const AttentionShape& s, T scale) {
  parallel_for(0, s.BH * s.T, std::max<int64_t>(1, 4096 / std::max<int64_t>(s.S * s.D, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<T> p(static_cast<size_t>(s.S));
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t bh = row / s.T, t = row % s.T;
      const int64_t n = s.causal ? std::min(t + 1, s.S) : s.S;  // keys this row may see
      const T* K = k + bh * s.S * s.D;
      const T* V = v + bh * s.S * s.Dv;
      T* o = out + row * s.Dv;
      std::fill(o, o + s.Dv, T(0));
      if (n == 0) {
        lse[row] = -std::numeric_limits<T>::infinity();
        continue;
      }
      scores(q + row * s.D, K, n, s.D, scale, p.data());
      const T m = *std::max_element(p.begin(), p.begin() + n);
      T l = 0;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - m);
        l += p[j];
      }
      const T inv = T(1) / l;
      for (int64_t j = 0; j < n; ++j) p[j] *= inv;
      mix(p.data(), V, n, s.Dv, o);
      lse[row] = m + std::log(l);
    }
  });
}

template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv,
                        const AttentionShape& s, T scale) {
  // dK and dV of one (batch, head) gather contributions from all its query rows, so work is
  // split over (batch, head) pairs, each thread owning its pairs' dK/dV.
  parallel_for(0, s.BH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> p(static_cast<size_t>(s.S));
    for (int64_t bh = lo; bh < hi; ++bh) {
      const T* K = k + bh * s.S * s.D;
      const T* V = v + bh * s.S * s.Dv;
      T* dK = dk + bh * s.S * s.D;
      T* dV = dv + bh * s.S * s.Dv;
      std::fill(dK, dK + s.S * s.D, T(0));
      std::fill(dV, dV + s.S * s.Dv, T(0));
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t row = bh * s.T + t;
        const int64_t n = s.causal ? std::min(t + 1, s.S) : s.S;
        const T* qt = q + row * s.D;
        const T* dot_ = dout + row * s.Dv;
        T* dqt = dq + row * s.D;
        std::fill(dqt, dqt + s.D, T(0));
        if (n == 0) continue;
        const T delta = dot(dot_, out + row * s.Dv, s.Dv);  // sum_j p_j dp_j
        scores(qt, K, n, s.D, scale, p.data());
        for (int64_t j = 0; j < n; ++j) {
          const T pj = std::exp(p[j] - lse[row]);
          axpy(pj, dot_, s.Dv, dV + j * s.Dv);                   // dV_j += p_j dO_t
          const T ds = pj * (dot(dot_, V + j * s.Dv, s.Dv) - delta);  // dS = P (dP - delta)
          axpy(scale * ds, K + j * s.D, s.D, dqt);                  // dQ_t += scale dS K_j
          axpy(scale * ds, qt, s.D, dK + j * s.D);                   // dK_j += scale dS Q_t
        }
      }
    }
  });
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, const AttentionShape&, float);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*, const AttentionShape&,
                                        double);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*, const float*,
                                        float*, float*, float*, const AttentionShape&, float);
template void attention_backward<double>(const double*, const double*, const double*, const double*, const double*,
                                         const double*, double*, double*, double*, const AttentionShape&, double);

}  // namespace tandem::kernels
