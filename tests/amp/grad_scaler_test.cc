// GradScaler: PyTorch's defaults and call-order errors, unscale -> clip -> step, state_dict,
// injected inf (skip, bitwise-unchanged parameters and Adam state, backoff, provenance), the
// found_inf reducer, DeepSpeed's hysteresis / min_loss_scale / static scale, the warning, and the
// f16 underflow demo.
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

struct Tiny {
  Tensor w, b;
  Tiny() {
    Generator g(7);
    w = randn({4, 3}, kFloat32, &g);
    b = randn({4}, kFloat32, &g);
    w.requires_grad_(true);
    b.requires_grad_(true);
    w.set_name("fc.weight");
    b.set_name("fc.bias");
  }
  Tensor loss() const {
    Generator g(8);
    const Tensor x = randn({5, 3}, kFloat32, &g);
    return ops::mean(ops::square(ops::linear(x, w, b)));
  }
};

TEST(GradScaler, DefaultsArePyTorchs) {
  amp::GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0);
  EXPECT_EQ(s.get_growth_factor(), 2.0);
  EXPECT_EQ(s.get_backoff_factor(), 0.5);
  EXPECT_EQ(s.get_growth_interval(), 2000);
  EXPECT_TRUE(s.is_enabled());
  amp::GradScaler d({.enabled = false});
  EXPECT_EQ(d.get_scale(), 1.0);
  EXPECT_TRUE(d.state_dict().empty());
  amp::GradScaler p({.initial_scale_power = 12});
  EXPECT_EQ(p.get_scale(), 4096.0);
  EXPECT_THROW(amp::GradScaler({.growth_factor = 0.5}), ValueError);
  EXPECT_THROW(amp::GradScaler({.growth_interval = 0}), ValueError);
}

TEST(GradScaler, CallOrderErrors) {
  Tiny m;
  optim::SGD opt({m.w, m.b}, {.lr = 0.1});
  amp::GradScaler s;
  EXPECT_THROW(s.update(), Error);  // nothing recorded yet
  s.scale(m.loss()).backward();
  s.unscale_(opt);
  EXPECT_THROW(s.unscale_(opt), Error);  // twice
  EXPECT_TRUE(s.step(opt));
  EXPECT_THROW(s.step(opt), Error);      // step twice
  EXPECT_THROW(s.unscale_(opt), Error);  // unscale after step
  s.update();
  opt.zero_grad();
  s.scale(m.loss()).backward();
  EXPECT_TRUE(s.step(opt));  // a new iteration is fine
  s.update();
}

// unscale_ gives the true gradients (equal to an unscaled backward: scaling by a power of two is
// exact), so clip_grad_norm_ between unscale_ and step clips the real norm.
TEST(GradScaler, UnscaleClipStep) {
  Tiny a, b;
  a.loss().backward();
  const Tensor gw = a.w.grad().clone(), gb = a.b.grad().clone();
  optim::SGD opt({b.w, b.b}, {.lr = 0.1});
  amp::GradScaler s;
  s.scale(b.loss()).backward();
  s.unscale_(opt);
  EXPECT_TRUE(bitwise_equal(b.w.grad(), gw));
  EXPECT_TRUE(bitwise_equal(b.b.grad(), gb));
  const double norm = optim::clip_grad_norm_({b.w, b.b}, 0.01);
  EXPECT_GT(norm, 0.01);
  const Tensor clipped = b.w.grad().clone();
  const Tensor before = b.w.detach().clone();
  EXPECT_TRUE(s.step(opt));  // no second unscale
  s.update();
  EXPECT_TRUE(all_close(b.w.detach(), ops::sub(before, ops::mul(clipped, 0.1)), 1e-6, 1e-7));
}

TEST(GradScaler, StateDictRoundTrip) {
  Tiny m;
  optim::SGD opt({m.w, m.b}, {.lr = 0.1});
  amp::GradScaler s({.init_scale = 1024, .growth_interval = 3});
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    s.scale(m.loss()).backward();
    s.step(opt);
    s.update();
  }
  const auto sd = s.state_dict();
  EXPECT_EQ(sd.at("scale"), 1024.0);
  EXPECT_EQ(sd.at("_growth_tracker"), 2.0);
  amp::GradScaler r;
  r.load_state_dict(sd);
  EXPECT_EQ(r.get_scale(), 1024.0);
  EXPECT_EQ(r.get_growth_interval(), 3);
  // one more good step grows both
  for (amp::GradScaler* x : {&s, &r}) {
    opt.zero_grad();
    x->scale(m.loss()).backward();
    x->step(opt);
    x->update();
  }
  EXPECT_EQ(s.get_scale(), 2048.0);
  EXPECT_EQ(r.get_scale(), 2048.0);
  EXPECT_THROW(r.load_state_dict({}), ValueError);
  s.update(77.0);  // update(new_scale)
  EXPECT_EQ(s.get_scale(), 77.0);
}

// The acceptance case: an inf in one gradient skips the step, leaves every parameter and every
// Adam state bitwise unchanged, halves the scale, and provenance names that parameter.
TEST(GradScaler, InjectedInfSkipsAndNamesTheParameter) {
  Tiny m;
  optim::AdamW opt({m.w, m.b}, {.lr = 1e-2});
  std::vector<std::string> lines;
  amp::GradScaler s({.provenance = true, .log = [&](const std::string& l) { lines.push_back(l); }});
  // one good step so that Adam has state
  s.scale(m.loss()).backward();
  ASSERT_TRUE(s.step(opt));
  s.update();
  const Tensor w0 = m.w.detach().clone(), b0 = m.b.detach().clone();
  const auto st0 = opt.state_dict();
  opt.zero_grad();
  s.scale(m.loss()).backward();
  m.b.grad().data_ptr<float>()[1] = INFINITY;
  m.b.grad().data_ptr<float>()[3] = NAN;
  EXPECT_FALSE(s.step(opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 32768.0);
  EXPECT_TRUE(bitwise_equal(m.w.detach(), w0));
  EXPECT_TRUE(bitwise_equal(m.b.detach(), b0));
  const auto st1 = opt.state_dict();
  ASSERT_EQ(st0.state.size(), st1.state.size());
  for (size_t i = 0; i < st0.state.size(); ++i) {
    for (const auto& [k, v] : st0.state[i]) EXPECT_TRUE(bitwise_equal(v, st1.state[i].at(k))) << k;
  }
  ASSERT_TRUE(s.last_overflow().has_value());
  const auto& rep = *s.last_overflow();
  ASSERT_EQ(rep.entries.size(), 1u);
  EXPECT_EQ(rep.entries[0].name, "fc.bias");
  EXPECT_EQ(rep.entries[0].num_inf, 1);
  EXPECT_EQ(rep.entries[0].num_nan, 1);
  EXPECT_EQ(rep.rank, 0);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("fc.bias (1 inf, 1 nan of 4)"), std::string::npos) << lines[0];
}

// Distributed agreement: the reducer sees the local flag and its answer decides (a rank whose
// own gradients are finite still skips when another rank overflowed).
TEST(GradScaler, FoundInfReducerDecides) {
  Tiny m;
  optim::SGD opt({m.w, m.b}, {.lr = 0.1});
  std::vector<bool> seen;
  bool other_rank_overflowed = true;
  amp::GradScaler s({.found_inf_reducer = [&](bool local) {
                       seen.push_back(local);
                       return local || other_rank_overflowed;
                     },
                     .rank = 3,
                     .provenance = true,
                     .log = [](const std::string&) {}});
  const Tensor w0 = m.w.detach().clone();
  s.scale(m.loss()).backward();
  EXPECT_FALSE(s.step(opt));
  s.update();
  EXPECT_TRUE(bitwise_equal(m.w.detach(), w0));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_FALSE(seen[0]);
  ASSERT_TRUE(s.last_overflow().has_value());
  EXPECT_FALSE(s.last_overflow()->local);
  EXPECT_EQ(s.last_overflow()->rank, 3);
  other_rank_overflowed = false;
  opt.zero_grad();
  s.scale(m.loss()).backward();
  EXPECT_TRUE(s.step(opt));
  s.update();
}

// DeepSpeed's documented rules (DynamicLossScaler.update_scale): with hysteresis H the scale
// backs off only at the H-th overflow since it last grew (non-consecutive mode) — or since the
// last good step with consecutive_hysteresis — never below min_loss_scale; it doubles after
// loss_scale_window good steps in a row.
TEST(LossScaleRule, DeepSpeedHysteresisAndMinScale) {
  amp::LossScaleRule r({.init_scale = 1024, .growth_interval = 4, .hysteresis = 2, .min_loss_scale = 256});
  r.update(true);  // first overflow: absorbed by hysteresis
  EXPECT_EQ(r.scale(), 1024.f);
  r.update(false);
  r.update(true);  // second overflow (not consecutive, but hysteresis was not refilled): back off
  EXPECT_EQ(r.scale(), 512.f);
  r.update(true);
  EXPECT_EQ(r.scale(), 256.f);
  r.update(true);  // floor
  EXPECT_EQ(r.scale(), 256.f);
  for (int i = 0; i < 3; ++i) r.update(false);
  EXPECT_EQ(r.scale(), 256.f);
  r.update(false);  // 4th good step in a row: grow, hysteresis refilled
  EXPECT_EQ(r.scale(), 512.f);
  r.update(true);  // absorbed again
  EXPECT_EQ(r.scale(), 512.f);
  EXPECT_EQ(r.hysteresis_left(), 1);

  amp::LossScaleRule c({.init_scale = 1024, .growth_interval = 100, .hysteresis = 2, .consecutive_hysteresis = true});
  c.update(true);   // absorbed
  c.update(false);  // refills
  c.update(true);   // absorbed again
  EXPECT_EQ(c.scale(), 1024.f);
  c.update(true);   // two in a row: back off
  EXPECT_EQ(c.scale(), 512.f);

  amp::LossScaleRule st({.init_scale = 128, .growth_interval = 1, .dynamic = false});
  st.update(true);
  st.update(false);
  EXPECT_EQ(st.scale(), 128.f);

  // PyTorch's rule: growth only when finite
  amp::LossScaleRule big({.init_scale = 0x1p127, .growth_interval = 1});
  big.update(false);
  EXPECT_EQ(big.scale(), 0x1p127f);
}

TEST(GradScaler, WarnsOnceAfterConsecutiveSkipsOrAtMinScale) {
  Tiny m;
  optim::SGD opt({m.w, m.b}, {.lr = 0.1});
  std::vector<std::string> lines;
  amp::GradScaler s({.warn_after_skips = 3, .log = [&](const std::string& l) { lines.push_back(l); }});
  for (int i = 0; i < 6; ++i) {
    opt.zero_grad();
    s.scale(m.loss()).backward();
    m.w.grad().data_ptr<float>()[0] = NAN;
    s.step(opt);
    s.update();
  }
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("3 consecutive steps skipped"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("lower the learning rate"), std::string::npos);
  EXPECT_EQ(s.consecutive_skips(), 6);

  lines.clear();
  amp::GradScaler f({.init_scale = 4, .min_loss_scale = 2, .provenance = true, .warn_after_skips = 0,
                     .log = [&](const std::string& l) { lines.push_back(l); }});
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    f.scale(m.loss()).backward();
    m.w.grad().data_ptr<float>()[0] = INFINITY;
    f.step(opt);
    f.update();
  }
  EXPECT_EQ(f.get_scale(), 2.0);
  std::string warn;
  for (const auto& l : lines)
    if (l.find("warning") != std::string::npos) warn += l;
  EXPECT_NE(warn.find("min_loss_scale"), std::string::npos) << warn;
  EXPECT_NE(warn.find("fc.weight"), std::string::npos) << warn;
}

// The underflow demo. A 2-layer net whose true gradients are ~1e-8..1e-9 (below f16's smallest
// subnormal, 6e-8, for most elements) trained in f16 weights: without scaling every gradient
// flushes to zero and nothing trains; with GradScaler (scale 2^16 lifts them into f16's normal
// range) the unscaled f32 master gradients match an f32 computation within f16 tolerance and the
// loss decreases.
TEST(GradScaler, F16UnderflowDemo) {
  Generator g(11);
  const Tensor x = randn({64, 16}, kFloat32, &g), target = ops::mul(randn({64, 4}, kFloat32, &g), 1e-4);
  const Tensor w1_0 = ops::mul(randn({32, 16}, kFloat32, &g), 0.25), w2_0 = ops::mul(randn({4, 32}, kFloat32, &g), 0.25);
  // loss = 1e-6 * mse: tiny loss weight (as a long-sequence mean or a small auxiliary loss gives)
  auto loss_of = [&](const Tensor& w1, const Tensor& w2, DType dt) {
    const Tensor h = ops::relu(ops::linear(x.to(dt), w1));
    return ops::mul(ops::mse_loss(ops::linear(h, w2).to(kFloat32), target), 1e-6);
  };
  // f32 reference gradients
  Tensor r1 = w1_0.clone(), r2 = w2_0.clone();
  r1.requires_grad_(true);
  r2.requires_grad_(true);
  loss_of(r1, r2, kFloat32).backward();
  const double gmax = ops::max(ops::abs(r1.grad())).item();
  ASSERT_GT(gmax, 0.0);
  // f16 weights, no scaling: every gradient is zero
  Tensor h1 = w1_0.to(kFloat16), h2 = w2_0.to(kFloat16);
  h1.requires_grad_(true);
  h2.requires_grad_(true);
  loss_of(h1, h2, kFloat16).backward();
  EXPECT_EQ(ops::max(ops::abs(h1.grad().to(kFloat32))).item(), 0.0);
  // f16 weights with f32 masters and the scaler
  Tensor m1 = w1_0.clone(), m2 = w2_0.clone();
  m1.requires_grad_(true);
  m2.requires_grad_(true);
  optim::SGD opt({m1, m2}, {.lr = 2e5});
  amp::GradScaler scaler;
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    Tensor l1 = m1.detach().to(kFloat16), l2 = m2.detach().to(kFloat16);
    l1.requires_grad_(true);
    l2.requires_grad_(true);
    const Tensor loss = loss_of(l1, l2, kFloat16);
    scaler.scale(loss).backward();
    m1.set_grad(l1.grad().to(kFloat32));
    m2.set_grad(l2.grad().to(kFloat32));
    scaler.unscale_(opt);
    if (step == 0) {
      first = loss.item();
      // f16 tolerance: the scaled gradients are rounded to f16 (2^-11 relative) after f16
      // activations (inputs and h rounded: a few 2^-11); 1% of the largest element covers it.
      EXPECT_TRUE(all_close(m1.grad(), r1.grad(), 1e-2, 1e-2 * gmax));
      EXPECT_GT(ops::max(ops::abs(m1.grad())).item(), 0.0);
    }
    ASSERT_TRUE(scaler.step(opt));
    scaler.update();
    opt.zero_grad();
    last = loss.item();
  }
  EXPECT_LT(last, 0.5 * first);
}

// PyTorch refuses to unscale f16 gradients (unscaled, small values fall below f16's range: a
// 1e-9 gradient became 0). Refused here too, and every gradient's dtype is checked before any is
// divided: a refused unscale_ leaves all of them, and the scaler's state, as they were.
TEST(GradScaler, Fp16OrF64GradientsAreRefusedBeforeAnyGradientChanges) {
  for (DType bad : {kFloat16, kFloat64}) {
    SCOPED_TRACE(dtype_name(bad));
    Tensor a = ones({3});
    a.requires_grad_(true);
    a.set_name("a");
    Tensor b = ones({2}, bad);
    b.requires_grad_(true);
    b.set_name("b");
    a.set_grad(full({3}, 65536.0));
    b.set_grad(full({2}, 65536.0, bad));
    optim::SGD opt({a, b}, {.lr = 0.1});
    amp::GradScaler s;
    try {
      s.unscale_(opt);
      ADD_FAILURE() << "expected DTypeError";
    } catch (const DTypeError& e) {
      EXPECT_NE(std::string(e.what()).find("(b)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{65536, 65536, 65536}));  // not divided
    b.set_grad(Tensor());
    s.unscale_(opt);  // the retry unscales once
    EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{1, 1, 1}));
  }
}

// A step with no gradient at all is a forgotten scale(loss).backward() (PyTorch: "No inf checks
// were recorded for this optimizer"), not a good step counted toward growth.
TEST(GradScaler, StepWithoutAnyGradientIsAnError) {
  Tiny m;
  optim::SGD opt({m.w, m.b}, {.lr = 0.1});
  amp::GradScaler s;
  try {
    s.step(opt);
    ADD_FAILURE() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no inf checks were recorded"), std::string::npos) << e.what();
  }
}

// The scale grows and backs off as torch._amp_update_scale_: f32 scale times the f64 factor,
// rounded once (rounding the factor to f32 first drifted from the second step on, e.g.
// 58392.57421875 instead of 58392.578125 with growth 1.1). Closed form in double, rounded per step.
TEST(LossScaleRule, NonPowerOfTwoFactorsRoundOnceAsPyTorch) {
  amp::LossScaleRule rule({.init_scale = 65536.0, .growth_factor = 1.1, .backoff_factor = 0.9, .growth_interval = 1});
  float want = 65536.0f;
  const bool overflow[8] = {false, false, true, false, true, true, false, false};
  for (bool o : overflow) {
    rule.update(o);
    want = static_cast<float>(static_cast<double>(want) * (o ? 0.9 : 1.1));
    ASSERT_EQ(rule.scale(), want);
  }
  amp::LossScaleRule two({.init_scale = 65536.0, .growth_factor = 1.1, .growth_interval = 1});
  two.update(false);
  two.update(false);
  EXPECT_EQ(two.scale(), 79298.5625f);  // torch 2.x: 65536 -> 72089.6015625 -> 79298.5625
}

// load_state_dict checks the whole state before it changes anything: a NaN, zero or negative scale
// (every later step skipped, or a scale stuck at 0) and an invalid growth_interval are refused, and
// the scaler keeps its settings (get_growth_interval used to report the rejected value).
TEST(GradScaler, LoadStateDictRefusesBadValuesAndChangesNothing) {
  amp::GradScaler s;
  const auto good = s.state_dict();
  for (auto [key, value] : std::vector<std::pair<std::string, double>>{
           {"scale", std::nan("")}, {"scale", 0.0}, {"scale", -4.0}, {"growth_interval", 0.0}, {"growth_factor", 3.0},
           {"_growth_tracker", -1.0}}) {
    SCOPED_TRACE(key + " " + std::to_string(value));
    auto bad = good;
    bad[key] = value;
    if (key == "growth_factor") bad["growth_interval"] = 0.0;  // valid factor, invalid interval
    EXPECT_THROW(s.load_state_dict(bad), ValueError);
    EXPECT_EQ(s.state_dict(), good);
    EXPECT_EQ(s.get_growth_interval(), 2000);
    EXPECT_EQ(s.get_growth_factor(), 2.0);
  }
}

}  // namespace
}  // namespace tandem
