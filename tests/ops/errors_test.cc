// Bad input: each case must throw the specific Tandem error type, with a message naming the
// offending values (shapes, dtypes, indices, arguments).
#include <vector>

#include <gtest/gtest.h>

#include "ops/ops_test_util.h"

namespace tandem {
namespace {

using ops_test::f64;
using ops_test::i64;

TEST(OpsErrors, ShapeMismatch) {
  const Tensor a23 = zeros({2, 3}), v4 = zeros({4}), b45 = zeros({4, 5});
  EXPECT_TANDEM_THROW(ops::add(a23, v4), ShapeError, {"[2, 3]", "[4]"});
  EXPECT_TANDEM_THROW(ops::mul(v4, a23), ShapeError, {"[4]", "[2, 3]"});
  EXPECT_TANDEM_THROW(ops::sub(a23, v4), ShapeError, {"[2, 3]", "[4]"});
  EXPECT_TANDEM_THROW(ops::div(a23, zeros({3, 3})), ShapeError, {"[2, 3]", "[3, 3]"});
  EXPECT_TANDEM_THROW(ops::pow(a23, v4), ShapeError, {"[2, 3]", "[4]"});
  EXPECT_TANDEM_THROW(ops::matmul(a23, b45), ShapeError, {"[2, 3]", "[4, 5]"});
  // Vector operands: the message names the caller's shapes, not the internally promoted ones.
  EXPECT_TANDEM_THROW(ops::matmul(zeros({3}), zeros({4})), ShapeError, {"[3]", "[4]"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({3}), zeros({4, 5})), ShapeError, {"[3]", "[4, 5]"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({2, 3}), zeros({4})), ShapeError, {"[2, 3]", "[4]"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({3}), zeros({2, 4, 5})), ShapeError, {"[3]", "[2, 4, 5]"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({2, 2, 3}), zeros({3, 3, 4})), ShapeError, {"[2]", "[3]"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({}), zeros({3})), ShapeError, {"[]", "[3]"});
  // linear with the wrong number of in-features, a 1-d weight, a wrong bias.
  EXPECT_TANDEM_THROW(ops::linear(zeros({2, 3}), zeros({5, 4})), ShapeError, {"[2, 3]", "[5, 4]"});
  EXPECT_TANDEM_THROW(ops::linear(zeros({2, 3}), zeros({3})), ShapeError, {"[3]"});
  EXPECT_TANDEM_THROW(ops::linear(zeros({2, 3}), zeros({5, 3}), zeros({4})), ShapeError, {"[4]", "[5, 3]"});
  // cat with mismatched non-cat dims or ranks; stack of different shapes.
  EXPECT_TANDEM_THROW(ops::cat({zeros({2, 3}), zeros({2, 4})}, 0), ShapeError, {"[2, 4]", "[2, 3]"});
  EXPECT_TANDEM_THROW(ops::cat({zeros({2, 3}), zeros({2, 3, 1})}, 0), ShapeError, {"3 dims", "2"});
  EXPECT_TANDEM_THROW(ops::stack({zeros({2, 3}), zeros({3, 2})}), ShapeError, {"[3, 2]", "[2, 3]"});
  EXPECT_TANDEM_THROW(ops::split_with_sizes(zeros({5, 2}), {2, 2}), ShapeError, {"4", "5"});
  // view of a transposed tensor that would need a copy.
  EXPECT_TANDEM_THROW(zeros({2, 3}).t().view({6}), ShapeError, {"[6]", "[3, 2]", "[1, 3]"});
  EXPECT_TANDEM_THROW(zeros({2, 3, 4}).transpose(0, 1).view({3, 8}), ShapeError, {"[3, 8]", "[3, 2, 4]"});
  // reshape / view to the wrong number of elements.
  EXPECT_TANDEM_THROW(zeros({2, 3}).reshape({4, 2}), ShapeError, {"[4, 2]", "[2, 3]", "6"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).view({-1, 4}), ShapeError, {"[-1, 4]", "[2, 3]"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).reshape({-1, -1}), ShapeError, {"[-1, -1]"});
  // expand of a dimension that is not 1.
  EXPECT_TANDEM_THROW(zeros({2, 3}).expand({4, 3}), ShapeError, {"[2, 3]", "[4, 3]"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).expand({3}), ShapeError, {"[3]", "[2, 3]"});
  // Losses with mismatched target shapes.
  EXPECT_TANDEM_THROW(ops::mse_loss(zeros({2, 3}), zeros({3, 2})), ShapeError, {"[2, 3]", "[3, 2]"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({4, 5}), i64({1, 2, 3}, {3})), ShapeError, {"[4, 5]", "[4]", "[3]"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({5}), i64({1}, {1})), ShapeError, {"[5]", "[1]"});
  EXPECT_TANDEM_THROW(ops::nll_loss(zeros({2, 3, 4}), i64({0, 1}, {2})), ShapeError, {"[2, 3, 4]", "[2, 4]", "[2]"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).permute({0}), ShapeError, {"1 dims", "2-d"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).permute({1, 1}), ShapeError, {"1", "[1, 1]"});
  EXPECT_TANDEM_THROW(zeros({2, 3}).narrow(1, 2, 2), ShapeError, {"2", "size 3"});
  EXPECT_TANDEM_THROW(zeros({2, 3, 4}).t(), ShapeError, {"[2, 3, 4]"});
}

TEST(OpsErrors, DTypeMismatch) {
  EXPECT_TANDEM_THROW(ops::matmul(zeros({2, 3}, kFloat32), zeros({3, 4}, kFloat64)), DTypeError,
                      {"float32", "float64"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({2, 3}, kBFloat16), zeros({3, 4}, kFloat32)), DTypeError,
                      {"bfloat16", "float32"});
  EXPECT_TANDEM_THROW(ops::linear(zeros({2, 3}, kFloat64), zeros({4, 3}, kFloat32)), DTypeError,
                      {"float64", "float32"});
  EXPECT_TANDEM_THROW(ops::matmul(zeros({2, 3}, kInt64), zeros({3, 4}, kInt64)), DTypeError, {"int64"});
  const Tensor ints = i64({1, -2, 3}, {3});
  EXPECT_TANDEM_THROW(ops::relu(ints), DTypeError, {"relu", "int64"});
  EXPECT_TANDEM_THROW(ops::exp(ints), DTypeError, {"exp", "int64"});
  EXPECT_TANDEM_THROW(ops::gelu(ints), DTypeError, {"gelu", "int64"});
  EXPECT_TANDEM_THROW(ops::add(ints, ints), DTypeError, {"int64"});
  EXPECT_TANDEM_THROW(ops::mul(ints, 2.0), DTypeError, {"int64"});
  EXPECT_TANDEM_THROW(ops::sum(ints), DTypeError, {"sum", "int64"});
  EXPECT_TANDEM_THROW(ops::mean(ints.to(kInt32)), DTypeError, {"mean", "int32"});
  EXPECT_TANDEM_THROW(ops::softmax(ints, 0), DTypeError, {"softmax", "int64"});
  EXPECT_TANDEM_THROW(ops::log_softmax(ints, 0), DTypeError, {"log_softmax", "int64"});
  // Class-index targets must be integers; input logits must be floating.
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({2, 3}), zeros({2})), DTypeError, {"float32"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({2, 3}), zeros({2}, kFloat64)), DTypeError, {"float64"});
  EXPECT_TANDEM_THROW(ops::nll_loss(zeros({2, 3}), zeros({2})), DTypeError, {"float32"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(i64({1, 2}, {1, 2}), i64({0}, {1})), DTypeError, {"int64"});
  EXPECT_TANDEM_THROW(ops::index_select(zeros({3, 2}), 0, zeros({2})), DTypeError, {"float32"});
  EXPECT_TANDEM_THROW(ops::embedding(zeros({3, 2}), zeros({2}, kFloat64)), DTypeError, {"float64"});
  // An integer tensor cannot require grad.
  EXPECT_THROW(ints.clone().requires_grad_(true), Error);
}

TEST(OpsErrors, OutOfRange) {
  // Cross entropy targets must be in [0, C) or the ignore_index; the message names the target,
  // its position and the class count.
  const Tensor logits = zeros({3, 10});
  EXPECT_TANDEM_THROW(ops::cross_entropy(logits, i64({1, 10, 2}, {3})), ValueError, {"10", "position 1", "10 classes"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(logits, i64({-1, 0, 2}, {3})), ValueError, {"-1", "position 0"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(logits, i64({0, 0, -100}, {3}), {.ignore_index = 5}), ValueError,
                      {"-100", "position 2"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({10}), i64({12}, {})), ValueError, {"12", "10 classes"});
  EXPECT_TANDEM_THROW(ops::nll_loss(logits, i64({0, 0, 11}, {3})), ValueError, {"11", "position 2", "10 classes"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(zeros({2, 3, 2}), i64({0, 1, 2, 3}, {2, 2})), ValueError, {"3", "3 classes"});
  // Gather indices out of range.
  EXPECT_TANDEM_THROW(ops::index_select(zeros({4, 3}), 0, i64({0, 4}, {2})), ValueError, {"4", "position 1", "[0, 4)"});
  EXPECT_TANDEM_THROW(ops::index_select(zeros({4, 3}), 1, i64({-1}, {1})), ValueError, {"-1", "[0, 3)"});
  EXPECT_TANDEM_THROW(ops::embedding(zeros({5, 2}), i64({0, 3, -1}, {3})), ValueError, {"-1", "position 2", "[0, 5)"});
  EXPECT_TANDEM_THROW(ops::embedding(zeros({5, 2}), i64({5}, {1, 1})), ValueError, {"5", "[0, 5)"});
  // Dimensions out of range: the message names the dimension and the rank.
  const Tensor x = zeros({2, 3});
  EXPECT_TANDEM_THROW(ops::sum(x, {2}), ShapeError, {"sum", "dimension 2", "2-d"});
  EXPECT_TANDEM_THROW(ops::mean(x, {-3}), ShapeError, {"mean", "-3"});
  EXPECT_TANDEM_THROW(ops::sum(x, {0, -2}), ShapeError, {"sum", "repeated"});
  EXPECT_TANDEM_THROW(ops::max(x, 5), ShapeError, {"max", "5"});
  EXPECT_TANDEM_THROW(ops::argmax(x, -3), ShapeError, {"argmax", "-3"});
  EXPECT_TANDEM_THROW(ops::softmax(x, 2), ShapeError, {"softmax", "2"});
  EXPECT_TANDEM_THROW(ops::log_softmax(x, -3), ShapeError, {"log_softmax", "-3"});
  EXPECT_TANDEM_THROW(ops::cat({x, x}, 2), ShapeError, {"cat", "2"});
  EXPECT_TANDEM_THROW(ops::stack({x, x}, 4), ShapeError, {"stack", "4"});
  EXPECT_TANDEM_THROW(ops::split(x, 1, 3), ShapeError, {"split", "3"});
  EXPECT_TANDEM_THROW(ops::chunk(x, 2, -4), ShapeError, {"chunk", "-4"});
  EXPECT_TANDEM_THROW(ops::index_select(x, 2, i64({0}, {1})), ShapeError, {"index_select", "2"});
  EXPECT_TANDEM_THROW(x.transpose(0, 2), ShapeError, {"transpose", "2"});
  EXPECT_TANDEM_THROW(x.select(2, 0), ShapeError, {"select", "2"});
  EXPECT_TANDEM_THROW(x.select(0, 2), ShapeError, {"index 2", "size 2"});
  EXPECT_TANDEM_THROW(x.unsqueeze(4), ShapeError, {"unsqueeze", "4"});
  EXPECT_TANDEM_THROW(x.squeeze(-3), ShapeError, {"squeeze", "-3"});
  EXPECT_TANDEM_THROW(x.flatten(1, 0), ShapeError, {"start_dim 1", "end_dim 0"});
  EXPECT_TANDEM_THROW(ops::max(zeros({0})), ShapeError, {"[0]"});
}

TEST(OpsErrors, BadArguments) {
  const Tensor x = zeros({2, 3});
  EXPECT_TANDEM_THROW(ops::gelu(x, "fast"), ValueError, {"\"fast\"", "none", "tanh"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(x, i64({0, 1}, {2}), {.reduction = "avg"}), ValueError, {"\"avg\"", "mean"});
  EXPECT_TANDEM_THROW(ops::nll_loss(x, i64({0, 1}, {2}), {.reduction = "avg"}), ValueError, {"\"avg\""});
  EXPECT_TANDEM_THROW(ops::mse_loss(x, x, "avg"), ValueError, {"\"avg\""});
  EXPECT_TANDEM_THROW(ops::cross_entropy(x, i64({0, 1}, {2}), {.label_smoothing = 1.5}), ValueError, {"1.5"});
  EXPECT_TANDEM_THROW(ops::cross_entropy(x, i64({0, 1}, {2}), {.label_smoothing = -0.1}), ValueError, {"-0.1"});
  Generator g(0);
  EXPECT_TANDEM_THROW(ops::dropout(x, 1.5, true, &g), ValueError, {"1.5"});
  EXPECT_TANDEM_THROW(ops::dropout(x, -0.2, true, &g), ValueError, {"-0.2"});
  EXPECT_TANDEM_THROW(ops::dropout(x, 1.5, false, &g), ValueError, {"1.5"});  // checked in eval too
  EXPECT_TANDEM_THROW(ops::clamp(x, 1.0, -1.0), ValueError, {"1", "-1"});
  EXPECT_TANDEM_THROW(ops::split(x, 0), ValueError, {"split_size", "0"});
  EXPECT_TANDEM_THROW(ops::split_with_sizes(x, {3, -1}), ValueError, {"-1"});
  EXPECT_TANDEM_THROW(ops::chunk(x, 0), ValueError, {"0"});
  EXPECT_TANDEM_THROW(ops::cat({}), ValueError, {"cat"});
  EXPECT_TANDEM_THROW(ops::stack({}), ValueError, {"stack"});
  EXPECT_TANDEM_THROW(x.slice(1, 0, 3, 0), ValueError, {"step", "0"});
  EXPECT_TANDEM_THROW(x.slice(1, 0, 3, -1), ValueError, {"step", "-1"});
}

// Sums over an empty reduced dim are zeros (the leading-dims path left its output unwritten, so a
// bias gradient of an empty batch was garbage); the mean of nothing is NaN.
TEST(OpsEdgeCases, EmptyReductionsAreZerosAndEmptyBatchesGiveZeroBiasGradients) {
  for (int repeat = 0; repeat < 3; ++repeat) {
    Tensor junk = full({4}, 7.0);  // recycled memory must not show through
    junk = Tensor();
    EXPECT_EQ(ops::sum(zeros({0, 4}), {0}).to_vector(), (std::vector<double>{0, 0, 0, 0}));
    EXPECT_EQ(ops::sum(zeros({0})).item(), 0.0);
    EXPECT_TRUE(std::isnan(ops::mean(zeros({0})).item()));
    Tensor b = zeros({4});
    b.requires_grad_(true);
    ops::sum(ops::add(zeros({0, 4}), b)).backward();
    EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{0, 0, 0, 0}));
  }
}

// Ops that index a dimension refuse 0-d tensors with an error (they crashed).
TEST(OpsEdgeCases, DimensionOpsOnZeroDimTensorsAreErrors) {
  EXPECT_THROW(ops::cat({scalar_tensor(1), scalar_tensor(2)}, 0), ShapeError);
  EXPECT_THROW(ops::split(scalar_tensor(5), 1), ShapeError);
}

// relu passes NaN (PyTorch's clamp_min), so a diverging activation stays visible; the fused
// BatchNorm+ReLU does the same.
TEST(OpsEdgeCases, ReluPassesNan) {
  const std::vector<double> r = ops::relu(f64({NAN, -1, 0, 2}, {4})).to_vector();
  EXPECT_TRUE(std::isnan(r[0]));
  EXPECT_EQ(std::vector<double>(r.begin() + 1, r.end()), (std::vector<double>{0, 0, 2}));
  Tensor x = zeros({2, 3});
  x.data_ptr<float>()[1] = NAN;
  const Tensor y = ops::batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5);
  EXPECT_TRUE(std::isnan(y.to_vector()[1]) || std::isnan(y.to_vector()[4]));
}

// max(x) over everything shares the gradient among tied maxima (PyTorch's
// evenly_distribute_backward); max(x, dim) gives it to the first, as before.
TEST(OpsEdgeCases, FullMaxSharesTheGradientAmongTies) {
  Tensor p = f64({2, 5, 5, 1}, {4});
  p.requires_grad_(true);
  ops::max(p).backward();
  EXPECT_EQ(p.grad().to_vector(), (std::vector<double>{0, 0.5, 0.5, 0}));
}

// embedding's padding_idx as F.embedding's: negative counts from the end, out of range is an error.
TEST(OpsEdgeCases, EmbeddingPaddingIdxWrapsAndIsRangeChecked) {
  Tensor w = zeros({4, 2}, kFloat64);
  w.requires_grad_(true);
  ops::sum(ops::embedding(w, i64({3, 3, 1}, {3}), -1)).backward();
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{0, 0, 1, 1, 0, 0, 0, 0}));
  EXPECT_THROW(ops::embedding(w, i64({1}, {1}), 7), ValueError);
  EXPECT_THROW(ops::embedding(w, i64({1}, {1}), -5), ValueError);
}

// d/de x^e at x = 0 is 0 only for e >= 0; for e < 0 it is -inf (PyTorch's pow_backward_exponent).
TEST(OpsEdgeCases, PowExponentGradientAtZeroBaseWithNegativeExponent) {
  Tensor x = f64({0, 0}, {2});
  Tensor e = f64({-1, 2}, {2});
  e.requires_grad_(true);
  ops::sum(ops::pow(x, e)).backward();
  const std::vector<double> g = e.grad().to_vector();
  EXPECT_TRUE(std::isinf(g[0]) && g[0] < 0) << g[0];
  EXPECT_EQ(g[1], 0.0);
}

// A 0-d operand does not widen a dimensioned one of the same category (torch.result_type):
// bf16[3] * f32 0-d stays bf16 (it became f32, doubling memory and failing later in a bf16 matmul),
// f32[3] + f64 0-d stays f32; a higher category still promotes, and two 0-d or two dimensioned
// operands promote as before.
TEST(OpsEdgeCases, ZeroDimOperandsDoNotWidenDimensionedOnes) {
  EXPECT_EQ(ops::mul(zeros({3}, kBFloat16), scalar_tensor(2, kFloat32)).dtype(), kBFloat16);
  EXPECT_EQ(ops::add(zeros({3}), scalar_tensor(2, kFloat64)).dtype(), kFloat32);
  EXPECT_EQ(ops::add(scalar_tensor(2, kFloat64), zeros({3})).dtype(), kFloat32);
  EXPECT_EQ(ops::add(zeros({3}, kBFloat16), zeros({3})).dtype(), kFloat32);
  EXPECT_EQ(ops::add(scalar_tensor(1, kBFloat16), scalar_tensor(2, kFloat32)).dtype(), kFloat32);
  EXPECT_EQ(ops::result_type(zeros({3}, kInt64), scalar_tensor(2.5, kFloat64)), kFloat64);
  EXPECT_EQ(ops::where(full({3}, 1, kBool), zeros({3}, kBFloat16), scalar_tensor(-1, kFloat32)).dtype(), kBFloat16);
}

}  // namespace
}  // namespace tandem

