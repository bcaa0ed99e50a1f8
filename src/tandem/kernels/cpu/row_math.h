// Row kernels in f32 shared by attention's softmax and layer_norm: each one walks one row of
// contiguous floats. An AVX-512 body (16 lanes, masked tail) is chosen at run time from the CPU
// features; the portable body computes the same formula. Invariant: reductions accumulate in f32
// (callers gather rows into f64 where a statistic needs it).
#pragma once

#include <cstdint>

namespace tandem::kernels {

// row[0, n) <- softmax(row * scale) (exp_approx of vec_math.h, so < 2e-7 relative per exp),
// row[n, width) <- 0. Returns the log-sum-exp of row[0, n) * scale (-inf when n == 0).
float softmax_row_f32(float* row, int64_t n, int64_t width, float scale);

// row[0, n) <- exp(row * scale - lse), row[n, width) <- 0 (attention backward's recomputed P).
void exp_shifted_row_f32(float* row, int64_t n, int64_t width, float scale, float lse);

// ds[0, n) <- p * (ds - delta) * scale (softmax backward given dP in ds and delta = rowsum(dO * O)).
void softmax_grad_row_f32(float* ds, const float* p, int64_t n, float delta, float scale);

// sum a[i] * b[i].
float dot_f32(const float* a, const float* b, int64_t n);

// dst[i] += src[i].
void add_into_f32(float* dst, const float* src, int64_t n);

// dst[i] += (double)src[i] (each lane's sum in f64, as the scalar loop).
void add_into_f64_f32(double* dst, const float* src, int64_t n);

// Layer norm of one row: mean and 1 / sqrt(biased variance + eps) (two passes, f32 partial sums
// folded into f64 every 256 elements).
void row_moments_f32(const float* x, int64_t n, double eps, double& mean, double& rstd);

// y = (x - mean) * rstd * w + b (w, b may be null: 1 and 0).
void layer_norm_row_f32(const float* x, float* y, int64_t n, float mean, float rstd, const float* w, const float* b);

// Layer norm backward of one row, xhat = (x - mean) * rstd, dxhat = gy * w (w null: 1):
//   gx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  gw += gy * xhat,  gb += gy.
void layer_norm_backward_row_f32(const float* x, const float* gy, float* gx, int64_t n, float mean, float rstd,
                                 const float* w, float* gw, float* gb);

// GELU, tanh approximation, as x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3), and its
// backward gx = g * (s + 2 x s (1 - s) u'), s = sigmoid(2u) (exp_approx: < 2e-7 relative).
void gelu_tanh_row_f32(const float* x, float* y, int64_t n);
void gelu_tanh_backward_row_f32(const float* g, const float* x, float* gx, int64_t n);

}  // namespace tandem::kernels
