// SGD / Adam / AdamW against closed forms computed in double, parameter groups, zero_grad,
// state_dict round trips, option validation, LR schedules and clip_grad_norm_.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
namespace optim = tandem::optim;
using td::Tensor;

namespace {

Tensor param(const std::vector<double>& v, td::DType dt = td::kFloat32) {
  Tensor t = td::tensor(v, {static_cast<int64_t>(v.size())}, dt);
  t.requires_grad_(true);
  return t;
}

void set_grad(const Tensor& p, const std::vector<double>& g) {
  p.set_grad(td::tensor(g, {static_cast<int64_t>(g.size())}, p.dtype()));
}

// PyTorch's SGD update in double, element by element (torch.optim.SGD documentation).
struct SgdRef {
  double lr, momentum = 0, dampening = 0, wd = 0;
  bool nesterov = false, maximize = false;
  std::vector<double> buf;
  void step(std::vector<double>& p, const std::vector<double>& g) {
    const bool first = buf.empty();
    if (first) buf.resize(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      double d = maximize ? -g[i] : g[i];
      d += wd * p[i];
      if (momentum != 0) {
        buf[i] = first ? d : momentum * buf[i] + (1 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
};

// PyTorch's Adam / AdamW update in double.
struct AdamRef {
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0;
  bool decoupled = false, amsgrad = false, maximize = false;
  std::vector<double> m, v, vmax;
  int t = 0;
  void step(std::vector<double>& p, const std::vector<double>& g) {
    if (m.empty()) m.assign(p.size(), 0), v.assign(p.size(), 0), vmax.assign(p.size(), 0);
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      double gi = maximize ? -g[i] : g[i];
      if (decoupled) p[i] *= 1 - lr * wd;
      else gi += wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      vmax[i] = std::max(vmax[i], v[i]);
      const double s = amsgrad ? vmax[i] : v[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(s) / std::sqrt(bc2) + eps);
    }
  }
};

const std::vector<double> kP0 = {1, -2, 0.25, 3};
const std::vector<std::vector<double>> kGrads = {{0.5, 0.25, -1, 2}, {-1, 0.5, 0.75, -0.5}, {0.125, -2, 0.5, 1}};

// Tolerances. f64: the same formula in the same order, up to a few ulps of values < 8.
// f32: every step rounds the hyperparameters and ~6 intermediates, each to within 2^-24 relative,
// on values (parameters, momentum buffers) of magnitude < 8; three steps stay below
// 3 * 6 * 8 * 2^-24 = 8.6e-6. A wrong rule (dampening, Nesterov, decay) is off by > 1e-3.
double tol(td::DType dt) { return dt == td::kFloat64 ? 1e-14 : 8.6e-6; }

void expect_near_vec(const Tensor& actual, const std::vector<double>& expected, double atol, const std::string& what) {
  const std::vector<double> a = actual.to_vector();
  ASSERT_EQ(a.size(), expected.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], expected[i], atol) << what << " element " << i;
}

void check_sgd(const optim::SGDOptions& o, td::DType dt, const std::string& what) {
  Tensor p = param(kP0, dt);
  optim::SGD opt({p}, o);
  SgdRef ref{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize};
  std::vector<double> expected = kP0;
  for (const auto& g : kGrads) {
    set_grad(p, g);
    opt.step();
    ref.step(expected, g);
    expect_near_vec(p, expected, tol(dt), what + " " + std::string(td::dtype_name(dt)));
  }
}

}  // namespace

TEST(SGD, HandComputedTwoSteps) {
  // p0 = 1, g1 = 0.5, g2 = -1, lr = 0.1, worked by hand. f32 tolerance: a few ulps of 1 (1e-6).
  struct Case {
    optim::SGDOptions o;
    double p1, p2;
  };
  const Case cases[] = {
      {{.lr = 0.1}, 0.95, 1.05},                                   // p -= lr g
      {{.lr = 0.1, .momentum = 0.9}, 0.95, 1.005},                 // buf2 = 0.45 - 1 = -0.55
      {{.lr = 0.1, .momentum = 0.9, .nesterov = true}, 0.905, 1.0545},  // d = g + 0.9 buf
      {{.lr = 0.1, .momentum = 0.9, .dampening = 0.5}, 0.95, 0.955},    // buf2 = 0.45 - 0.5
      {{.lr = 0.1, .weight_decay = 0.1}, 0.94, 1.0306},            // d = g + 0.1 p
      {{.lr = 0.1, .maximize = true}, 1.05, 0.95},
  };
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    for (const Case& c : cases) {
      Tensor p = param({1.0}, dt);
      optim::SGD opt({p}, c.o);
      set_grad(p, {0.5});
      opt.step();
      EXPECT_NEAR(p.item(), c.p1, dt == td::kFloat64 ? 1e-15 : 1e-6);
      set_grad(p, {-1.0});
      opt.step();
      EXPECT_NEAR(p.item(), c.p2, dt == td::kFloat64 ? 1e-15 : 1e-6);
    }
  }
}

TEST(SGD, MatchesClosedFormOnVectors) {
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    check_sgd({.lr = 0.1}, dt, "plain");
    check_sgd({.lr = 0.05, .momentum = 0.9}, dt, "momentum");
    check_sgd({.lr = 0.05, .momentum = 0.9, .nesterov = true}, dt, "nesterov");
    check_sgd({.lr = 0.05, .momentum = 0.8, .dampening = 0.3}, dt, "dampening");
    check_sgd({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01}, dt, "momentum+wd");
    check_sgd({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true, .maximize = true}, dt, "all");
  }
}

TEST(SGD, DyadicValuesAreExact) {
  // lr, momentum, dampening and every value are short binary fractions: every intermediate is
  // exact in f32, so the f32 result must equal the double closed form exactly.
  for (bool nesterov : {false, true}) {
    optim::SGDOptions o{.lr = 0.25, .momentum = 0.5, .weight_decay = 0.125, .nesterov = nesterov};
    Tensor p = param(kP0);
    optim::SGD opt({p}, o);
    SgdRef ref{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
    std::vector<double> expected = kP0;
    for (const auto& g : kGrads) {
      set_grad(p, g);
      opt.step();
      ref.step(expected, g);
      EXPECT_EQ(p.to_vector(), expected) << "nesterov " << nesterov;
    }
  }
}

TEST(SGD, LargeTensorUsesEveryChunk) {
  // 70001 elements: above the kernels' parallel grain and not a multiple of any vector width.
  const int64_t n = 70001;
  td::Generator gen(4);
  Tensor p = td::rand({n}, td::kFloat32, &gen);
  p.requires_grad_(true);
  const std::vector<double> p0 = p.to_vector();
  Tensor g = td::randn({n}, td::kFloat32, &gen);
  p.set_grad(g);
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
  SgdRef ref{0.1, 0.9, 0, 0.01};
  std::vector<double> expected = p0;
  const std::vector<double> gv = g.to_vector();
  for (int s = 0; s < 2; ++s) {
    opt.step();
    ref.step(expected, gv);
  }
  // |g| < 6 (randn over 70001 draws), so parameters and buffers stay below 12 in magnitude: two
  // steps of ~6 roundings each stay below 2 * 6 * 12 * 2^-24 = 8.6e-6.
  expect_near_vec(p, expected, 8.6e-6, "large");
}

TEST(SGD, SkipsParametersWithoutGradient) {
  Tensor a = param({1, 2}), b = param({3, 4});
  optim::SGD opt({a, b}, {.lr = 0.5, .momentum = 0.9});
  set_grad(a, {1, 1});
  opt.step();
  EXPECT_EQ(a.to_vector(), (std::vector<double>{0.5, 1.5}));
  EXPECT_EQ(b.to_vector(), (std::vector<double>{3, 4}));
  EXPECT_EQ(opt.state_dict().state[1].size(), 0u);  // no momentum buffer for b yet
}

TEST(Adam, HandComputedTwoSteps) {
  // p0 = 1, g1 = 0.5, g2 = -1, lr = 0.1, betas (0.9, 0.999), eps 1e-8. By hand:
  //   step 1: m = 0.05, v = 2.5e-4, m_hat = 0.5, sqrt(v_hat) = 0.5: p = 1 - 0.1 * 0.5 / (0.5 + 1e-8)
  //   step 2: m = -0.055, v = 1.24975e-3, m_hat = -0.055 / 0.19, v_hat = 1.24975e-3 / 1.999e-3
  // AdamW (wd 0.1) first multiplies p by 1 - lr * wd = 0.99.
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    const double t = dt == td::kFloat64 ? 1e-14 : 1e-6;  // f32: a few ulps of 1
    Tensor p = param({1.0}, dt);
    optim::Adam adam({p}, {.lr = 0.1});
    set_grad(p, {0.5});
    adam.step();
    EXPECT_NEAR(p.item(), 0.900000002, t);
    set_grad(p, {-1.0});
    adam.step();
    EXPECT_NEAR(p.item(), 0.9366103542405654, t);

    Tensor q = param({1.0}, dt);
    optim::AdamW adamw({q}, {.lr = 0.1, .weight_decay = 0.1});
    set_grad(q, {0.5});
    adamw.step();
    EXPECT_NEAR(q.item(), 0.890000002, t);
    set_grad(q, {-1.0});
    adamw.step();
    EXPECT_NEAR(q.item(), 0.9177103542205653, t);
  }
  EXPECT_EQ(optim::AdamW::defaults().weight_decay.value(), 1e-2);
  // Options without weight_decay take each optimizer's PyTorch default: torch.optim.AdamW(p, lr=x)
  // decays by 1e-2 (AdamW(p, {.lr = x}) silently decayed by 0 before), Adam by 0.
  Tensor r = param({1.0}, td::kFloat32);
  EXPECT_EQ(optim::AdamW({r}, {.lr = 0.1}).param_groups()[0].options.at("weight_decay"), 1e-2);
  EXPECT_EQ(optim::Adam({r}, {.lr = 0.1}).param_groups()[0].options.at("weight_decay"), 0.0);
  EXPECT_EQ(optim::AdamW({r}, {.lr = 0.1, .weight_decay = 0.0}).param_groups()[0].options.at("weight_decay"), 0.0);
}

// One Adam/AdamW configuration of the closed-form tests: the optimizer over `p` and its reference.
struct AdamCase {
  optim::AdamOptions o;
  bool decoupled;  // AdamW
  const char* what;
};

std::unique_ptr<optim::Optimizer> make_adam(const Tensor& p, const AdamCase& c) {
  if (c.decoupled) return std::make_unique<optim::AdamW>(std::vector<Tensor>{p}, c.o);
  return std::make_unique<optim::Adam>(std::vector<Tensor>{p}, c.o);
}

AdamRef adam_ref(const AdamCase& c) {
  return AdamRef{c.o.lr,      c.o.beta1,   c.o.beta2,  c.o.eps, c.o.weight_decay.value_or(c.decoupled ? 1e-2 : 0.0),
                 c.decoupled, c.o.amsgrad, c.o.maximize};
}

TEST(Adam, MatchesClosedFormOnVectors) {
  const AdamCase cases[] = {
      {{.lr = 0.01}, false, "adam"},
      {{.lr = 0.01, .beta1 = 0.5, .beta2 = 0.9}, false, "betas"},  // beta1 = 0.5: lerp's other branch
      {{.lr = 0.01, .weight_decay = 0.1}, false, "adam+l2"},
      {{.lr = 0.01, .weight_decay = 0.1}, true, "adamw"},
      {{.lr = 0.01, .amsgrad = true}, false, "amsgrad"},
  };
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    for (const AdamCase& c : cases) {
      Tensor p = param(kP0, dt);
      std::unique_ptr<optim::Optimizer> opt = make_adam(p, c);
      AdamRef ref = adam_ref(c);
      std::vector<double> expected = kP0;
      for (const auto& g : kGrads) {
        set_grad(p, g);
        opt->step();
        ref.step(expected, g);
        // Adam's step is ~lr in size and its rounding errors are relative to it; 1e-6 covers f32.
        expect_near_vec(p, expected, dt == td::kFloat64 ? 1e-14 : 1e-6, std::string(c.what) + " " +
                                                                            std::string(td::dtype_name(dt)));
      }
    }
  }
}

// Vectors long enough for whole 16-lane blocks plus a tail (37, 1000 elements), every variant
// including maximize, against the same double reference and tolerance.
TEST(Adam, LongVectorsEveryVariantMatchClosedForm) {
  const AdamCase cases[] = {
      {{.lr = 0.01}, false, "adam"},
      {{.lr = 0.01, .weight_decay = 0.1}, false, "adam+l2"},
      {{.lr = 0.01, .weight_decay = 0.1}, true, "adamw"},
      {{.lr = 0.01, .amsgrad = true}, false, "amsgrad"},
      {{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true, .maximize = true}, true, "adamw+amsgrad+maximize"},
  };
  for (int64_t n : {37, 1000}) {
    // Values of magnitude < 4, as in the tolerance's derivation above.
    std::vector<double> p0(n);
    std::vector<std::vector<double>> grads(3, std::vector<double>(n));
    for (int64_t i = 0; i < n; ++i) {
      p0[i] = std::sin(0.37 * i) * 3;
      for (int s = 0; s < 3; ++s) grads[s][i] = std::cos(0.11 * i + s) * 2;
    }
    for (const AdamCase& c : cases) {
      Tensor p = param(p0, td::kFloat32);
      std::unique_ptr<optim::Optimizer> opt = make_adam(p, c);
      AdamRef ref = adam_ref(c);
      std::vector<double> expected = p.to_vector();  // the f32-rounded start
      for (const auto& g : grads) {
        set_grad(p, g);
        opt->step();
        ref.step(expected, td::tensor(g, {n}, td::kFloat32).to_vector());
        expect_near_vec(p, expected, 1e-6, std::string(c.what) + " n=" + std::to_string(n));
      }
    }
  }
}

TEST(Optimizer, ZeroGradSetToNoneOrZero) {
  Tensor a = param({1, 2});
  optim::SGD opt({a}, {.lr = 0.1});
  set_grad(a, {1, 1});
  Tensor g = a.grad();
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(a.grad().defined());
  EXPECT_TRUE(a.grad().is_same(g));
  EXPECT_EQ(g.to_vector(), (std::vector<double>{0, 0}));
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  opt.step();  // no gradient: nothing happens
  EXPECT_EQ(a.to_vector(), (std::vector<double>{1, 2}));
}

TEST(Optimizer, ParamGroupsHaveTheirOwnLr) {
  Tensor a = param({1}), b = param({1}), c = param({1});
  optim::SGD opt(std::vector<optim::ParamGroup>{{{a}, {{"lr", 0.5}}}, {{b}, {}}}, {.lr = 0.25});
  opt.add_param_group({{c}, {{"lr", 0.125}, {"momentum", 0.5}}});
  ASSERT_EQ(opt.param_groups().size(), 3u);
  EXPECT_EQ(opt.param_groups()[1].options.at("lr"), 0.25);  // the default fills in
  EXPECT_EQ(opt.param_groups()[2].options.at("momentum"), 0.5);
  for (const Tensor& p : {a, b, c}) set_grad(p, {1});
  opt.step();
  EXPECT_EQ(a.item(), 0.5);
  EXPECT_EQ(b.item(), 0.75);
  EXPECT_EQ(c.item(), 0.875);
  EXPECT_THROW(opt.add_param_group({{a}, {}}), td::ValueError);  // a parameter in two groups
  EXPECT_THROW(opt.add_param_group({{param({1})}, {{"beta9", 1.0}}}), td::ValueError);
  EXPECT_THROW(opt.add_param_group({{td::arange(2)}, {}}), td::DTypeError);
  Tensor nonleaf = a * 2.0;
  EXPECT_THROW(opt.add_param_group({{nonleaf}, {}}), td::ValueError);
  EXPECT_THROW(optim::SGD(std::vector<Tensor>{}, {.lr = 0.1}), td::ValueError);  // PyTorch: "empty parameter list"
  EXPECT_THROW(optim::Adam(std::vector<Tensor>{}), td::ValueError);
  EXPECT_THROW(optim::SGD(std::vector<optim::ParamGroup>{}, {.lr = 0.1}), td::ValueError);
}

TEST(Optimizer, StateDictRoundTripGivesIdenticalSteps) {
  auto run = [](auto make) {
    Tensor p = param(kP0), q = param({0.5, -0.5});
    auto opt = make(std::vector<Tensor>{p, q});
    for (int s = 0; s < 2; ++s) {
      set_grad(p, kGrads[s]);
      set_grad(q, {0.3, -0.7});
      opt.step();
    }
    const optim::OptimizerState saved = opt.state_dict();
    // A fresh optimizer over copies of the parameters, restored from the state.
    Tensor p2 = param(p.to_vector()), q2 = param(q.to_vector());
    auto opt2 = make(std::vector<Tensor>{p2, q2});
    opt2.load_state_dict(saved);
    // A control without the state: its third step must differ, or the test proves nothing.
    Tensor p3 = param(p.to_vector()), q3 = param(q.to_vector());
    auto opt3 = make(std::vector<Tensor>{p3, q3});
    for (const Tensor& x : {p, p2, p3}) set_grad(x, kGrads[2]);
    for (const Tensor& x : {q, q2, q3}) set_grad(x, {-0.1, 0.2});
    opt.step();
    opt2.step();
    opt3.step();
    EXPECT_EQ(p2.to_vector(), p.to_vector());
    EXPECT_EQ(q2.to_vector(), q.to_vector());
    EXPECT_NE(p3.to_vector(), p.to_vector());
    return saved;
  };
  const optim::OptimizerState sgd_state =
      run([](std::vector<Tensor> ps) { return optim::SGD(ps, {.lr = 0.1, .momentum = 0.9}); });
  ASSERT_EQ(sgd_state.state.size(), 2u);
  EXPECT_TRUE(sgd_state.state[0].count("momentum_buffer"));
  const optim::OptimizerState adam_state = run([](std::vector<Tensor> ps) { return optim::Adam(ps, {.lr = 0.01}); });
  ASSERT_EQ(adam_state.state.size(), 2u);
  EXPECT_EQ(adam_state.state[0].at("step").item(), 2.0);
  EXPECT_TRUE(adam_state.state[1].count("exp_avg_sq"));
}

TEST(Optimizer, StateDictIsACopyAndLoadValidates) {
  Tensor p = param({1, 2});
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  set_grad(p, {1, 1});
  opt.step();
  optim::OptimizerState s = opt.state_dict();
  {
    td::NoGradGuard no_grad;
    s.state[0].at("momentum_buffer").fill_(100.0);  // must not reach the optimizer
  }
  set_grad(p, {0, 0});
  opt.step();  // buf = 0.9 * 1 = 0.9; p -= 0.09
  EXPECT_NEAR(p.to_vector()[0], 1 - 0.1 - 0.09, 1e-6);
  // Loading restores hyperparameters too.
  s = opt.state_dict();
  s.param_groups[0]["lr"] = 0.5;
  opt.load_state_dict(s);
  EXPECT_EQ(opt.param_groups()[0].options.at("lr"), 0.5);
  // Structure mismatches are rejected, naming the problem.
  optim::OptimizerState wrong_groups = s;
  wrong_groups.param_groups.push_back(s.param_groups[0]);
  EXPECT_THROW(opt.load_state_dict(wrong_groups), td::ValueError);
  optim::OptimizerState wrong_count = s;
  wrong_count.state.push_back({});
  EXPECT_THROW(opt.load_state_dict(wrong_count), td::ValueError);
  optim::OptimizerState wrong_shape = s;
  wrong_shape.state[0]["momentum_buffer"] = td::zeros({3});
  try {
    opt.load_state_dict(wrong_shape);
    ADD_FAILURE();
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("momentum_buffer"), std::string::npos) << e.what();
  }
}

TEST(Optimizer, BadOptionsThrowValueError) {
  Tensor p = param({1});
  EXPECT_THROW(optim::SGD({p}, {.lr = -0.1}), td::ValueError);
  EXPECT_THROW(optim::SGD({p}, {.lr = 0.1, .momentum = -0.5}), td::ValueError);
  EXPECT_THROW(optim::SGD({p}, {.lr = 0.1, .weight_decay = -1}), td::ValueError);
  EXPECT_THROW(optim::SGD({p}, {.lr = 0.1, .nesterov = true}), td::ValueError);  // no momentum
  EXPECT_THROW(optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}), td::ValueError);
  EXPECT_THROW(optim::Adam({p}, {.lr = -1e-3}), td::ValueError);
  EXPECT_THROW(optim::Adam({p}, {.beta1 = 1.0}), td::ValueError);
  EXPECT_THROW(optim::Adam({p}, {.beta2 = -0.1}), td::ValueError);
  EXPECT_THROW(optim::Adam({p}, {.eps = -1e-8}), td::ValueError);
  EXPECT_THROW(optim::AdamW({p}, {.weight_decay = -0.01}), td::ValueError);
  EXPECT_NO_THROW(optim::SGD({p}, {.lr = 0.0}));
}

TEST(LRScheduler, StepLR) {
  Tensor p = param({1});
  optim::SGD opt({p}, {.lr = 1.0});
  optim::StepLR sched(opt, /*step_size=*/3, /*gamma=*/0.1);
  std::vector<double> lrs;
  for (int s = 0; s < 8; ++s) {
    lrs.push_back(sched.get_last_lr()[0]);
    sched.step();
  }
  const std::vector<double> expected = {1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01};
  for (size_t i = 0; i < lrs.size(); ++i) EXPECT_NEAR(lrs[i], expected[i], 1e-15) << "step " << i;
  EXPECT_EQ(sched.last_step(), 8);
  // The optimizer uses the scheduled lr: at step 8, lr = 0.01.
  set_grad(p, {1});
  opt.step();
  EXPECT_NEAR(p.item(), 1 - 0.01, 1e-7);  // f32 parameter: within an ulp of 0.99
  sched.set_last_step(3);
  EXPECT_NEAR(sched.get_last_lr()[0], 0.1, 1e-15);
  EXPECT_THROW(optim::StepLR(opt, 0), td::ValueError);
}

TEST(LRScheduler, WarmupCosine) {
  Tensor a = param({1}), b = param({1});
  optim::SGD opt(std::vector<optim::ParamGroup>{{{a}, {{"lr", 1.0}}}, {{b}, {{"lr", 0.5}}}}, {.lr = 1.0});
  optim::WarmupCosineLR sched(opt, /*warmup=*/4, /*total=*/12, /*min_lr=*/0.01);
  std::vector<std::vector<double>> lrs;
  for (int s = 0; s <= 14; ++s) {
    lrs.push_back(sched.get_last_lr());
    sched.step();
  }
  // warmup: base * s / 4; then min + (base - min) / 2 * (1 + cos(pi * (s - 4) / 8)); min after 12.
  auto cosine = [](double base, int s) { return 0.01 + (base - 0.01) * 0.5 * (1 + std::cos(M_PI * (s - 4) / 8.0)); };
  EXPECT_NEAR(lrs[0][0], 0.0, 1e-15);
  EXPECT_NEAR(lrs[2][0], 0.5, 1e-15);
  EXPECT_NEAR(lrs[2][1], 0.25, 1e-15);
  EXPECT_NEAR(lrs[4][0], 1.0, 1e-15);  // peak
  EXPECT_NEAR(lrs[6][0], 0.01 + 0.99 * 0.5 * (1 + std::sqrt(0.5)), 1e-12);
  EXPECT_NEAR(lrs[8][0], 0.505, 1e-12);  // halfway: the mean of base and min
  EXPECT_NEAR(lrs[8][1], 0.255, 1e-12);
  for (int s = 4; s <= 12; ++s) EXPECT_NEAR(lrs[s][1], cosine(0.5, s), 1e-12) << s;
  EXPECT_NEAR(lrs[12][0], 0.01, 1e-12);
  EXPECT_NEAR(lrs[14][0], 0.01, 1e-15);
  for (int s = 5; s <= 12; ++s) EXPECT_LT(lrs[s][0], lrs[s - 1][0]) << s;  // monotone decay
  EXPECT_THROW(optim::WarmupCosineLR(opt, 5, 4), td::ValueError);
  EXPECT_THROW(optim::WarmupCosineLR(opt, 0, 0), td::ValueError);
}

TEST(ClipGradNorm, ReturnsPreClipNormAndScales) {
  Tensor a = param({0, 0}), b = param({0}), c = param({5});
  set_grad(a, {3, 4});
  set_grad(b, {12});
  // c has no gradient and is skipped. Total 2-norm: sqrt(9 + 16 + 144) = 13.
  const double norm = optim::clip_grad_norm_({a, b, c}, 6.5);
  EXPECT_NEAR(norm, 13.0, 1e-12);
  // Scaled by 6.5 / (13 + 1e-6): f32 rounding of the products is within 1e-7 relative.
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_NEAR(a.grad().to_vector()[0], 3 * coef, 1e-6);
  EXPECT_NEAR(a.grad().to_vector()[1], 4 * coef, 1e-6);
  EXPECT_NEAR(b.grad().to_vector()[0], 12 * coef, 1e-6);
  EXPECT_FALSE(c.grad().defined());
  EXPECT_NEAR(optim::clip_grad_norm_({a, b}, 100.0), 6.5, 1e-5);  // the new norm, unclipped now
  EXPECT_NEAR(b.grad().to_vector()[0], 12 * coef, 1e-6);          // max_norm above the norm: untouched
  // Other norms.
  set_grad(a, {3, -4});
  set_grad(b, {12});
  EXPECT_NEAR(optim::clip_grad_norm_({a, b}, 100.0, 1.0), 19.0, 1e-12);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_NEAR(optim::clip_grad_norm_({a, b}, 6.0, inf), 12.0, 1e-12);
  EXPECT_NEAR(b.grad().to_vector()[0], 12 * 6.0 / (12.0 + 1e-6), 1e-5);
  EXPECT_NEAR(a.grad().to_vector()[1], -4 * 6.0 / (12.0 + 1e-6), 1e-6);
  EXPECT_THROW(optim::clip_grad_norm_({a}, 1.0, 0.5), td::ValueError);
  EXPECT_EQ(optim::clip_grad_norm_({c}, 1.0), 0.0);  // no gradients at all
}

TEST(ClipGradNorm, NonFiniteNorms) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (double bad : {inf, nan}) {
    for (double norm_type : {2.0, inf}) {
      Tensor a = param({0, 0});
      set_grad(a, {1, bad});
      EXPECT_THROW(optim::clip_grad_norm_({a}, 1.0, norm_type, /*error_if_nonfinite=*/true), td::ValueError)
          << bad << " " << norm_type;
      EXPECT_EQ(a.grad().to_vector()[0], 1.0);  // not scaled
      const double n = optim::clip_grad_norm_({a}, 1.0, norm_type);
      EXPECT_FALSE(std::isfinite(n)) << bad << " " << norm_type;
      if (std::isnan(bad)) EXPECT_TRUE(std::isnan(n)) << norm_type;
    }
  }
}

// update_bn (torch.optim.swa_utils.update_bn): running statistics become the plain average of the
// per-batch statistics under the current weights; mode, momentum, weights restored; no gradients.
namespace {

TEST(UpdateBn, RunningStatsAreThePlainAverageOfBatchStatistics) {
  auto model = std::make_shared<td::nn::Sequential>();
  auto lin = std::make_shared<td::nn::Linear>(3, 2);
  auto bn = std::make_shared<td::nn::BatchNorm1d>(2, td::nn::BatchNormOptions{.momentum = 0.3});
  model->push_back(lin);
  model->push_back(bn);
  // Stale statistics that must not survive.
  bn->running_mean.fill_(5.0);
  bn->running_var.fill_(7.0);
  bn->num_batches_tracked.fill_(11.0);
  model->eval();
  td::Generator gen(3);
  std::vector<Tensor> batches{td::randn({4, 3}, td::kFloat32, &gen), td::randn({6, 3}, td::kFloat32, &gen),
                              td::randn({5, 3}, td::kFloat32, &gen)};
  const std::vector<double> w_before = lin->weight.to_vector();
  size_t next = 0;
  const int64_t ran = optim::update_bn(*model, [&] { return next < batches.size() ? batches[next++] : Tensor(); });
  EXPECT_EQ(ran, 3);
  // Expected: mean over batches of each batch's mean and unbiased variance of x W^T + b, in double.
  std::vector<double> mean(2, 0.0), var(2, 0.0);
  const std::vector<double> w = lin->weight.to_vector(), b = lin->bias.to_vector();
  for (const Tensor& x : batches) {
    const std::vector<double> xv = x.to_vector();
    const int64_t n = x.size(0);
    for (int c = 0; c < 2; ++c) {
      std::vector<double> y(n);
      double s = 0;
      for (int64_t i = 0; i < n; ++i) {
        y[i] = b[c];
        for (int k = 0; k < 3; ++k) y[i] += xv[i * 3 + k] * w[c * 3 + k];
        s += y[i];
      }
      const double m = s / n;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += (y[i] - m) * (y[i] - m);
      mean[c] += m / 3;
      var[c] += ss / (n - 1) / 3;
    }
  }
  // f32 statistics of O(1) values over <= 6 rows, averaged with f32 momenta: 1e-5 absolute.
  expect_near_vec(bn->running_mean, mean, 1e-5, "running_mean");
  expect_near_vec(bn->running_var, var, 1e-5, "running_var");
  EXPECT_EQ(bn->num_batches_tracked.item(), 3.0);
  EXPECT_FALSE(model->is_training());
  EXPECT_EQ(bn->options.momentum, 0.3);
  EXPECT_EQ(lin->weight.to_vector(), w_before);
  EXPECT_FALSE(lin->weight.grad().defined());
}

TEST(UpdateBn, NoBatchNormMeansNoForwardAndAThrowRestoresModeAndMomentum) {
  auto plain = std::make_shared<td::nn::Linear>(3, 2);
  int calls = 0;
  EXPECT_EQ(optim::update_bn(*plain, [&] { ++calls; return td::randn({2, 3}); }), 0);
  EXPECT_EQ(calls, 0);

  auto bn = std::make_shared<td::nn::BatchNorm1d>(3);
  bn->eval();
  int n = 0;
  // The second input has the wrong width: BatchNorm's error propagates, the state is restored.
  EXPECT_THROW(optim::update_bn(*bn, [&] { return ++n == 1 ? td::randn({4, 3}) : td::randn({4, 5}); }),
               td::Error);
  EXPECT_FALSE(bn->is_training());
  EXPECT_EQ(bn->options.momentum, 0.1);
}

}  // namespace

// A BatchNorm that runs twice per forward: every call counts once in the plain average (PyTorch's
// update_bn sets momentum=None; a per-forward momentum let each forward's second call overwrite
// its first). Batches [[1],[3]] and [[5],[9]]: the calls see means 2, 0, 7, 0 (the second call
// normalizes the first's output), so running_mean = 9/4.
TEST(UpdateBn, ABatchNormThatRunsTwicePerForwardAveragesEveryCall) {
  auto bn = std::make_shared<td::nn::BatchNorm1d>(1);
  auto model = std::make_shared<td::nn::Sequential>();
  model->push_back(bn);
  model->push_back(bn);
  std::vector<Tensor> batches{td::tensor(std::vector<double>{1, 3}, {2, 1}), td::tensor(std::vector<double>{5, 9}, {2, 1})};
  size_t next = 0;
  EXPECT_EQ(optim::update_bn(*model, [&] { return next < batches.size() ? batches[next++] : Tensor(); }), 2);
  // f32 statistics of small integers and their normalized values: 1e-5 absolute.
  EXPECT_NEAR(bn->running_mean.item(), 2.25, 1e-5);
  EXPECT_EQ(bn->num_batches_tracked.item(), 4.0);
  EXPECT_EQ(bn->options.momentum, 0.1);
}

TEST(ClipGradNorm, ANanNormMakesEveryGradientNanNotJustTheBadOne) {
  // PyTorch multiplies every gradient by clamp(max_norm / (nan + eps), max=1) = nan: the step is
  // visibly bad (a GradScaler skips it), not an unclipped update of the finite parameters.
  Tensor a = param({0, 0}), b = param({0});
  set_grad(a, {1, std::numeric_limits<double>::quiet_NaN()});
  set_grad(b, {100});
  EXPECT_TRUE(std::isnan(optim::clip_grad_norm_({a, b}, 1.0)));
  EXPECT_TRUE(std::isnan(b.grad().to_vector()[0]));
}

// optimizer.load_state_dict checks what it loads as PyTorch does (or stricter, naming the value):
// floating-point state is cast to its parameter's dtype, shapes must match exactly (a one-element
// state is not a step count), groups must hold the same numbers of parameters.
TEST(Optimizer, LoadStateDictCastsStateToEachParametersDtype) {
  Tensor p = param({1, 2, 3, 4});
  optim::Adam a({p}, {.lr = 0.1});
  set_grad(p, {1, -1, 2, -2});
  a.step();
  const optim::OptimizerState s = a.state_dict();
  set_grad(p, {0.5, 0.5, -0.5, -0.5});
  a.step();
  const std::vector<double> want = p.to_vector();
  for (td::DType dt : {td::kFloat64, td::kBFloat16}) {
    Tensor q = param({1, 2, 3, 4}, dt);
    {
      td::NoGradGuard no_grad;
      q.copy_(td::tensor(std::vector<double>{0.9, 2.1, 2.9, 4.1}, {4}).to(dt));  // after step 1 (lr 0.1)
    }
    optim::Adam b({q}, {.lr = 0.1});
    b.load_state_dict(s);
    EXPECT_EQ(b.state(q)->at("exp_avg").dtype(), dt);
    EXPECT_EQ(b.state(q)->at("step").dtype(), td::kFloat64);
    set_grad(q, {0.5, 0.5, -0.5, -0.5});
    b.step();
    // f64: the f32 state's rounding only (1e-6); bf16: one bf16 rounding of values near 4 (2^-6).
    const double tol = dt == td::kFloat64 ? 1e-6 : 0.02;
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(q.to_vector()[i], want[i], tol) << td::dtype_name(dt) << i;
  }
}

TEST(Optimizer, LoadStateDictRefusesStateThatDoesNotFitItsParameter) {
  Tensor small = param({1}), big = param({1, 2, 3, 4, 5});
  optim::Adam a({small, big}, {.lr = 0.1});
  set_grad(small, {1});
  a.step();  // only `small` has state
  optim::OptimizerState s = a.state_dict();
  std::swap(s.state[0], s.state[1]);  // a one-element exp_avg for the 5-element parameter
  Tensor q_big = param({1, 2, 3, 4, 5}), q_small = param({1});
  optim::Adam b({q_small, q_big}, {.lr = 0.1});
  auto expect_refused = [&](const optim::OptimizerState& bad, const std::string& needle) {
    try {
      b.load_state_dict(bad);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(b.state(q_big), nullptr);  // nothing loaded
  };
  expect_refused(s, "has shape [1], the parameter has [5]");
  optim::OptimizerState missing = a.state_dict();
  missing.state[0].erase("exp_avg_sq");
  expect_refused(missing, "no \"exp_avg_sq\"");
  optim::OptimizerState foreign = a.state_dict();
  foreign.state[0]["momentum_buffer"] = td::zeros({1});
  expect_refused(foreign, "\"momentum_buffer\", which Adam does not keep");
  optim::OptimizerState bad_step = a.state_dict();
  bad_step.state[0]["step"] = td::zeros({2});
  expect_refused(bad_step, "must be one number");
  optim::OptimizerState int_state = a.state_dict();
  int_state.state[0]["exp_avg"] = td::zeros({1}, td::kInt64);
  expect_refused(int_state, "floating-point");
  // And the load that fits works: step on q_small continues from step 1.
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.state(q_small)->at("step").item(), 1.0);
}

TEST(Optimizer, LoadStateDictChecksEachGroupsNumberOfParameters) {
  Tensor a = param({1}), b = param({2}), c = param({3});
  optim::SGD saved({{{a, b}, {{"weight_decay", 0.5}}}, {{c}, {}}}, {.lr = 0.1});
  const optim::OptimizerState s = saved.state_dict();
  EXPECT_EQ(s.group_sizes, (std::vector<size_t>{2, 1}));
  Tensor a2 = param({1}), b2 = param({2}), c2 = param({3});
  optim::SGD other({{{a2}, {}}, {{b2, c2}, {}}}, {.lr = 0.1});
  try {
    other.load_state_dict(s);  // same totals: group 0's weight decay would land on b2's neighbour
    ADD_FAILURE();
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("parameter group 0 holds 2 parameters in the state, 1 in the optimizer"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(other.param_groups()[0].options.at("weight_decay"), 0.0);
}

TEST(Adam, AmsgradSwitchedOnAfterTheFirstStepStartsItsMaximumThen) {
  for (td::DType dt : {td::kFloat32, td::kFloat64}) {
    Tensor p = param({1, 2}, dt);
    optim::Adam a({p}, {.lr = 0.1});
    set_grad(p, {4, 4});
    a.step();
    a.param_groups()[0].options["amsgrad"] = 1;
    set_grad(p, {1, 1});
    a.step();  // max_exp_avg_sq starts at zero: max(0, v) = v
    EXPECT_EQ(a.state(p)->at("max_exp_avg_sq").to_vector(), a.state(p)->at("exp_avg_sq").to_vector());
    set_grad(p, {0, 0});
    a.step();  // v shrinks, the maximum stays
    EXPECT_GT(a.state(p)->at("max_exp_avg_sq").to_vector()[0], a.state(p)->at("exp_avg_sq").to_vector()[0]);
  }
}

// A scheduler records each group's initial_lr (PyTorch's setdefault): one made after the optimizer's
// state was loaded, or a second one on the same optimizer, schedules from the original lr.
TEST(LRScheduler, SchedulesFromTheInitialLrRecordedInTheGroup) {
  Tensor p = param({1});
  optim::SGD opt({p}, {.lr = 1.0});
  optim::StepLR s(opt, 2, 0.1);
  for (int i = 0; i < 4; ++i) s.step();
  EXPECT_NEAR(opt.param_groups()[0].options.at("lr"), 0.01, 1e-12);
  EXPECT_EQ(opt.param_groups()[0].options.at(optim::kInitialLr), 1.0);
  const optim::OptimizerState saved = opt.state_dict();

  Tensor q = param({1});
  optim::SGD resumed({q}, {.lr = 1.0});
  resumed.load_state_dict(saved);  // lr 0.01, initial_lr 1
  optim::StepLR s2(resumed, 2, 0.1);
  s2.set_last_step(4);
  EXPECT_NEAR(resumed.param_groups()[0].options.at("lr"), 0.01, 1e-12);  // not 1e-4

  Tensor r = param({1});
  optim::SGD warm({r}, {.lr = 0.5});
  optim::WarmupCosineLR first(warm, 10, 100);  // sets lr to 0 (warmup step 0)
  optim::WarmupCosineLR second(warm, 10, 100);
  second.set_last_step(10);
  EXPECT_NEAR(warm.param_groups()[0].options.at("lr"), 0.5, 1e-12);  // not 0 for ever
}
