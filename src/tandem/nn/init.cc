#include "tandem/nn/init.h"

#include <cmath>

#include "tandem/autograd/grad_mode.h"

namespace tandem::nn::init {

void uniform_(Tensor& t, double a, double b, Generator* gen) {
  TANDEM_CHECK(is_floating(t.dtype()), DTypeError, "uniform_: not implemented for {} tensors", dtype_name(t.dtype()));
  TANDEM_CHECK(a <= b, ValueError, "uniform_ expects a [from, to) range, but found from={} > to={}", a, b);
  NoGradGuard no_grad;
  Tensor u = rand(t.shape(), kFloat64, gen);
  u.mul_(b - a);
  Tensor shifted = full(t.shape(), a, kFloat64);
  shifted.add_(u);
  t.copy_(shifted);
}

void normal_(Tensor& t, double mean, double std, Generator* gen) {
  TANDEM_CHECK(is_floating(t.dtype()), DTypeError, "normal_: not implemented for {} tensors", dtype_name(t.dtype()));
  TANDEM_CHECK(std >= 0, ValueError, "normal_ expects std >= 0.0, got {}", std);
  NoGradGuard no_grad;
  Tensor n = randn(t.shape(), kFloat64, gen);
  n.mul_(std);
  Tensor shifted = full(t.shape(), mean, kFloat64);
  shifted.add_(n);
  t.copy_(shifted);
}

void constant_(Tensor& t, double value) {
  NoGradGuard no_grad;
  t.fill_(value);
}

void zeros_(Tensor& t) { constant_(t, 0.0); }
void ones_(Tensor& t) { constant_(t, 1.0); }

std::pair<int64_t, int64_t> fans(const Tensor& t) {
  TANDEM_CHECK(t.dim() >= 2, ShapeError, "init: fan in/out need a tensor with >= 2 dims, got shape {}",
               shape_str(t.shape()));
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

void kaiming_uniform_(Tensor& t, double a, Generator* gen) {
  const double gain = std::sqrt(2.0 / (1.0 + a * a));
  const double bound = gain * std::sqrt(3.0 / static_cast<double>(fans(t).first));
  uniform_(t, -bound, bound, gen);
}

void xavier_uniform_(Tensor& t, double gain, Generator* gen) {
  auto [fan_in, fan_out] = fans(t);
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  uniform_(t, -bound, bound, gen);
}

}  // namespace tandem::nn::init
