// Fused scaled-dot-product attention on CPU. Works row by row: the scores of one query row
// against the keys it may see (all, or j <= i when causal — masked keys are never computed)
// are formed, softmaxed in f32 and applied to V; only the row's log-sum-exp is kept. Backward
// recomputes each row's probabilities from Q, K and that log-sum-exp, so no T x T matrix is
// ever stored. Buffers are contiguous (BH, T, D) in f32 or f64.
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
