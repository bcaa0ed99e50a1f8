// Training against PyTorch (tests/oracle/train_oracle.py): the 784-1024-1024-10 MLP trained
// from identical weights on identical batches with SGD and AdamW must give the same losses and
// parameters; every optimizer variant's update rule alone, on identical gradient sequences; and
// clip_grad_norm_.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;
using testing::find_tensor;

// One training / optimizer configuration, passed to the oracle as "name:key=value,...".
struct RunSpec {
  std::string name;
  std::string optimizer;  // "sgd", "adam" or "adamw"
  int steps = 5;
  optim::SGDOptions sgd;
  optim::AdamOptions adam;
  double clip = 0;  // max grad norm before each step; 0: none

  std::string oracle_arg() const {
    std::string s = fmt::format("{}:optimizer={},steps={},clip={:.17g}", name, optimizer, steps, clip);
    if (optimizer == "sgd") {
      s += fmt::format(",lr={:.17g},momentum={:.17g},dampening={:.17g},weight_decay={:.17g},nesterov={:d},maximize={:d}",
                       sgd.lr, sgd.momentum, sgd.dampening, sgd.weight_decay, sgd.nesterov, sgd.maximize);
    } else {
      s += fmt::format(",lr={:.17g},beta1={:.17g},beta2={:.17g},eps={:.17g},weight_decay={:.17g},amsgrad={:d},maximize={:d}",
                       adam.lr, adam.beta1, adam.beta2, adam.eps,
                       adam.weight_decay.value_or(optimizer == "adamw" ? 1e-2 : 0.0),  // each class's default
                       adam.amsgrad, adam.maximize);
    }
    return s;
  }

  std::unique_ptr<optim::Optimizer> make(std::vector<Tensor> params) const {
    if (optimizer == "sgd") return std::make_unique<optim::SGD>(std::move(params), sgd);
    if (optimizer == "adam") return std::make_unique<optim::Adam>(std::move(params), adam);
    return std::make_unique<optim::AdamW>(std::move(params), adam);
  }
};

RunSpec sgd_spec(std::string name, int steps, optim::SGDOptions o) {
  RunSpec s;
  s.name = std::move(name);
  s.optimizer = "sgd";
  s.steps = steps;
  s.sgd = o;
  return s;
}

RunSpec adam_spec(std::string name, std::string kind, int steps, optim::AdamOptions o) {
  RunSpec s;
  s.name = std::move(name);
  s.optimizer = std::move(kind);
  s.steps = steps;
  s.adam = o;
  return s;
}

using Files = std::vector<std::pair<std::string, Tensor>>;

// ---------------------------------------------------------------------------------------------
// MLP training

struct Batches {
  std::vector<Tensor> xs, ys;
};

// `count` batches of 32 images (32, 1, 28, 28) uniform in [0, 1) with labels in [0, 10).
Batches make_batches(int count) {
  Generator g(2024);
  Batches b;
  for (int i = 0; i < count; ++i) {
    b.xs.push_back(rand({32, 1, 28, 28}, kFloat32, &g));
    b.ys.push_back(randint(0, 10, {32}, &g));
  }
  return b;
}

void add_batches(Files& files, const Batches& b) {
  for (size_t i = 0; i < b.xs.size(); ++i) {
    files.emplace_back(fmt::format("data.x{}", i), b.xs[i]);
    files.emplace_back(fmt::format("data.y{}", i), b.ys[i]);
  }
}

struct TrainResult {
  std::vector<double> losses;
  nn::StateDict grad0;   // the first step's gradients
  nn::StateDict final_;  // parameters after the last step
};

// The loop train_oracle.py runs: zero_grad, cross_entropy, backward, [clip], step.
TrainResult train(nn::Module& model, const Batches& b, const RunSpec& spec) {
  auto opt = spec.make(model.parameters());
  TrainResult r;
  for (int step = 0; step < spec.steps; ++step) {
    const size_t i = static_cast<size_t>(step) % b.xs.size();
    opt->zero_grad();
    Tensor loss = ops::cross_entropy(model(b.xs[i]), b.ys[i]);
    loss.backward();
    if (spec.clip > 0) optim::clip_grad_norm_(model.parameters(), spec.clip);
    if (step == 0)
      for (const auto& [name, p] : model.named_parameters()) r.grad0.emplace_back(name, p.grad().clone());
    opt->step();
    r.losses.push_back(loss.item());
  }
  for (const auto& [name, p] : model.named_parameters()) r.final_.emplace_back(name, p.detach().clone());
  return r;
}

struct Tolerance {
  double rtol, atol;
};

// How far `actual` is from `expected`: the elements beyond atol + rtol * |expected| and the
// largest absolute difference.
struct Deviation {
  int64_t beyond = 0, numel = 0;
  double max_abs = 0;
};
Deviation deviation(const Tensor& actual, const Tensor& expected, Tolerance tol) {
  const std::vector<double> a = actual.to_vector(), e = expected.to_vector();
  Deviation d;
  d.numel = static_cast<int64_t>(e.size());
  for (size_t i = 0; i < e.size(); ++i) {
    const double diff = std::abs(a[i] - e[i]);
    if (!(diff <= tol.atol + tol.rtol * std::abs(e[i]))) ++d.beyond;
    if (!std::isnan(d.max_abs) && !(diff <= d.max_abs)) d.max_abs = diff;  // a NaN sticks
  }
  return d;
}

// Final parameters of a training run. Elementwise rtol/atol; with Adam, a few ill-conditioned
// elements may exceed it (see kAdamParamTol): at most `outlier_fraction` of a tensor, and none by
// more than `outlier_atol`.
struct ParamTolerance {
  Tolerance elementwise;
  double outlier_fraction = 0;
  double outlier_atol = 0;
};

// Trains `model` here and in torch for every spec (each from the model's initial weights) and
// compares losses, first-step gradients and final parameters.
void compare_training(nn::Module& model, const Batches& batches, const std::vector<RunSpec>& specs, Tolerance loss_tol,
                      Tolerance grad_tol, ParamTolerance sgd_tol, ParamTolerance adam_tol) {
  const nn::StateDict init = [&] {
    nn::StateDict s;
    for (const auto& [name, t] : model.state_dict()) s.emplace_back(name, t.clone());
    return s;
  }();
  Files files;
  add_batches(files, batches);
  std::vector<std::string> args = {"train", "", ""};
  for (const RunSpec& spec : specs) {
    for (const auto& [name, t] : init) files.emplace_back(spec.name + ".init." + name, t);
    args.push_back(spec.oracle_arg());
  }
  testing::TempDir in, out;
  testing::save_tensors(in.path(), files);
  args[1] = in.path();
  args[2] = out.path();

  std::vector<TrainResult> results;
  for (const RunSpec& spec : specs) {
    model.load_state_dict(init);
    results.push_back(train(model, batches, spec));
  }
  ASSERT_EQ(testing::run_oracle("train_oracle.py", args), 0) << "train_oracle.py failed";
  const auto expected = testing::load_tensors(out.path());

  for (size_t k = 0; k < specs.size(); ++k) {
    const RunSpec& spec = specs[k];
    const TrainResult& r = results[k];
    SCOPED_TRACE(spec.oracle_arg());
    const Tensor want_losses = find_tensor(expected, spec.name + ".losses");
    const Tensor losses = tensor(r.losses, {static_cast<int64_t>(r.losses.size())}, kFloat64);
    EXPECT_TRUE(all_close(losses, want_losses, loss_tol.rtol, loss_tol.atol))
        << "losses " << losses << " vs torch " << want_losses;
    for (const auto& [name, g] : r.grad0)
      EXPECT_TRUE(all_close(g, find_tensor(expected, spec.name + ".grad0." + name), grad_tol.rtol, grad_tol.atol))
          << "first-step gradient of " << name;
    const ParamTolerance& tol = spec.optimizer == "sgd" ? sgd_tol : adam_tol;
    for (const auto& [name, p] : r.final_) {
      const Tensor want = find_tensor(expected, spec.name + ".final." + name);
      if (tol.outlier_fraction == 0) {
        EXPECT_TRUE(all_close(p, want, tol.elementwise.rtol, tol.elementwise.atol)) << "final " << name;
      } else {
        const Deviation d = deviation(p, want, tol.elementwise);
        EXPECT_LE(static_cast<double>(d.beyond), tol.outlier_fraction * static_cast<double>(d.numel))
            << "final " << name << ": " << d.beyond << " of " << d.numel << " elements beyond rtol="
            << tol.elementwise.rtol << " atol=" << tol.elementwise.atol << " (worst " << d.max_abs << ")";
        EXPECT_LE(d.max_abs, tol.outlier_atol) << "final " << name << ": " << d.beyond << " of " << d.numel
                                               << " elements beyond rtol/atol";
        if (d.beyond > 0) {
          std::printf("[ note     ] %s final %s: %lld of %lld elements beyond rtol=%g atol=%g, worst |diff| %.3g\n",
                      spec.name.c_str(), name.c_str(), static_cast<long long>(d.beyond), static_cast<long long>(d.numel),
                      tol.elementwise.rtol, tol.elementwise.atol, d.max_abs);
        }
      }
      // Training moved the parameter (so agreeing at the end is not agreeing at the start).
      EXPECT_FALSE(all_close(p, testing::find_tensor(init, name), 1e-6, 0)) << name << " did not change";
    }
  }
}

std::shared_ptr<nn::Sequential> seeded_mlp(const nn::models::MlpOptions& o = {}) {
  manual_seed(0);
  return nn::models::mlp(o);
}

// Tolerances of the MLP runs. The two sides differ only in rounding: the f32 GEMMs sum 784 or
// 1024 products in different orders (oneDNN's blocking vs torch's reference BLAS), a relative
// error of a few u * sqrt(K) ~ 1e-6 in an activation, and less in the loss, a batch average.
// The acceptance criterion is losses within 1e-5 relative.
constexpr Tolerance kLossTol{1e-5, 0};
// Gradients: rounding ~ u * K * |terms| on elements that cancel to near zero; rtol 1e-4 with
// atol 1e-7 (gradient elements reach ~1e-2) still catches any wrong formula.
constexpr Tolerance kGradTol{1e-4, 1e-7};
// SGD: a parameter moves by lr * (accumulated gradient), ~0.05 * 5 * 1e-2 over a run, so the
// gradients' ~1e-6 relative disagreement leaves ~1e-9 in parameters of size ~3e-2. rtol 1e-6
// with atol 3e-8 (rtol times the typical parameter, for those near zero) holds for every
// element (measured: at most half of it) and is far below the size of one update.
constexpr ParamTolerance kSgdParamTol{{1e-6, 3e-8}};
// Adam/AdamW: the acceptance criterion is rtol 1e-6, with atol 1e-7 for parameters near zero
// (1e-4 of one lr = 1e-3 step, 3e-6 of the typical weight 1/sqrt(784)). It holds for >99.9% of
// the elements, but not for all, and cannot: Adam's step lr * m / (sqrt(v) + eps) does not
// shrink with the gradient, so an element whose gradient is at rounding level at some step
// (|g| ~ eps = 1e-8 from cancellation in the GEMM sums; a ReLU input within rounding of 0)
// takes a step that depends on the last bits of its gradient. Measured on this run: Tandem vs
// torch, 196 / 705 / 14 elements of 1/3/5.weight beyond rtol 1e-6 + atol 1e-7 (worst 4.6e-5);
// torch vs the same torch with its GEMMs accumulated in f64, 923 / 948 / 14 (worst 7e-5). So a
// tensor may have up to 1% such elements (a wrong update rule moves nearly all of them) and
// none may be off by more than one full step, lr.
constexpr ParamTolerance kAdamParamTol{{1e-6, 1e-7}, 1e-2, 1e-3};

TEST(TrainOracle, MlpSgdMomentum) {
  TANDEM_REQUIRE_TORCH();
  auto model = seeded_mlp();
  std::vector<std::string> names;
  for (const auto& [name, t] : model->named_parameters()) names.push_back(name);
  ASSERT_EQ(names, (std::vector<std::string>{"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}));
  compare_training(*model, make_batches(5), {sgd_spec("sgd", 5, {.lr = 0.05, .momentum = 0.9})}, kLossTol, kGradTol,
                   kSgdParamTol, kAdamParamTol);
}

TEST(TrainOracle, MlpAdamW) {
  TANDEM_REQUIRE_TORCH();
  auto model = seeded_mlp();
  // 10 steps over the 5 batches.
  compare_training(
      *model, make_batches(5),
      {adam_spec("adamw", "adamw", 10, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01})},
      kLossTol, kGradTol, kSgdParamTol, kAdamParamTol);
}

TEST(TrainOracle, SmallMlpOptimizerVariants) {
  TANDEM_REQUIRE_TORCH();
  // The same loop on a 784-128-64-10 MLP, to keep the suite fast (torch's f32 GEMM here is the
  // reference BLAS): Adam with weight decay and amsgrad; SGD with Nesterov and weight decay
  // (torch forbids Nesterov with dampening); SGD with dampening and weight decay; SGD with
  // gradient clipping (clip_grad_norm_ before each step).
  auto model = seeded_mlp({.in_features = 784, .hidden = {128, 64}, .num_classes = 10});
  // Like torch ("Nesterov momentum requires a momentum and zero dampening").
  EXPECT_THROW(optim::SGD(model->parameters(), {.lr = 0.05, .momentum = 0.9, .dampening = 0.3, .nesterov = true}),
               ValueError);
  RunSpec clipped = sgd_spec("sgd_clip", 5, {.lr = 0.05, .momentum = 0.9});
  clipped.clip = 0.5;
  compare_training(*model, make_batches(5),
                   {adam_spec("adam_amsgrad", "adam", 10, {.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true}),
                    sgd_spec("sgd_nesterov", 5, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}),
                    sgd_spec("sgd_dampening", 5, {.lr = 0.05, .momentum = 0.9, .dampening = 0.3, .weight_decay = 1e-3}),
                    clipped},
                   kLossTol, kGradTol, kSgdParamTol, kAdamParamTol);
}

// ---------------------------------------------------------------------------------------------
// Update rules alone: identical parameters and gradient sequences, so the only differences are
// the rounding of each step's few operations (torch's add(x, alpha=a) is an FMA, Tandem's is
// not): an ulp or two of the operands per step. An element that cancels (a momentum buffer
// 0.9 * 3.0 - 2.6) keeps the absolute error of its largest terms, so after 10 steps the
// tolerance is rtol 16 u plus atol 20 u * max|expected| (u = 2^-24 in f32, 2^-53 in f64):
// ~2 ulps of the largest element per step. A wrong bias correction, eps placement, decay,
// dampening or momentum rule is off by 1e-5 relative or more.

TEST(TrainOracle, OptimizerUpdateRules) {
  TANDEM_REQUIRE_TORCH();
  const std::vector<RunSpec> specs = {
      sgd_spec("sgd_plain", 10, {.lr = 0.1}),
      sgd_spec("sgd_momentum", 10, {.lr = 0.05, .momentum = 0.9}),
      sgd_spec("sgd_nesterov_wd", 10, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true}),
      sgd_spec("sgd_dampening_wd", 10, {.lr = 0.05, .momentum = 0.9, .dampening = 0.3, .weight_decay = 1e-2}),
      sgd_spec("sgd_maximize", 10, {.lr = 0.05, .momentum = 0.5, .maximize = true}),
      adam_spec("adam", "adam", 10, {.lr = 1e-3}),
      adam_spec("adam_wd_amsgrad", "adam", 10, {.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true}),
      adam_spec("adamw", "adamw", 10, {.lr = 1e-3, .weight_decay = 0.01}),
      adam_spec("adamw_amsgrad", "adamw", 10, {.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true}),
      adam_spec("adam_betas", "adam", 10, {.lr = 1e-2, .beta1 = 0.5, .beta2 = 0.9, .eps = 1e-6}),
      adam_spec("adamw_maximize", "adamw", 10, {.lr = 1e-2, .beta1 = 0.8, .weight_decay = 0.1, .maximize = true}),
  };
  const std::vector<Shape> shapes = {{37, 29}, {64}, {5, 3}};
  struct Run {
    RunSpec spec;
    DType dtype;
    std::vector<Tensor> params;
    optim::OptimizerState state;
  };
  std::vector<Run> runs;
  Files files;
  std::vector<std::string> args = {"rules", "", ""};
  uint64_t seed = 100;
  for (DType dt : {kFloat32, kFloat64}) {
    for (RunSpec spec : specs) {
      spec.name += dt == kFloat64 ? "__f64" : "__f32";
      Run run{spec, dt, {}, {}};
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor p = testing::leaf(shapes[i], -1, 1, seed++, dt);
        files.emplace_back(fmt::format("{}.p{}", spec.name, i), p.detach().clone());
        run.params.push_back(p);
      }
      auto opt = spec.make(run.params);
      Generator g(seed++);
      for (int t = 0; t < spec.steps; ++t) {
        // Gradient sizes that change from step to step (so amsgrad's running max matters).
        const double scale = t % 3 == 0 ? 2.0 : 0.25;
        for (size_t i = 0; i < run.params.size(); ++i) {
          Tensor grad = randn(shapes[i], dt, &g);
          grad.mul_(scale);
          files.emplace_back(fmt::format("{}.g{}.{}", spec.name, t, i), grad);
          run.params[i].set_grad(grad.clone());
        }
        opt->step();
      }
      run.state = opt->state_dict();
      args.push_back(spec.oracle_arg());
      runs.push_back(std::move(run));
    }
  }
  testing::TempDir in, out;
  testing::save_tensors(in.path(), files);
  args[1] = in.path();
  args[2] = out.path();
  ASSERT_EQ(testing::run_oracle("train_oracle.py", args), 0) << "train_oracle.py failed";
  const auto expected = testing::load_tensors(out.path());

  size_t state_compared = 0;
  for (const Run& run : runs) {
    SCOPED_TRACE(run.spec.oracle_arg());
    const double u = run.dtype == kFloat64 ? 0x1p-53 : 0x1p-24;
    auto close = [u](const Tensor& actual, const Tensor& want) {
      const Tensor max_abs = ops::max(ops::abs(want.to(kFloat64)));
      return all_close(actual, want, 16 * u, 20 * u * max_abs.item());
    };
    for (size_t i = 0; i < run.params.size(); ++i) {
      EXPECT_TRUE(close(run.params[i].detach(), find_tensor(expected, fmt::format("{}.final{}", run.spec.name, i))))
          << "parameter " << i;
      // Every state tensor torch keeps, Tandem keeps under the same name with the same values.
      const std::string prefix = fmt::format("{}.state{}.", run.spec.name, i);
      for (const auto& [key, want] : expected) {
        if (key.rfind(prefix, 0) != 0) continue;
        const std::string state_key = key.substr(prefix.size());
        const auto& st = run.state.state.at(i);
        auto it = st.find(state_key);
        if (it == st.end()) {
          ADD_FAILURE() << "Tandem has no state \"" << state_key << "\" for parameter " << i;
          continue;
        }
        EXPECT_TRUE(close(it->second.to(want.dtype()), want)) << "state " << key;
        // With beta1 = 0.5 torch 1.13's exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1) has exact
        // products, so computing it in that order gives torch's exp_avg bit for bit (a lerp,
        // torch 2's order, does not).
        if (state_key == "exp_avg" && run.spec.adam.beta1 == 0.5)
          EXPECT_TRUE(all_close(it->second, want, 0, 0)) << "state " << key << " (beta1 = 0.5) is not exact";
        ++state_compared;
      }
    }
  }
  EXPECT_GT(state_compared, runs.size());  // the state was really compared
}

// ---------------------------------------------------------------------------------------------
// clip_grad_norm_: the returned total norm and the clipped gradients. torch computes the norm
// in the gradients' dtype (f32 per-tensor norms, then the norm of those) and Tandem in f64, so
// they differ by a few f32 roundings: rtol 1e-6 (f64: 1e-12) on the norm and on the gradients it
// scales; atol 0 since nothing cancels.

TEST(TrainOracle, ClipGradNorm) {
  TANDEM_REQUIRE_TORCH();
  struct ClipCase {
    std::string name;
    double max_norm;
    double norm_type;
  };
  const std::vector<ClipCase> cases = {{"l2_clipped", 0.5, 2.0},   {"l2_unclipped", 100.0, 2.0}, {"inf_clipped", 0.3, INFINITY},
                                       {"inf_unclipped", 10.0, INFINITY}, {"l3_clipped", 0.5, 3.0},   {"l1_clipped", 1.0, 1.0}};
  const std::vector<Shape> shapes = {{5, 4}, {7}, {3}, {2, 2}};
  struct Run {
    std::string name;
    DType dtype;
    std::vector<Tensor> params;
    double norm;
  };
  std::vector<Run> runs;
  Files files;
  std::vector<std::string> args = {"clip", "", ""};
  uint64_t seed = 300;
  for (DType dt : {kFloat32, kFloat64}) {
    for (const ClipCase& c : cases) {
      Run run{c.name + (dt == kFloat64 ? "__f64" : "__f32"), dt, {}, 0};
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor p = testing::leaf(shapes[i], -1, 1, seed++, dt);
        files.emplace_back(fmt::format("{}.p{}", run.name, i), p.detach().clone());
        if (i != 2) {  // parameter 2 has no gradient and must be skipped
          Tensor g = testing::leaf(shapes[i], -1, 1, seed++, dt).detach();
          files.emplace_back(fmt::format("{}.g{}", run.name, i), g.clone());
          p.set_grad(g);
        }
        run.params.push_back(p);
      }
      run.norm = optim::clip_grad_norm_(run.params, c.max_norm, c.norm_type);
      args.push_back(fmt::format("{}:max_norm={:.17g},norm_type={}", run.name, c.max_norm,
                                 std::isinf(c.norm_type) ? std::string("inf") : fmt::format("{:.17g}", c.norm_type)));
      runs.push_back(std::move(run));
    }
  }
  testing::TempDir in, out;
  testing::save_tensors(in.path(), files);
  args[1] = in.path();
  args[2] = out.path();
  ASSERT_EQ(testing::run_oracle("train_oracle.py", args), 0) << "train_oracle.py failed";
  const auto expected = testing::load_tensors(out.path());

  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    const double rtol = run.dtype == kFloat64 ? 1e-12 : 1e-6;
    EXPECT_TRUE(all_close(scalar_tensor(run.norm, kFloat64), find_tensor(expected, run.name + ".norm"), rtol, 0)) << "norm";
    for (size_t i = 0; i < run.params.size(); ++i) {
      if (i == 2) {
        EXPECT_FALSE(run.params[i].grad().defined());
        continue;
      }
      EXPECT_TRUE(all_close(run.params[i].grad(), find_tensor(expected, fmt::format("{}.clipped{}", run.name, i)), rtol, 0))
          << "gradient " << i;
    }
  }
}

}  // namespace
}  // namespace tandem
