#include "tandem/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/core/tensor.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/row_math.h"
#include "tandem/kernels/cpu/vec_math.h"

namespace tandem::kernels {
namespace {

// Query rows per tile: a tile's scores (kTile x keys) are the only T x S-like buffer, and it
// lives only while that tile is processed.
constexpr int64_t kTile = 128;

// A (rows, cols) matrix view of raw memory with row stride `ld`, as a 3-d (1, rows, cols)
// tensor for gemm; `transposed` views the memory as its transpose.
template <class T>
Tensor mat(const T* p, int64_t rows, int64_t cols, int64_t ld, bool transposed = false) {
  void* ptr = const_cast<T*>(p);
  if (!transposed) return from_blob(ptr, {1, rows, cols}, {rows * ld, ld, 1}, dtype_of<T>::value);
  return from_blob(ptr, {1, cols, rows}, {rows * ld, 1, ld}, dtype_of<T>::value);
}

template <class T>
Tensor matmul(const Tensor& a, const Tensor& b) {
  return gemm(a, b, Tensor(), dtype_of<T>::value);
}

template <class T>
T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) return exp_approx(x);  // vectorisable, < 2e-7 relative
  else return std::exp(x);
}

// Keys visible to query row t.
int64_t visible(const AttentionShape& s, int64_t t) { return s.causal ? std::min(t + 1, s.S) : s.S; }

}  // namespace

// Works as follows, per (batch*head) and per tile of query rows: scores = Q_tile K^T over the
// keys the tile can see (causal: keys after the tile's last row are never touched), a row-wise
// softmax in f32 with the masked tail zeroed, out_tile = P V. Only each row's log-sum-exp is
// kept for backward.
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, const AttentionShape& s, T scale) {
  for (int64_t bh = 0; bh < s.BH; ++bh) {
    const T* Q = q + bh * s.T * s.D;
    const T* K = k + bh * s.S * s.D;
    const T* V = v + bh * s.S * s.Dv;
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      T* O = out + (bh * s.T + t0) * s.Dv;
      if (n == 0) {
        std::fill(O, O + rows * s.Dv, T(0));
        std::fill(lse + bh * s.T + t0, lse + bh * s.T + t0 + rows, -std::numeric_limits<T>::infinity());
        continue;
      }
      Tensor scores = matmul<T>(mat(Q + t0 * s.D, rows, s.D, s.D), mat(K, n, s.D, s.D, true));  // (1, rows, n)
      T* P = scores.data_ptr<T>();
      for (int64_t r = 0; r < rows; ++r) {
        T* row = P + r * n;
        const int64_t nr = visible(s, t0 + r);
        if constexpr (std::is_same_v<T, float>) {  // vectorised row kernel, same formula
          lse[bh * s.T + t0 + r] = softmax_row_f32(row, nr, n, scale);
          continue;
        }
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < nr; ++j) m = std::max(m, row[j] * scale);
        T l = 0;
#pragma omp simd reduction(+ : l)
        for (int64_t j = 0; j < nr; ++j) {
          row[j] = exp_of<T>(row[j] * scale - m);
          l += row[j];
        }
        const T inv = T(1) / l;
        for (int64_t j = 0; j < nr; ++j) row[j] *= inv;
        std::fill(row + nr, row + n, T(0));
        lse[bh * s.T + t0 + r] = nr == 0 ? -std::numeric_limits<T>::infinity() : m + std::log(l);
      }
      Tensor o = matmul<T>(scores, mat(V, n, s.Dv, s.Dv));  // (1, rows, Dv)
      std::copy(o.data_ptr<T>(), o.data_ptr<T>() + rows * s.Dv, O);
    }
  }
}

// Backward per tile, recomputing P = exp(Q K^T * scale - lse) from the saved log-sum-exp:
//   dV += P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = scale dS K;  dK += scale dS^T Q.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv,
                        const AttentionShape& s, T scale) {
  std::fill(dk, dk + s.BH * s.S * s.D, T(0));
  std::fill(dv, dv + s.BH * s.S * s.Dv, T(0));
  for (int64_t bh = 0; bh < s.BH; ++bh) {
    const T* Q = q + bh * s.T * s.D;
    const T* K = k + bh * s.S * s.D;
    const T* V = v + bh * s.S * s.Dv;
    T* dK = dk + bh * s.S * s.D;
    T* dV = dv + bh * s.S * s.Dv;
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      T* dQ = dq + (bh * s.T + t0) * s.D;
      if (n == 0) {
        std::fill(dQ, dQ + rows * s.D, T(0));
        continue;
      }
      const T* dO = dout + (bh * s.T + t0) * s.Dv;
      const T* O = out + (bh * s.T + t0) * s.Dv;
      Tensor p_t = matmul<T>(mat(Q + t0 * s.D, rows, s.D, s.D), mat(K, n, s.D, s.D, true));  // (1, rows, n)
      T* P = p_t.data_ptr<T>();
      for (int64_t r = 0; r < rows; ++r) {
        T* row = P + r * n;
        const int64_t nr = visible(s, t0 + r);
        const T l = lse[bh * s.T + t0 + r];
        if constexpr (std::is_same_v<T, float>) {
          exp_shifted_row_f32(row, nr, n, scale, l);
          continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < nr; ++j) row[j] = exp_of<T>(row[j] * scale - l);
        std::fill(row + nr, row + n, T(0));
      }
      // dV[0:n] += P^T dO
      Tensor dv_t = matmul<T>(mat(P, rows, n, n, true), mat(dO, rows, s.Dv, s.Dv));
      const T* pdv = dv_t.data_ptr<T>();
      if constexpr (std::is_same_v<T, float>) {
        add_into_f32(dV, pdv, n * s.Dv);
      } else {
        for (int64_t i = 0; i < n * s.Dv; ++i) dV[i] += pdv[i];
      }
      // dS = P * (dO V^T - delta) * scale, in place of dP
      Tensor ds_t = matmul<T>(mat(dO, rows, s.Dv, s.Dv), mat(V, n, s.Dv, s.Dv, true));  // (1, rows, n)
      T* dS = ds_t.data_ptr<T>();
      for (int64_t r = 0; r < rows; ++r) {
        const T* dor = dO + r * s.Dv;
        const T* orow = O + r * s.Dv;
        T* ds = dS + r * n;
        const T* pr = P + r * n;
        if constexpr (std::is_same_v<T, float>) {
          softmax_grad_row_f32(ds, pr, n, dot_f32(dor, orow, s.Dv), scale);
          continue;
        }
        T delta = 0;
        for (int64_t d = 0; d < s.Dv; ++d) delta += dor[d] * orow[d];
        for (int64_t j = 0; j < n; ++j) ds[j] = pr[j] * (ds[j] - delta) * scale;
      }
      // dQ_tile = dS K[0:n];  dK[0:n] += dS^T Q_tile
      Tensor dq_t = matmul<T>(ds_t, mat(K, n, s.D, s.D));
      std::copy(dq_t.data_ptr<T>(), dq_t.data_ptr<T>() + rows * s.D, dQ);
      Tensor dk_t = matmul<T>(mat(dS, rows, n, n, true), mat(Q + t0 * s.D, rows, s.D, s.D));
      const T* pdk = dk_t.data_ptr<T>();
      if constexpr (std::is_same_v<T, float>) {
        add_into_f32(dK, pdk, n * s.D);
      } else {
        for (int64_t i = 0; i < n * s.D; ++i) dK[i] += pdk[i];
      }
    }
  }
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, const AttentionShape&, float);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*, const AttentionShape&,
                                        double);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*, const float*,
                                        float*, float*, float*, const AttentionShape&, float);
template void attention_backward<double>(const double*, const double*, const double*, const double*, const double*,
                                         const double*, double*, double*, double*, const AttentionShape&, double);

}  // namespace tandem::kernels
