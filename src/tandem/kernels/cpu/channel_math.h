// Per-channel kernels behind batch_norm, f32 arithmetic on f32 or bf16 inputs: each works on one
// block of a (outer, C, inner) view, either `rows` whole rows of a channels-last (rows, C) matrix,
// or a run of one channel of an NCHW view (then C == 1 and the per-channel arrays point at that
// channel's entry). Bodies are plain loops compiled for AVX-512 / AVX2 / baseline and picked at
// run time. Invariant: sums are taken in f32 within the block, row after row per channel (callers
// fold blocks into f64), and a bf16 input is widened exactly in registers, so the bf16 overloads
// give bit for bit what the f32 ones give on the widened values (no f32 copy of the input).
#pragma once

#include <cstdint>

#include "tandem/core/half.h"

namespace tandem::kernels {

// acc[c] += sum over rows r of u[r * C + c].
void channel_sum(const float* u, int64_t rows, int64_t C, float* acc);
void channel_sum(const bfloat16* u, int64_t rows, int64_t C, float* acc);

// acc[c] += sum over rows r of (x[r * C + c] - m[c])^2.
void channel_sum_sq_dev(const float* x, int64_t rows, int64_t C, const float* m, float* acc);
void channel_sum_sq_dev(const bfloat16* x, int64_t rows, int64_t C, const float* m, float* acc);

// With g' = (y == nullptr || y > 0) ? g : 0 (a fused ReLU's mask on the output y):
// sg[c] += sum g',  sgx[c] += sum g' * (x - m[c]).
void channel_sum_grad(const float* g, const float* y, const float* x, int64_t rows, int64_t C, const float* m,
                      float* sg, float* sgx);
void channel_sum_grad(const bfloat16* g, const bfloat16* y, const bfloat16* x, int64_t rows, int64_t C,
                      const float* m, float* sg, float* sgx);

// out[r * C + c] = act(ku[c] * u' + kv[c] * v + k0[c]) where u' = u masked by (y > 0) when y is
// given (else u), the kv term is dropped when v is null, and act is max(0, .) when relu. The
// output is f32 (the caller rounds a 16-bit result once).
void channel_affine(float* out, const float* u, const float* y, const float* v, int64_t rows, int64_t C,
                    const float* ku, const float* kv, const float* k0, bool relu);
void channel_affine(float* out, const bfloat16* u, const bfloat16* y, const bfloat16* v, int64_t rows, int64_t C,
                    const float* ku, const float* kv, const float* k0, bool relu);

}  // namespace tandem::kernels
