#include "tandem/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/core/tensor.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/dpbf16_gemm.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/kernels/cpu/row_math.h"
#include "tandem/kernels/cpu/tile_gemm.h"
#include "tandem/kernels/cpu/vec_math.h"

namespace tandem::kernels {
namespace {

// Query rows per tile: a tile's scores (kTile x keys) are the only T x S-like buffer, and it
// lives only while that tile is processed.
constexpr int64_t kTile = 64;

// A (rows, cols) matrix view of raw memory with row stride `ld`, as a 3-d (1, rows, cols)
// tensor for gemm; `transposed` views the memory as its transpose.
template <class T>
Tensor mat(const T* p, int64_t rows, int64_t cols, int64_t ld, bool transposed = false) {
  void* ptr = const_cast<T*>(p);
  if (!transposed) return from_blob(ptr, {1, rows, cols}, {rows * ld, ld, 1}, dtype_of<T>::value);
  return from_blob(ptr, {1, cols, rows}, {rows * ld, 1, ld}, dtype_of<T>::value);
}

template <class T>
T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) return exp_approx(x);  // vectorisable, < 2e-7 relative
  else return std::exp(x);
}

// Keys visible to query row t.
int64_t visible(const AttentionShape& s, int64_t t) { return s.causal ? std::min(t + 1, s.S) : s.S; }

// Head bh's first row in an operand.
template <class P>
P* head(P* base, const HeadLayout& l, const AttentionShape& s, int64_t bh) {
  return base + (bh / s.H) * l.sb + (bh % s.H) * l.sh;
}

// rows x cols from a contiguous buffer into rows of stride ld.
template <class T>
void store_rows(const T* src, T* dst, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * cols, src + (r + 1) * cols, dst + r * ld);
}

// dst rows (stride ld) += src rows (contiguous).
template <class T>
void add_rows(T* dst, const T* src, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      add_into_f32(dst + r * ld, src + r * cols, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[r * ld + j] += src[r * cols + j];
    }
  }
}

// c (M x N, row stride ldc) = op(a) @ b, or += with accumulate, where op transposes when ta; lda /
// ldb are the operands' row strides as stored (b is always read row-major: K and V are staged
// transposed where a product needs them so). f32 goes through tile_sgemm into the strided
// destination; f64 through gemm() on matrix views, then stored or added.
template <class T>
void mm(bool ta, int64_t M, int64_t N, int64_t K, const T* a, int64_t lda, const T* b, int64_t ldb, bool accumulate, T* c,
        int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    tile_sgemm(M, N, K, a, ta ? 1 : lda, ta ? lda : 1, b, ldb, accumulate, c, ldc);
  } else {
    const Tensor av = ta ? mat(a, K, M, lda, true) : mat(a, M, K, lda);
    const Tensor r = gemm(av, mat(b, K, N, ldb), Tensor(), dtype_of<T>::value);
    if (accumulate) add_rows(c, r.data_ptr<T>(), M, N, ldc);
    else store_rows(r.data_ptr<T>(), c, M, N, ldc);
  }
}

// A per-thread scratch of at least n elements (a tile's scores or their gradient), kept between
// calls.
template <class T>
T* scratch(int slot, int64_t n) {
  thread_local std::vector<T> buf[6];
  if (static_cast<int64_t>(buf[slot].size()) < n) buf[slot].resize(n);
  return buf[slot].data();
}

// The transpose of a rows x cols strided operand, (cols x rows) contiguous in scratch `slot`: the
// tile products then all read B row-major (K^T for the scores, V^T for dP).
template <class T>
const T* staged_transpose(const T* src, int64_t rows, int64_t cols, int64_t ld, int slot) {
  T* dst = scratch<T>(slot, rows * cols);
  if constexpr (std::is_same_v<T, float>) {
    transpose_f32(src, rows, cols, ld, dst);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * ld + c];
    }
  }
  return dst;
}

// fn(bh) for every (batch*head): heads are independent (disjoint outputs, per-thread scratch), so
// they are split across the intra-op pool.
template <class F>
void for_each_head(const AttentionShape& s, const F& fn) {
  parallel_for(0, s.BH, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) fn(bh);
  });
}

// rows x cols of zeros at p (row stride ld): outputs of query rows that see no key.
template <class T>
void zero_rows(T* p, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) std::fill(p + r * ld, p + r * ld + cols, T(0));
}

}  // namespace

// Works as follows, per (batch*head) and per tile of query rows: scores = Q_tile K^T over the
// keys the tile can see (causal: keys after the tile's last row are never touched), a row-wise
// softmax in f32 with the masked tail zeroed, out_tile = P V. Only each row's log-sum-exp is
// kept for backward.
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, const AttentionShape& s, T scale) {
  for_each_head(s, [&](int64_t bh) {
    const int64_t qst = s.q.st, vst = s.v.st;
    const T* Q = head(q, s.q, s, bh);
    const T* KT = staged_transpose(head(k, s.k, s, bh), s.S, s.D, s.k.st, 2);  // (D x S)
    const T* V = head(v, s.v, s, bh);
    T* Oh = head(out, s.out, s, bh);
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      T* O = Oh + t0 * s.out.st;
      if (n == 0) {
        zero_rows(O, rows, s.Dv, s.out.st);
        std::fill(lse + bh * s.T + t0, lse + bh * s.T + t0 + rows, -std::numeric_limits<T>::infinity());
        continue;
      }
      T* P = scratch<T>(0, rows * n);  // scores (rows x n)
      mm<T>(false, rows, n, s.D, Q + t0 * qst, qst, KT, s.S, false, P, n);
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
      mm<T>(false, rows, s.Dv, n, P, n, V, vst, false, O, s.out.st);
    }
  });
}

// Backward per tile, recomputing P = exp(Q K^T * scale - lse) from the saved log-sum-exp:
//   dV += P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = scale dS K;  dK += scale dS^T Q.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse, const T* dout, T* dq, T* dk,
                        T* dv, const AttentionShape& s, T scale) {
  for_each_head(s, [&](int64_t bh) {
    const int64_t qst = s.q.st, kst = s.k.st, ost = s.out.st, dost = s.dout.st;
    const T* Q = head(q, s.q, s, bh);
    const T* K = head(k, s.k, s, bh);
    const T* KT = staged_transpose(K, s.S, s.D, kst, 2);                        // (D x S)
    const T* VT = staged_transpose(head(v, s.v, s, bh), s.S, s.Dv, s.v.st, 3);  // (Dv x S)
    const T* Oh = head(out, s.out, s, bh);
    const T* dOh = head(dout, s.dout, s, bh);
    T* dQh = head(dq, s.dq, s, bh);
    T* dK = head(dk, s.dk, s, bh);
    T* dV = head(dv, s.dv, s, bh);
    zero_rows(dK, s.S, s.D, s.dk.st);
    zero_rows(dV, s.S, s.Dv, s.dv.st);
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      T* dQ = dQh + t0 * s.dq.st;
      if (n == 0) {
        zero_rows(dQ, rows, s.D, s.dq.st);
        continue;
      }
      const T* dO = dOh + t0 * dost;
      const T* O = Oh + t0 * ost;
      const T* Qt = Q + t0 * qst;
      T* P = scratch<T>(0, rows * n);  // (rows x n)
      mm<T>(false, rows, n, s.D, Qt, qst, KT, s.S, false, P, n);
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
      mm<T>(true, n, s.Dv, rows, P, n, dO, dost, true, dV, s.dv.st);
      // dS = P * (dO V^T - delta) * scale, in place of dP
      T* dS = scratch<T>(1, rows * n);  // (rows x n)
      mm<T>(false, rows, n, s.Dv, dO, dost, VT, s.S, false, dS, n);
      for (int64_t r = 0; r < rows; ++r) {
        const T* dor = dO + r * dost;
        const T* orow = O + r * ost;
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
      mm<T>(false, rows, s.D, n, dS, n, K, kst, false, dQ, s.dq.st);
      mm<T>(true, n, s.D, rows, dS, n, Qt, qst, true, dK, s.dk.st);
    }
  });
}

// ---- bf16 on AMX tiles ----

namespace {

// f32 dot product of two bf16 rows (the backward's rowsum(dO * O)).
float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {
  float* fa = scratch<float>(4, n);
  float* fb = scratch<float>(5, n);
  convert(a, kBFloat16, fa, kFloat32, n);
  convert(b, kBFloat16, fb, kFloat32, n);
  return dot_f32(fa, fb, n);
}

// rows x cols f32 (contiguous) rounded into bf16 rows of stride ld.
void round_rows(const float* src, uint16_t* dst, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) convert(src + r * cols, kFloat32, dst + r * ld, kBFloat16, cols);
}

}  // namespace

bool attention_bf16_native() { return amx_bf16_enabled() || dpbf16_enabled(); }

namespace {

// One bf16 tile product on AMX where enabled, else on AVX512-BF16.
void tile_gemm_bf16(char transa, char transb, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, bool accumulate, void* c, bool c_bf16, int64_t ldc) {
  if (amx_bf16_enabled()) return amx_tile_gemm_bf16(transa, transb, M, N, K, a, lda, b, ldb, accumulate, c, c_bf16, ldc);
  dpbf16_tile_gemm_bf16(transa, transb, M, N, K, a, lda, b, ldb, accumulate, c, c_bf16, ldc);
}

}  // namespace

void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                            const AttentionShape& s, float scale) {
  for_each_head(s, [&](int64_t bh) {
    const uint16_t* Q = head(q, s.q, s, bh);
    const uint16_t* K = head(k, s.k, s, bh);
    const uint16_t* V = head(v, s.v, s, bh);
    uint16_t* Oh = head(out, s.out, s, bh);
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      uint16_t* O = Oh + t0 * s.out.st;
      if (n == 0) {
        zero_rows(O, rows, s.Dv, s.out.st);
        std::fill(lse + bh * s.T + t0, lse + bh * s.T + t0 + rows, -std::numeric_limits<float>::infinity());
        continue;
      }
      float* P = scratch<float>(0, rows * n);  // scores, then probabilities (rows x n)
      tile_gemm_bf16('N', 'T', rows, n, s.D, Q + t0 * s.q.st, s.q.st, K, s.k.st, false, P, false, n);
      for (int64_t r = 0; r < rows; ++r)
        lse[bh * s.T + t0 + r] = softmax_row_f32(P + r * n, visible(s, t0 + r), n, scale);
      uint16_t* Pb = scratch<uint16_t>(0, rows * n);
      convert(P, kFloat32, Pb, kBFloat16, rows * n);
      tile_gemm_bf16('N', 'N', rows, s.Dv, n, Pb, n, V, s.v.st, false, O, true, s.out.st);
    }
  });
}

void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                             const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                             const AttentionShape& s, float scale) {
  for_each_head(s, [&](int64_t bh) {
    const int64_t qst = s.q.st, kst = s.k.st, ost = s.out.st, dost = s.dout.st;
    const uint16_t* Q = head(q, s.q, s, bh);
    const uint16_t* K = head(k, s.k, s, bh);
    const uint16_t* V = head(v, s.v, s, bh);
    const uint16_t* Oh = head(out, s.out, s, bh);
    const uint16_t* dOh = head(dout, s.dout, s, bh);
    uint16_t* dQh = head(dq, s.dq, s, bh);
    // dK, dV summed over the query tiles in f32 (S x D, S x Dv), rounded once at the end.
    float* dKa = scratch<float>(2, s.S * s.D);
    float* dVa = scratch<float>(3, s.S * s.Dv);
    std::fill(dKa, dKa + s.S * s.D, 0.0f);
    std::fill(dVa, dVa + s.S * s.Dv, 0.0f);
    for (int64_t t0 = 0; t0 < s.T; t0 += kTile) {
      const int64_t rows = std::min(kTile, s.T - t0);
      const int64_t n = visible(s, t0 + rows - 1);
      uint16_t* dQ = dQh + t0 * s.dq.st;
      if (n == 0) {
        zero_rows(dQ, rows, s.D, s.dq.st);
        continue;
      }
      const uint16_t* dO = dOh + t0 * dost;
      const uint16_t* O = Oh + t0 * ost;
      const uint16_t* Qt = Q + t0 * qst;
      float* P = scratch<float>(0, rows * n);
      tile_gemm_bf16('N', 'T', rows, n, s.D, Qt, qst, K, kst, false, P, false, n);
      for (int64_t r = 0; r < rows; ++r) {
        exp_shifted_row_f32(P + r * n, visible(s, t0 + r), n, scale, lse[bh * s.T + t0 + r]);
      }
      uint16_t* Pb = scratch<uint16_t>(0, rows * n);
      convert(P, kFloat32, Pb, kBFloat16, rows * n);
      // dV[0:n] += P^T dO
      tile_gemm_bf16('T', 'N', n, s.Dv, rows, Pb, n, dO, dost, true, dVa, false, s.Dv);
      // dS = P * (dO V^T - delta) * scale
      float* dS = scratch<float>(1, rows * n);
      tile_gemm_bf16('N', 'T', rows, n, s.Dv, dO, dost, V, s.v.st, false, dS, false, n);
      for (int64_t r = 0; r < rows; ++r) {
        softmax_grad_row_f32(dS + r * n, P + r * n, n, dot_bf16(dO + r * dost, O + r * ost, s.Dv), scale);
      }
      uint16_t* dSb = scratch<uint16_t>(1, rows * n);
      convert(dS, kFloat32, dSb, kBFloat16, rows * n);
      // dQ_tile = dS K[0:n];  dK[0:n] += dS^T Q_tile
      tile_gemm_bf16('N', 'N', rows, s.D, n, dSb, n, K, kst, false, dQ, true, s.dq.st);
      tile_gemm_bf16('T', 'N', n, s.D, rows, dSb, n, Qt, qst, true, dKa, false, s.D);
    }
    round_rows(dKa, head(dk, s.dk, s, bh), s.S, s.D, s.dk.st);
    round_rows(dVa, head(dv, s.dv, s, bh), s.S, s.Dv, s.dv.st);
  });
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, const AttentionShape&,
                                       float);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*,
                                        const AttentionShape&, double);
template void attention_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                        const float*, float*, float*, float*, const AttentionShape&, float);
template void attention_backward<double>(const double*, const double*, const double*, const double*, const double*,
                                         const double*, double*, double*, double*, const AttentionShape&, double);

}  // namespace tandem::kernels
