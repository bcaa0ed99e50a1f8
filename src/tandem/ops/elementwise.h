// Differentiable elementwise ops with PyTorch's broadcasting and type promotion
// (f32 + bf16 -> f32). 16-bit floats are stored in 16 bits and computed in f32.
#pragma once

#include <string_view>

#include "tandem/core/tensor.h"

namespace tandem::ops {

// The dtype a binary op on `a` and `b` computes in (torch.result_type): a 0-d operand with a
// dimensioned one of the same category (bool < integer < floating) takes the dimensioned one's
// dtype (bf16[3] * f32 0-d is bf16, f32[3] + f64 0-d is f32); otherwise promote_types.
DType result_type(const Tensor& a, const Tensor& b);

Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a - alpha * b
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor rsub(const Tensor& a, double b);  // b - a

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor square(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);
Tensor pow(const Tensor& x, const Tensor& exponent);
Tensor relu(const Tensor& x);
// approximate: "none" (exact, with erf) or "tanh".
Tensor gelu(const Tensor& x, std::string_view approximate = "none");
Tensor sigmoid(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor clamp(const Tensor& x, double min, double max);

// Comparisons (no gradient): bool tensors.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, double b);
// Elements equal as numbers, in any dtypes (for accuracy counts).
int64_t count_equal(const Tensor& a, const Tensor& b);

// Sums `g` down to `shape` over broadcast dimensions (the backward of broadcasting).
Tensor sum_to(const Tensor& g, const Shape& shape);

// Fused backward helpers, exposed for tests and other ops.
Tensor relu_backward(const Tensor& grad, const Tensor& result);
Tensor gelu_backward(const Tensor& grad, const Tensor& x, std::string_view approximate);

}  // namespace tandem::ops

namespace tandem {
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator-(const Tensor& a);
}  // namespace tandem
