#include "tandem/nn/layers.h"

#include <cmath>

#include "tandem/autograd/grad_mode.h"
#include "tandem/nn/init.h"
#include "tandem/ops/dropout.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/shape.h"

namespace tandem::nn {

Linear::Linear(int64_t in, int64_t out, bool with_bias, DType dtype)
    : Module("Linear"), in_features(in), out_features(out) {
  TANDEM_CHECK(in > 0 && out > 0, ValueError, "Linear: features must be positive, got in={} out={}", in, out);
  weight = register_parameter("weight", empty({out, in}, dtype));
  if (with_bias) bias = register_parameter("bias", empty({out}, dtype));
  reset_parameters();
}

void Linear::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));  // = uniform(+-1/sqrt(in))
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Linear::forward(const Tensor& x) { return ops::linear(x, weight, bias); }

std::string Linear::extra_repr() const {
  return fmt::format("in_features={}, out_features={}, bias={}", in_features, out_features,
                     bias.defined() ? "True" : "False");
}

Tensor ReLU::forward(const Tensor& x) { return ops::relu(x); }

GELU::GELU(std::string approximate) : Module("GELU"), approximate_(std::move(approximate)) {
  TANDEM_CHECK(approximate_ == "none" || approximate_ == "tanh", ValueError,
               "GELU: approximate must be \"none\" or \"tanh\", got \"{}\"", approximate_);
}

Tensor GELU::forward(const Tensor& x) { return ops::gelu(x, approximate_); }
Tensor Tanh::forward(const Tensor& x) { return ops::tanh(x); }
Tensor Sigmoid::forward(const Tensor& x) { return ops::sigmoid(x); }

Dropout::Dropout(double p) : Module("Dropout"), p_(p) {
  TANDEM_CHECK(p >= 0.0 && p <= 1.0, ValueError, "Dropout: probability must be in [0, 1], got {}", p);
}

Tensor Dropout::forward(const Tensor& x) { return ops::dropout(x, p_, is_training()); }

std::string Dropout::extra_repr() const { return fmt::format("p={}, inplace=False", p_); }

Embedding::Embedding(int64_t num, int64_t dim, std::optional<int64_t> pad, DType dtype)
    : Module("Embedding"), num_embeddings(num), embedding_dim(dim), padding_idx(-1) {
  TANDEM_CHECK(num > 0 && dim > 0, ValueError, "Embedding: sizes must be positive, got {} x {}", num, dim);
  if (pad) {
    TANDEM_CHECK(*pad >= -num && *pad < num, ValueError,
                 "Embedding: padding_idx {} out of range for {} embeddings (expected -{} <= padding_idx < {})", *pad,
                 num, num, num);
    padding_idx = *pad < 0 ? *pad + num : *pad;
  }
  weight = register_parameter("weight", empty({num, dim}, dtype));
  init::normal_(weight, 0.0, 1.0);
  if (padding_idx >= 0) {
    NoGradGuard no_grad;
    weight.select(0, padding_idx).zero_();
  }
}

Tensor Embedding::forward(const Tensor& indices) {
  return ops::embedding(weight, indices, padding_idx >= 0 ? std::optional<int64_t>(padding_idx) : std::nullopt);
}

std::string Embedding::extra_repr() const {
  std::string s = fmt::format("{}, {}", num_embeddings, embedding_dim);
  if (padding_idx >= 0) s += fmt::format(", padding_idx={}", padding_idx);
  return s;
}

int64_t module_index(const std::string& container, int64_t i, size_t n) {
  const auto size = static_cast<int64_t>(n);
  TANDEM_CHECK(i >= -size && i < size, ValueError, "{}: index {} is out of range for {} modules (expected {} <= i < {})",
               container, i, n, -size, size);
  return i < 0 ? i + size : i;
}

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) : Module("Sequential") {
  for (auto& m : modules) push_back(m);
}

void Sequential::push_back(std::shared_ptr<Module> m) {
  register_module(std::to_string(layers_.size()), m);
  layers_.push_back(std::move(m));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& m : layers_) h = m->forward(h);
  return h;
}

}  // namespace tandem::nn
