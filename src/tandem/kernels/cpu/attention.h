// Fused scaled-dot-product attention on CPU. Works per head and per tile of up to 128 query
// rows: the tile's scores against the keys it may see (causal: later keys are never computed)
// come from one GEMM, are softmaxed in f32 and applied to V by a second GEMM; only each row's
// log-sum-exp is kept. Backward recomputes a tile's probabilities from Q, K and that
// log-sum-exp, so no T x T matrix outlives its tile. Buffers are contiguous (BH, T, D) in f32
// or f64.
#pragma once

#include <cstdint>

namespace tandem::kernels {

struct AttentionShape {
  int64_t BH, T, S, D, Dv;  // batch*heads, query length, key length, q/k dim, v dim
  bool causal;
};

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, const AttentionShape& s, T scale);

// dq, dk, dv are overwritten.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv,
                        const AttentionShape& s, T scale);

}  // namespace tandem::kernels
