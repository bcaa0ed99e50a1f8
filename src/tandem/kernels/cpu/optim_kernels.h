// Fused optimizer updates on contiguous f32 buffers, one pass over memory per step. Compiled
// for AVX-512, AVX2 and baseline x86-64 (picked at load time by the CPU). The element order
// of operations follows PyTorch's single-tensor SGD/Adam so results agree to rounding.
#pragma once

#include <cstdint>
#include <vector>

namespace tandem::kernels {

struct SgdParams {
  float lr = 0, momentum = 0, weight_decay = 0;
  float one_minus_dampening = 1;  // rounded from double, as PyTorch rounds its Python scalars
  bool nesterov = false, maximize = false;
  bool first_step = false;  // momentum buffer is initialised to the (decayed) gradient
};
// p -= lr * d, with d and buf per torch.optim.SGD. buf may be null when momentum == 0.
void sgd_update_f32(float* p, const float* g, float* buf, int64_t n, const SgdParams& o);

struct AdamParams {
  // Derived scalars are computed in double by the caller and rounded once, as PyTorch does.
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0, weight_decay = 0;
  float decoupled_decay = 1;   // 1 - lr * weight_decay
  float step_size = 0;         // lr / (1 - beta1^t)
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  bool decoupled = false, amsgrad = false, maximize = false;
};
// One Adam/AdamW step; vmax may be null unless amsgrad.
void adam_update_f32(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamParams& o);

// One tensor of a multi-tensor update.
struct AdamTensor {
  float *p, *m, *v, *vmax;  // vmax null unless amsgrad
  const float* g;
  int64_t n;
  AdamParams params;
};
// The fused step over a whole parameter list: one parallel pass over all elements of all
// tensors (no per-tensor synchronisation), each element updated exactly as adam_update_f32 does.
void adam_update_multi_f32(const std::vector<AdamTensor>& tensors);

}  // namespace tandem::kernels
