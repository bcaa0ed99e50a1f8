// Every op family, forward and backward, against PyTorch (tests/oracle/ops_oracle.py) on
// identical inputs, in f32 and f64. For each case the C++ side computes the outputs, draws fixed
// random weights w_k for every floating output, and takes the gradients of
// sum_k sum(out_k * w_k) with respect to every input leaf; the oracle does the same with torch
// autograd. One python run per family keeps the suite fast (importing torch costs 1-2 s).
//
// Tolerances (|actual - expected| <= atol + rtol * |expected|):
//  * f32: rtol 1e-5, atol max(1e-6, 4 u n s), u = 2^-24 = 6e-8 the f32 unit roundoff, n the
//    longest accumulation behind an element (a matmul's inner dimension, a reduction's length) and
//    s the size of its terms. Elementwise results need only a few u (different but correctly
//    rounded or 1-ulp libm/SLEEF kernels), so rtol 1e-5 leaves two orders of magnitude while a
//    wrong formula, a dropped broadcast term or a wrong gradient is off by far more. atol covers
//    results that cancel to near zero (a sum of n terms of size s carries ~u n s absolute error
//    whatever its value).
//  * f64: rtol 1e-12, atol max(1e-13, 4 u64 n s) with u64 = 2^-53 = 1.1e-16.
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "oracle/oracle_cases.h"
#include "util/test_util.h"

namespace tandem {
namespace {

// The cases of one family, checked against ops_oracle.py in a single python run.
class Family : public testing::OracleCases {
 public:
  Family() : OracleCases({.weight_seed = 4242, .script = "ops_oracle.py"}) {}
  void run() {
    size_t compared = 0;
    (void)OracleCases::run(&compared);
  }
};

std::vector<Tensor> one(Tensor t) { return {std::move(t)}; }

const DType kDTypes[] = {kFloat32, kFloat64};

TEST(OpsOracle, Elementwise) {
  TANDEM_REQUIRE_TORCH();
  Family f;
  for (DType dt : kDTypes) {
    f.add("add_bcast", dt, {f.x({3, 1, 5}, dt), f.x({4, 5}, dt)}, [](const auto& v) { return one(ops::add(v[0], v[1])); }, 12);
    f.add("add_alpha", dt, {f.x({4, 5}, dt), f.x({5}, dt)}, [](const auto& v) { return one(ops::add(v[0], v[1], 2.5)); }, 4, 2.5);
    f.add("sub_alpha", dt, {f.x({2, 3, 4}, dt), f.x({3, 1}, dt)}, [](const auto& v) { return one(ops::sub(v[0], v[1], 0.5)); }, 8);
    f.add("mul_bcast", dt, {f.x({4, 1}, dt), f.x({1, 6}, dt)}, [](const auto& v) { return one(ops::mul(v[0], v[1])); }, 6);
    f.add("div_bcast", dt, {f.x({3, 4}, dt), f.x({4}, dt, 0.5, 2.0)}, [](const auto& v) { return one(ops::div(v[0], v[1])); }, 3, 4);
    f.add("add_scalar", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::add(v[0], 1.5)); });
    f.add("mul_scalar", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::mul(v[0], -0.75)); });
    f.add("div_scalar", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::div(v[0], 3.0)); });
    f.add("rsub_scalar", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::rsub(v[0], 2.0)); });
    f.add("add_transposed", dt, {f.x({5, 4}, dt), f.x({4, 5}, dt)}, [](const auto& v) { return one(ops::add(v[0].t(), v[1])); });
    f.add("reuse", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::add(ops::mul(v[0], v[0]), v[0])); });
    f.add("neg", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::neg(v[0])); });
    f.add("exp", dt, {f.x({37, 29}, dt, -3, 3)}, [](const auto& v) { return one(ops::exp(v[0])); });
    f.add("log", dt, {f.x({37, 29}, dt, 0.1, 5)}, [](const auto& v) { return one(ops::log(v[0])); });
    f.add("sqrt", dt, {f.x({37, 29}, dt, 0.1, 5)}, [](const auto& v) { return one(ops::sqrt(v[0])); });
    f.add("rsqrt", dt, {f.x({37, 29}, dt, 0.1, 5)}, [](const auto& v) { return one(ops::rsqrt(v[0])); });
    f.add("square", dt, {f.x({37, 29}, dt, -2, 2)}, [](const auto& v) { return one(ops::square(v[0])); });
    f.add("abs", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::abs(v[0])); });
    f.add("pow_3", dt, {f.x({37, 29}, dt, -2, 2)}, [](const auto& v) { return one(ops::pow(v[0], 3.0)); });
    f.add("pow_half", dt, {f.x({37, 29}, dt, 0.1, 5)}, [](const auto& v) { return one(ops::pow(v[0], 0.5)); });
    f.add("pow_neg", dt, {f.x({37, 29}, dt, 0.2, 3)}, [](const auto& v) { return one(ops::pow(v[0], -1.5)); });
    f.add("pow_tensor", dt, {f.x({6, 7}, dt, 0.2, 3), f.x({7}, dt, -2, 2)},
          [](const auto& v) { return one(ops::pow(v[0], v[1])); }, 6, 20);
    f.add("relu", dt, {f.x({37, 29}, dt, -2, 2)}, [](const auto& v) { return one(ops::relu(v[0])); });
    f.add("gelu_none", dt, {f.x({37, 29}, dt, -4, 4)}, [](const auto& v) { return one(ops::gelu(v[0], "none")); });
    f.add("gelu_tanh", dt, {f.x({37, 29}, dt, -4, 4)}, [](const auto& v) { return one(ops::gelu(v[0], "tanh")); });
    f.add("sigmoid", dt, {f.x({37, 29}, dt, -6, 6)}, [](const auto& v) { return one(ops::sigmoid(v[0])); });
    f.add("tanh", dt, {f.x({37, 29}, dt, -3, 3)}, [](const auto& v) { return one(ops::tanh(v[0])); });
    f.add("clamp", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::clamp(v[0], -0.5, 0.5)); });
    f.add("composite", dt, {f.x({5, 6}, dt), f.x({6}, dt)}, [](const auto& v) {
      return one(ops::add(ops::tanh(ops::mul(v[0], v[1])), ops::div(v[0], ops::add(ops::exp(v[1]), 1.0))));
    }, 5, 2);
  }
  f.run();
}

TEST(OpsOracle, Reductions) {
  TANDEM_REQUIRE_TORCH();
  Family f;
  for (DType dt : kDTypes) {
    f.add("sum_all", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::sum(v[0])); }, 37 * 29);
    f.add("sum_dims_keepdim", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::sum(v[0], {0, 2}, true)); }, 24);
    f.add("sum_last", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::sum(v[0], {-1})); }, 29);
    f.add("mean_all", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::mean(v[0])); });
    f.add("mean_dim", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::mean(v[0], {1})); });
    f.add("mean_dims_keepdim", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::mean(v[0], {0, 2}, true)); });
    f.add("max_dim", dt, {f.x({5, 7}, dt)}, [](const auto& v) {
      auto [values, indices] = ops::max(v[0], 1);
      return std::vector<Tensor>{values, indices};
    });
    f.add("max_dim_keepdim", dt, {f.x({5, 7}, dt)}, [](const auto& v) {
      auto [values, indices] = ops::max(v[0], 0, true);
      return std::vector<Tensor>{values, indices};
    });
    f.add("max_all", dt, {f.x({6, 7}, dt)}, [](const auto& v) { return one(ops::max(v[0])); });
    f.add("argmax", dt, {f.c({5, 7}, dt)}, [](const auto& v) { return one(ops::argmax(v[0], -1)); });
    f.add("min_dim", dt, {f.x({5, 7}, dt)}, [](const auto& v) {
      auto [values, indices] = ops::min(v[0], 1);
      return std::vector<Tensor>{values, indices};
    });
    f.add("min_dim_keepdim", dt, {f.x({5, 7}, dt)}, [](const auto& v) {
      auto [values, indices] = ops::min(v[0], 0, true);
      return std::vector<Tensor>{values, indices};
    });
    f.add("min_all", dt, {f.x({6, 7}, dt)}, [](const auto& v) { return one(ops::min(v[0])); });
    f.add("argmin", dt, {f.c({5, 7}, dt)}, [](const auto& v) { return one(ops::argmin(v[0], -1)); });
    // var/std: two passes over at most 37 * 29 terms of size ~1 (the squared deviations).
    f.add("var_all", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::var(v[0])); }, 37 * 29);
    f.add("var_dims_keepdim", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::var(v[0], {0, 2}, 1.0, true)); }, 24);
    f.add("var_correction0", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::var(v[0], {-1}, 0.0)); }, 6);
    f.add("std_dim", dt, {f.x({4, 5, 6}, dt)}, [](const auto& v) { return one(ops::std(v[0], {1})); }, 5);
    f.add("std_all_correction2", dt, {f.x({37, 29}, dt)}, [](const auto& v) { return one(ops::std(v[0], {}, 2.0)); }, 37 * 29);
  }
  f.run();
}

TEST(OpsOracle, MatmulAndLinear) {
  TANDEM_REQUIRE_TORCH();
  Family f;
  for (DType dt : kDTypes) {
    f.add("mm", dt, {f.x({7, 64}, dt), f.x({64, 9}, dt)}, [](const auto& v) { return one(ops::matmul(v[0], v[1])); }, 64, 2);
    f.add("mm_transposed", dt, {f.x({40, 7}, dt), f.x({40, 9}, dt)},
          [](const auto& v) { return one(ops::matmul(v[0].t(), v[1])); }, 40, 2);
    f.add("bmm", dt, {f.x({3, 7, 33}, dt), f.x({3, 33, 5}, dt)}, [](const auto& v) { return one(ops::matmul(v[0], v[1])); }, 33, 2);
    f.add("matmul_bcast", dt, {f.x({2, 1, 4, 16}, dt), f.x({3, 16, 5}, dt)},
          [](const auto& v) { return one(ops::matmul(v[0], v[1])); }, 16, 2);
    f.add("matmul_3d_2d", dt, {f.x({3, 7, 16}, dt), f.x({16, 5}, dt)},
          [](const auto& v) { return one(ops::matmul(v[0], v[1])); }, 21, 2);
    f.add("dot", dt, {f.x({50}, dt), f.x({50}, dt)}, [](const auto& v) { return one(ops::matmul(v[0], v[1])); }, 50, 2);
    f.add("linear_bias", dt, {f.x({5, 32}, dt), f.x({12, 32}, dt), f.x({12}, dt)},
          [](const auto& v) { return one(ops::linear(v[0], v[1], v[2])); }, 33, 2);
    f.add("linear_nobias", dt, {f.x({2, 5, 32}, dt), f.x({12, 32}, dt)},
          [](const auto& v) { return one(ops::linear(v[0], v[1])); }, 32, 2);
    f.add("linear_3d_bias", dt, {f.x({2, 3, 20}, dt), f.x({7, 20}, dt), f.x({7}, dt)},
          [](const auto& v) { return one(ops::linear(v[0], v[1], v[2])); }, 21, 2);
  }
  f.run();
}

TEST(OpsOracle, SoftmaxAndLosses) {
  TANDEM_REQUIRE_TORCH();
  Family f;
  const Tensor t8 = tensor(std::vector<int64_t>{0, 4, 2, 2, 1, 3, 0, 4}, {8});
  const Tensor t8_ignore = tensor(std::vector<int64_t>{0, -100, 2, 1, -100, 3, 1, 4}, {8});
  const Tensor t6 = tensor(std::vector<int64_t>{0, 4, 2, 0, 1, 3}, {6});
  const Tensor t6_ignore = tensor(std::vector<int64_t>{0, -100, 2, 0, -100, 3}, {6});
  std::vector<int64_t> t4d_values, t4d_ignore_values;
  for (int64_t i = 0; i < 24; ++i) {
    t4d_values.push_back((i * 7 + 3) % 5);
    t4d_ignore_values.push_back(i % 5 == 2 ? -100 : (i * 3 + 1) % 5);
  }
  const Tensor t4d = tensor(t4d_values, {2, 3, 4});
  const Tensor t4d_ignore = tensor(t4d_ignore_values, {2, 3, 4});
  const Tensor all_ignored = tensor(std::vector<int64_t>{-100, -100, -100}, {3});
  const Tensor t_scalar = tensor(std::vector<int64_t>{3}, {});

  using O = ops::CrossEntropyOptions;
  auto ce = [](O o) {
    return [o](const std::vector<Tensor>& v) { return one(ops::cross_entropy(v[0], v[1], o)); };
  };
  // With class weights (the third input, a constant).
  auto ce_w = [](O o) {
    return [o](const std::vector<Tensor>& v) {
      O with = o;
      with.weight = v[2];
      return one(ops::cross_entropy(v[0], v[1], with));
    };
  };
  auto nll = [](ops::NllLossOptions o) {
    return [o](const std::vector<Tensor>& v) { return one(ops::nll_loss(v[0], v[1], o)); };
  };
  for (DType dt : kDTypes) {
    for (const auto& [name, dim] : std::vector<std::pair<std::string, int64_t>>{{"softmax_1", 1}, {"softmax_last", -1}, {"softmax_0", 0}}) {
      const int64_t d = dim;
      f.add(name, dt, {f.x({4, 5, 6}, dt, -5, 5)}, [d](const auto& v) { return one(ops::softmax(v[0], d)); }, 6);
    }
    for (const auto& [name, dim] : std::vector<std::pair<std::string, int64_t>>{{"log_softmax_1", 1}, {"log_softmax_last", -1}, {"log_softmax_0", 0}}) {
      const int64_t d = dim;
      f.add(name, dt, {f.x({4, 5, 6}, dt, -5, 5)}, [d](const auto& v) { return one(ops::log_softmax(v[0], d)); }, 6, 5);
    }
    auto logits = [&](const Shape& s) { return f.x(s, dt, -3, 3); };
    f.add("ce_mean", dt, {logits({8, 5}), t8}, ce({}), 8, 3);
    f.add("ce_sum", dt, {logits({8, 5}), t8}, ce({.reduction = "sum"}), 8, 3);
    f.add("ce_none", dt, {logits({8, 5}), t8}, ce({.reduction = "none"}), 5, 3);
    f.add("ce_ignore", dt, {logits({8, 5}), t8_ignore}, ce({}), 8, 3);
    f.add("ce_ignore_sum", dt, {logits({8, 5}), t8_ignore}, ce({.reduction = "sum"}), 8, 3);
    f.add("ce_ignore_custom", dt, {logits({8, 5}), t8}, ce({.ignore_index = 1}), 8, 3);
    f.add("ce_smooth", dt, {logits({8, 5}), t8}, ce({.label_smoothing = 0.1}), 40, 3);
    f.add("ce_smooth_sum", dt, {logits({8, 5}), t8}, ce({.label_smoothing = 0.1, .reduction = "sum"}), 40, 3);
    f.add("ce_smooth_none", dt, {logits({8, 5}), t8}, ce({.label_smoothing = 0.1, .reduction = "none"}), 5, 3);
    f.add("ce_smooth_ignore", dt, {logits({8, 5}), t8_ignore}, ce({.label_smoothing = 0.1}), 40, 3);
    f.add("ce_smooth_ignore_none", dt, {logits({8, 5}), t8_ignore},
          ce({.label_smoothing = 0.1, .reduction = "none"}), 5, 3);
    f.add("ce_4d_mean", dt, {logits({2, 5, 3, 4}), t4d}, ce({}), 24, 3);
    f.add("ce_4d_none", dt, {logits({2, 5, 3, 4}), t4d}, ce({.reduction = "none"}), 5, 3);
    f.add("ce_4d_smooth_ignore", dt, {logits({2, 5, 3, 4}), t4d_ignore}, ce({.label_smoothing = 0.1}), 120, 3);
    f.add("ce_1d", dt, {logits({5}), t_scalar}, ce({}), 5, 3);
    f.add("ce_all_ignored", dt, {logits({3, 4}), all_ignored}, ce({}));
    auto class_weights = [&](int64_t C) { return f.c({C}, dt, 0.2, 2.0); };
    f.add("ce_weight_mean", dt, {logits({8, 5}), t8, class_weights(5)}, ce_w({}), 8, 6);
    f.add("ce_weight_sum", dt, {logits({8, 5}), t8, class_weights(5)}, ce_w({.reduction = "sum"}), 8, 6);
    f.add("ce_weight_none", dt, {logits({8, 5}), t8, class_weights(5)}, ce_w({.reduction = "none"}), 5, 6);
    f.add("ce_weight_smooth_ignore", dt, {logits({8, 5}), t8_ignore, class_weights(5)},
          ce_w({.label_smoothing = 0.1}), 40, 6);
    f.add("ce_weight_4d_smooth_none", dt, {logits({2, 5, 3, 4}), t4d_ignore, class_weights(5)},
          ce_w({.label_smoothing = 0.2, .reduction = "none"}), 5, 6);
    f.add("nll_mean", dt, {f.x({6, 5}, dt, -3, 0), t6}, nll({}), 6, 3);
    f.add("nll_sum", dt, {f.x({6, 5}, dt, -3, 0), t6}, nll({.reduction = "sum"}), 6, 3);
    f.add("nll_none", dt, {f.x({6, 5}, dt, -3, 0), t6}, nll({.reduction = "none"}));
    f.add("nll_ignore", dt, {f.x({6, 5}, dt, -3, 0), t6_ignore}, nll({}), 6, 3);
    f.add("nll_ignore_custom", dt, {f.x({6, 5}, dt, -3, 0), t6}, nll({.ignore_index = 0, .reduction = "sum"}), 6, 3);
    f.add("mse_mean", dt, {f.x({7, 9}, dt), f.x({7, 9}, dt)}, [](const auto& v) { return one(ops::mse_loss(v[0], v[1])); }, 63, 4);
    f.add("mse_sum", dt, {f.x({7, 9}, dt), f.x({7, 9}, dt)},
          [](const auto& v) { return one(ops::mse_loss(v[0], v[1], "sum")); }, 63, 4);
    f.add("mse_none", dt, {f.x({7, 9}, dt), f.x({7, 9}, dt)},
          [](const auto& v) { return one(ops::mse_loss(v[0], v[1], "none")); });
  }
  f.run();
}

TEST(OpsOracle, ShapeOps) {
  TANDEM_REQUIRE_TORCH();
  Family f;
  const Tensor idx0 = tensor(std::vector<int64_t>{3, 0, 3, 1, 4}, {5});
  const Tensor idx1_i32 = tensor(std::vector<int64_t>{2, 2, 0, 5}, {4}).to(kInt32);
  const Tensor emb_idx = tensor(std::vector<int64_t>{1, 7, 2, 1, 9, 2, 0, 7}, {2, 4});
  auto many = [](std::vector<Tensor> v) { return v; };
  for (DType dt : kDTypes) {
    f.add("cat_0", dt, {f.x({2, 3}, dt), f.x({4, 3}, dt), f.x({1, 3}, dt)},
          [](const auto& v) { return one(ops::cat({v[0], v[1], v[2]}, 0)); });
    f.add("cat_1", dt, {f.x({2, 3, 4}, dt), f.x({2, 1, 4}, dt)}, [](const auto& v) { return one(ops::cat({v[0], v[1]}, 1)); });
    f.add("cat_last", dt, {f.x({3, 2}, dt), f.x({3, 5}, dt)}, [](const auto& v) { return one(ops::cat({v[0], v[1]}, -1)); });
    f.add("stack_0", dt, {f.x({3, 4}, dt), f.x({3, 4}, dt)}, [](const auto& v) { return one(ops::stack({v[0], v[1]}, 0)); });
    f.add("stack_1", dt, {f.x({3, 4}, dt), f.x({3, 4}, dt)}, [](const auto& v) { return one(ops::stack({v[0], v[1]}, 1)); });
    f.add("split", dt, {f.x({3, 7}, dt)}, [many](const auto& v) { return many(ops::split(v[0], 2, 1)); });
    f.add("split_sizes", dt, {f.x({6, 4}, dt)}, [many](const auto& v) { return many(ops::split_with_sizes(v[0], {1, 3, 2}, 0)); });
    f.add("chunk_3", dt, {f.x({3, 8}, dt)}, [many](const auto& v) { return many(ops::chunk(v[0], 3, 1)); });
    f.add("chunk_uneven", dt, {f.x({6, 2}, dt)}, [many](const auto& v) { return many(ops::chunk(v[0], 4, 0)); });
    f.add("index_select_0", dt, {f.x({5, 3}, dt), idx0}, [](const auto& v) { return one(ops::index_select(v[0], 0, v[1])); });
    f.add("index_select_1_i32", dt, {f.x({2, 6}, dt), idx1_i32},
          [](const auto& v) { return one(ops::index_select(v[0], 1, v[1])); });
    f.add("embedding", dt, {f.x({10, 4}, dt), emb_idx}, [](const auto& v) { return one(ops::embedding(v[0], v[1])); });
    f.add("embedding_padding", dt, {f.x({10, 4}, dt), emb_idx},
          [](const auto& v) { return one(ops::embedding(v[0], v[1], 2)); });
    f.add("views", dt, {f.x({2, 3, 4}, dt)}, [](const auto& v) {
      return one(ops::mul(v[0].permute({2, 0, 1}).reshape({4, 6}).t().slice(0, 1, 5, 2), 2.0));
    });
    f.add("expand_select", dt, {f.x({4, 1}, dt)}, [](const auto& v) {
      return one(ops::add(v[0].expand({3, 4, 5}).select(1, 2), ops::sum(v[0].narrow(0, 1, 2))));
    }, 15);
  }
  f.run();
}

}  // namespace
}  // namespace tandem
