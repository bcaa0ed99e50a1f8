#include "tandem/ops/dropout.h"

#include "tandem/autograd/node.h"
#include "tandem/kernels/cpu/loops.h"

namespace tandem::ops {

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  TANDEM_CHECK(p >= 0.0 && p <= 1.0, ValueError, "dropout: probability must be in [0, 1], got {}", p);
  if (!training || p == 0.0) return x;
  Generator& g = gen ? *gen : default_generator();
  const int64_t n = x.numel();
  const uint64_t base = g.reserve(static_cast<uint64_t>(n));
  // The mask is kept as the scale each element gets: 0 or 1/(1-p).
  Tensor mask = empty(x.shape(), x.dtype());
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  TANDEM_DISPATCH_FLOATING(x.dtype(), "dropout", [&] {
    auto* m = static_cast<scalar_t*>(mask.data_ptr());
    const scalar_t keep = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(scale));
    const scalar_t drop = static_cast<scalar_t>(compute_t<scalar_t>(0));
    const float pf = static_cast<float>(p);
    parallel_for(0, n, kernels::kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) m[i] = g.uniform(base, static_cast<uint64_t>(i)) < pf ? drop : keep;
    });
  });
  Tensor out = kernels::binary_op(x.detach(), mask, "dropout", [](auto a, auto b) { return a * b; });
  autograd::record("DropoutBackward", {x}, {out}, [mask](const std::vector<Tensor>& grads) {
    return std::vector<Tensor>{kernels::binary_op(grads[0], mask, "dropout backward", [](auto a, auto b) { return a * b; })};
  });
  return out;
}

}  // namespace tandem::ops
