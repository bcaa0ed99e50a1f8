#include "tandem/kernels/cpu/activation.h"

#include <algorithm>

#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/vec_math.h"

namespace tandem::kernels {
namespace {

constexpr float kK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kC = 0.044715f;

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_fwd(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation where tanh(u) is near -1.
    const float v = x[i];
    y[i] = v / (1.0f + exp_approx(-2.0f * kK * (v + kC * v * v * v)));
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_bwd(const float* __restrict g, const float* __restrict x, float* __restrict gx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // With s = sigmoid(2u): dy/dx = s + 2 x s (1 - s) u'.
    const float v = x[i];
    const float s = 1.0f / (1.0f + exp_approx(-2.0f * kK * (v + kC * v * v * v)));
    const float du = kK * (1.0f + 3.0f * kC * v * v);
    gx[i] = g[i] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}

}  // namespace

void gelu_tanh_f32(const float* x, float* y, int64_t n) {
  parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) { gelu_fwd(x + lo, y + lo, hi - lo); });
}

void gelu_tanh_backward_f32(const float* g, const float* x, float* gx, int64_t n) {
  parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) { gelu_bwd(g + lo, x + lo, gx + lo, hi - lo); });
}

void gelu_tanh_reduced(const void* x, void* y, int64_t n, DType dtype) {
  const size_t es = element_size(dtype);
  parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
    constexpr int64_t kBlock = 256;
    float bx[kBlock], by[kBlock];
    for (int64_t s = lo; s < hi; s += kBlock) {
      const int64_t len = std::min(kBlock, hi - s);
      convert(static_cast<const char*>(x) + s * es, dtype, bx, kFloat32, len);
      gelu_fwd(bx, by, len);
      convert(by, kFloat32, static_cast<char*>(y) + s * es, dtype, len);
    }
  });
}

void gelu_tanh_backward_reduced(const void* g, const void* x, void* gx, int64_t n, DType dtype) {
  const size_t es = element_size(dtype);
  parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
    constexpr int64_t kBlock = 256;
    float bg[kBlock], bx[kBlock], bo[kBlock];
    for (int64_t s = lo; s < hi; s += kBlock) {
      const int64_t len = std::min(kBlock, hi - s);
      convert(static_cast<const char*>(g) + s * es, dtype, bg, kFloat32, len);
      convert(static_cast<const char*>(x) + s * es, dtype, bx, kFloat32, len);
      gelu_bwd(bg, bx, bo, len);
      convert(bo, kFloat32, static_cast<char*>(gx) + s * es, dtype, len);
    }
  });
}

}  // namespace tandem::kernels
