#include "tandem/kernels/cpu/activation.h"

#include <algorithm>

#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/row_math.h"

namespace tandem::kernels {
namespace {

// The f32 bodies are row_math's gelu_tanh_row_f32 / gelu_tanh_backward_row_f32 (AVX-512 picked at
// run time); 16-bit tensors go through them in blocks widened to f32.
void gelu_fwd(const float* x, float* y, int64_t n) { gelu_tanh_row_f32(x, y, n); }
void gelu_bwd(const float* g, const float* x, float* gx, int64_t n) { gelu_tanh_backward_row_f32(g, x, gx, n); }

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
