// Fused scaled-dot-product attention on CPU. Works per head and per tile of query rows: the
// tile's scores against the keys it may see (causal: later keys are never computed) come from
// one GEMM, are softmaxed in f32 and applied to V by a second GEMM; only each row's
// log-sum-exp is kept. Backward recomputes a tile's probabilities from Q, K and that
// log-sum-exp, so no T x T matrix outlives its tile. Operands are f32 or f64 (B, H, T, D)
// tensors given by a base pointer and a HeadLayout each: any strides over b, h and t, unit
// stride along D (so q, k, v may be views into one fused qkv projection, and the output may be
// stored (B, T, H, D)). Per head, K (and in backward V) is first transposed into scratch, so every
// tile product reads its B operand row-major; f32 products go through tile_sgemm (tile_gemm.h).
#pragma once

#include <cstdint>

namespace tandem::kernels {

// Row t of head (b, h) of a (B, H, T, D) operand starts b * sb + h * sh + t * st elements after
// the operand's base pointer; its D elements are contiguous.
struct HeadLayout {
  int64_t sb = 0, sh = 0, st = 0;
};

// A contiguous (B, H, T, D) operand.
inline HeadLayout contiguous_heads(int64_t H, int64_t T, int64_t D) { return {H * T * D, T * D, D}; }

struct AttentionShape {
  int64_t BH, T, S, D, Dv;  // batch*heads, query length, key length, q/k dim, v dim
  bool causal;
  int64_t H = 1;            // heads per batch entry: head bh is (b, h) = (bh / H, bh % H)
  // Operand layouts (forward: q, k, v, out; backward also dout, dq, dk, dv). lse is always a
  // contiguous (BH, T) buffer.
  HeadLayout q, k, v, out, dout, dq, dk, dv;
};

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, const AttentionShape& s, T scale);

// dq, dk, dv are overwritten.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv,
                        const AttentionShape& s, T scale);

// Whether the bf16 kernels below run here: AMX tiles (amx_bf16_enabled()) or, without AMX,
// AVX512-BF16 dot products where they beat f32 FMAs (dpbf16_gemm.h, dpbf16_enabled()). Else bf16
// attention runs in f32 (bf16_products.h: widened).
bool attention_bf16_native();

// bf16 operands (bit patterns) on AMX tiles (amx_gemm.h), else on AVX512-BF16 (dpbf16_gemm.h;
// requires attention_bf16_native()), the same tiling: every tile product takes bf16 inputs with f32 sums; scores, softmax, lse and dS
// stay f32, and the probabilities P and dS are rounded to bf16 before the products they feed
// (P V, P^T dO, dS K, dS^T Q), as PyTorch's CPU flash attention does for bf16. out, dq, dk, dv
// are rounded once from f32 (dk, dv summed over query tiles in f32 first).
void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
                            const AttentionShape& s, float scale);
void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                             const float* lse, const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                             const AttentionShape& s, float scale);

}  // namespace tandem::kernels
