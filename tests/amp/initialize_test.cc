// amp::initialize (O0-O3) and amp::scale_loss: what each level casts, the f32 masters and their
// write-back, skip on overflow, state_dict, the misuse errors, and peak memory of W3 per level.
#include <cmath>
#include <cstdio>
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

// Linear -> LayerNorm -> ReLU -> Linear
std::shared_ptr<nn::Sequential> small_model() {
  manual_seed(5);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(6, 8));
  m->push_back(std::make_shared<nn::LayerNorm>(Shape{8}));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(8, 3));
  return m;
}

Tensor batch_loss(nn::Module& model, const amp::Amp& a, uint64_t seed) {
  Generator g(seed);
  const Tensor x = randn({10, 6}, kFloat32, &g);
  const Tensor y = randint(0, 3, {10}, &g);
  auto ac = a.forward_autocast();
  return ops::cross_entropy(model(a.cast_input(x)), y);
}

TEST(AmpInitialize, O2CastsAllButNormsAndKeepsF32Masters) {
  auto model = small_model();
  optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  auto a = amp::initialize(*model, opt, {.opt_level = "O2"});
  for (auto& [name, p] : model->named_parameters()) {
    EXPECT_EQ(p.dtype(), name.rfind("1.", 0) == 0 ? kFloat32 : kBFloat16) << name;  // "1." is the LayerNorm
  }
  ASSERT_EQ(a->master_params().size(), 4u);  // two Linear weights and biases
  for (const auto& g : opt.param_groups())
    for (const Tensor& p : g.params) EXPECT_EQ(p.dtype(), kFloat32);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    {
      auto scaled = amp::scale_loss(batch_loss(*model, *a, step), opt);
      scaled.backward();
    }
    // f32 master grads, the model's own grads moved out
    for (const Tensor& m : a->master_params()) {
      ASSERT_TRUE(m.grad().defined());
      EXPECT_EQ(m.grad().dtype(), kFloat32);
    }
    opt.step();
    // write-back: every low-precision weight is its master rounded to bf16
    const auto named = model->named_parameters();
    size_t k = 0;
    for (auto& [name, p] : named) {
      if (p.dtype() != kBFloat16) continue;
      EXPECT_TRUE(bitwise_equal(p.detach(), a->master_params()[k].detach().to(kBFloat16))) << name;
      ++k;
    }
  }
  // The optimizer's state is f32 and the state_dict carries the masters.
  const auto sd = a->state_dict();
  ASSERT_EQ(sd.master_params.size(), 4u);
  EXPECT_EQ(sd.master_params[0].dtype(), kFloat32);
  for (const auto& st : sd.optimizer.state) EXPECT_EQ(st.at("exp_avg").dtype(), kFloat32);
}

// O2 training follows f32 training closely (same data, AdamW): the masters after 5 steps agree
// with the f32 run within what bf16 forward/backward rounding (2^-8 relative per product) moves
// Adam's normalised steps: each step changes a weight by ~lr, so a few lr in the worst case.
TEST(AmpInitialize, O2TracksF32Training) {
  auto ref = small_model();
  optim::AdamW ropt(ref->parameters(), {.lr = 1e-3});
  auto o0 = amp::initialize(*ref, ropt, {.opt_level = "O0"});
  auto model = small_model();
  optim::AdamW opt(model->parameters(), {.lr = 1e-3});
  auto a = amp::initialize(*model, opt, {.opt_level = "O2"});
  for (int step = 0; step < 5; ++step) {
    ropt.zero_grad();
    batch_loss(*ref, *o0, step).backward();
    ropt.step();
    opt.zero_grad();
    {
      auto s = amp::scale_loss(batch_loss(*model, *a, step), opt);
      s.backward();
    }
    opt.step();
  }
  const Tensor w_ref = ref->named_parameters()[0].second;
  EXPECT_TRUE(all_close(a->master_params()[0], w_ref.detach(), 0, 5 * 1e-3));
  EXPECT_FALSE(all_close(a->master_params()[0], w_ref.detach(), 0, 1e-9));  // bf16 did change something
}

TEST(AmpInitialize, OverflowSkipsOptimizerStepBitwise) {
  auto model = small_model();
  optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  std::vector<std::string> lines;
  auto a = amp::initialize(*model, opt,
                           {.opt_level = "O2",
                            .scaler = {.provenance = true, .log = [&](const std::string& l) { lines.push_back(l); }}});
  {
    auto s = amp::scale_loss(batch_loss(*model, *a, 0), opt);
    s.backward();
  }
  opt.step();
  const auto st0 = opt.state_dict();
  std::vector<Tensor> p0;
  for (auto& [n, p] : model->named_parameters()) p0.push_back(p.detach().clone());
  const double scale0 = a->get_scale();
  opt.zero_grad();
  {
    auto s = amp::scale_loss(batch_loss(*model, *a, 1), opt);
    s.backward();
    model->named_parameters()[0].second.grad().data_ptr<bfloat16>()[0] = bfloat16(INFINITY);
    EXPECT_TRUE(s.finish());
  }
  opt.step();  // a no-op: the gradients were dropped
  EXPECT_EQ(a->get_scale(), scale0 / 2);
  EXPECT_EQ(a->skipped_steps(), 1);
  const auto named = model->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) EXPECT_TRUE(bitwise_equal(named[i].second.detach(), p0[i])) << named[i].first;
  const auto st1 = opt.state_dict();
  for (size_t i = 0; i < st0.state.size(); ++i)
    for (const auto& [k, v] : st0.state[i]) EXPECT_TRUE(bitwise_equal(v, st1.state[i].at(k))) << k;
  ASSERT_TRUE(a->last_overflow().has_value());
  ASSERT_EQ(a->last_overflow()->entries.size(), 1u);
  EXPECT_EQ(a->last_overflow()->entries[0].name, "0.weight");
}

// Several scale_loss per optimizer step (gradient accumulation, Apex's way): each one's gradients
// are unscaled once and added to the earlier, already unscaled ones. They used to be added scaled
// and the sum divided again, so earlier micro-batches were divided by the scale twice (dropped).
// Equal to one scale_loss on the sum of the losses: O1 (f32 gradients; only the order of f32
// additions differs: rel 1e-5) and O2 (each micro-batch's bf16 gradient rounds on its own before
// it reaches the f32 master: rel 2^-7 of the largest element).
TEST(AmpInitialize, SeveralScaleLossPerStepAccumulateLikeOneOnTheSum) {
  for (const char* level : {"O1", "O2"}) {
    SCOPED_TRACE(level);
    auto m1 = small_model(), m2 = small_model();
    optim::SGD o1(m1->parameters(), {.lr = 0.1}), o2(m2->parameters(), {.lr = 0.1});
    auto a1 = amp::initialize(*m1, o1, {.opt_level = level}), a2 = amp::initialize(*m2, o2, {.opt_level = level});
    for (uint64_t k : {0, 1}) {
      auto s = amp::scale_loss(batch_loss(*m1, *a1, k), o1);
      s.backward();
    }
    {
      auto s = amp::scale_loss(ops::add(batch_loss(*m2, *a2, 0), batch_loss(*m2, *a2, 1)), o2);
      s.backward();
    }
    const double tol = std::string(level) == "O1" ? 1e-5 : 1.0 / 128;
    const auto& g1 = o1.param_groups()[0].params;
    const auto& g2 = o2.param_groups()[0].params;
    ASSERT_EQ(g1.size(), g2.size());
    for (size_t i = 0; i < g1.size(); ++i) {
      ASSERT_TRUE(g1[i].grad().defined()) << i;
      const double scale = ops::max(ops::abs(g2[i].grad())).item();
      EXPECT_TRUE(all_close(g1[i].grad(), g2[i].grad(), tol, tol * scale)) << i;
    }
  }
}

// An overflow in one micro-batch skips the step (Apex: the next step() is skipped once), also when
// a later scale_loss before step() is finite; the step after that trains again.
TEST(AmpInitialize, AnOverflowInAnyMicroBatchSkipsTheStep) {
  auto model = small_model();
  optim::SGD opt(model->parameters(), {.lr = 0.1});
  auto a = amp::initialize(*model, opt, {.opt_level = "O1"});
  std::vector<Tensor> p0;
  for (auto& [n, p] : model->named_parameters()) p0.push_back(p.detach().clone());
  {
    auto s = amp::scale_loss(batch_loss(*model, *a, 0), opt);
    s.backward();
    model->named_parameters()[0].second.grad().data_ptr<float>()[0] = INFINITY;
    EXPECT_TRUE(s.finish());
  }
  {
    auto s = amp::scale_loss(batch_loss(*model, *a, 1), opt);
    s.backward();
    EXPECT_FALSE(s.finish());  // this one is finite, the step is skipped all the same
  }
  opt.step();
  const auto named = model->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) EXPECT_TRUE(bitwise_equal(named[i].second.detach(), p0[i])) << named[i].first;
  opt.zero_grad();
  {
    auto s = amp::scale_loss(batch_loss(*model, *a, 2), opt);
    s.backward();
  }
  opt.step();
  EXPECT_FALSE(bitwise_equal(model->named_parameters()[0].second.detach(), p0[0]));
}

// O2 on W2's CNN: convolutions and fc in bf16, BatchNorm parameters and running statistics kept
// f32 (keep_batchnorm_fp32); BatchNorm takes the bf16 activations, computes statistics in f32,
// updates its f32 running stats, and a training step moves the masters.
TEST(AmpInitialize, O2KeepsBatchNormF32InCnn) {
  manual_seed(1);
  auto model = nn::models::cnn();
  optim::AdamW opt(model->parameters(), {.lr = 1e-3});
  auto a = amp::initialize(*model, opt, {.opt_level = "O2"});
  for (auto& [name, p] : model->named_parameters()) {
    const bool norm = name.find("features.1.") == 0 || name.find("features.4.") == 0 || name.find("features.7.") == 0;
    EXPECT_EQ(p.dtype(), norm ? kFloat32 : kBFloat16) << name;
  }
  for (auto& [name, b] : model->named_buffers()) {
    if (is_floating(b.dtype())) EXPECT_EQ(b.dtype(), kFloat32) << name;
  }
  EXPECT_EQ(model->fc->weight.dtype(), kBFloat16);
  Generator g(3);
  const Tensor x = randn({8, 1, 28, 28}, kFloat32, &g), y = randint(0, 10, {8}, &g);
  const Tensor m0 = a->master_params()[0].detach().clone();
  const Tensor rm0 = model->named_buffers()[0].second.detach().clone();
  Tensor loss;
  {
    auto ac = a->forward_autocast();
    loss = ops::cross_entropy((*model)(a->cast_input(x)), y);
  }
  EXPECT_TRUE(std::isfinite(loss.item()));
  {
    auto s = amp::scale_loss(loss, opt);
    s.backward();
  }
  opt.step();
  EXPECT_FALSE(bitwise_equal(a->master_params()[0].detach(), m0));
  EXPECT_FALSE(bitwise_equal(model->named_buffers()[0].second.detach(), rm0));  // running_mean moved
}

TEST(AmpInitialize, LevelsO0O1O3) {
  {
    auto model = small_model();
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    auto a = amp::initialize(*model, opt, {.opt_level = "O1"});
    for (auto& [n, p] : model->named_parameters()) EXPECT_EQ(p.dtype(), kFloat32);
    EXPECT_TRUE(a->master_params().empty());
    Tensor logits;
    {
      auto ac = a->forward_autocast();
      logits = (*model)(randn({2, 6}));
    }
    EXPECT_EQ(logits.dtype(), kBFloat16);
    EXPECT_EQ(a->get_scale(), 65536.0);  // "dynamic" by default at O1
  }
  {
    auto model = small_model();
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    auto a = amp::initialize(*model, opt, {.opt_level = "O3", .dtype = kFloat16});
    for (auto& [n, p] : model->named_parameters()) EXPECT_EQ(p.dtype(), kFloat16) << n;  // norms too
    EXPECT_TRUE(a->master_params().empty());
    EXPECT_EQ(a->get_scale(), 1.0);
    const Tensor before = model->named_parameters()[0].second.detach().clone();
    {
      auto s = amp::scale_loss(batch_loss(*model, *a, 0), opt);
      s.backward();
    }
    opt.step();
    EXPECT_EQ(model->named_parameters()[0].second.dtype(), kFloat16);
    EXPECT_FALSE(bitwise_equal(model->named_parameters()[0].second.detach(), before));
  }
  {
    auto model = small_model();
    optim::SGD opt(model->parameters(), {.lr = 0.1});
    auto a = amp::initialize(*model, opt, {.opt_level = "O0", .loss_scale = "128"});
    EXPECT_EQ(a->get_scale(), 128.0);
    Tensor logits;
    {
      auto ac = a->forward_autocast();
      logits = (*model)(randn({2, 6}));
    }
    EXPECT_EQ(logits.dtype(), kFloat32);
  }
}

TEST(AmpInitialize, MisuseErrors) {
  auto model = small_model();
  optim::SGD opt(model->parameters(), {.lr = 0.1});
  EXPECT_THROW(amp::initialize(*model, opt, {.opt_level = "02"}), ValueError);  // zero, not O
  EXPECT_THROW(amp::initialize(*model, opt, {.opt_level = "O2", .loss_scale = "big"}), ValueError);
  auto a = amp::initialize(*model, opt, {.opt_level = "O1"});
  EXPECT_THROW(amp::initialize(*model, opt, {.opt_level = "O1"}), Error);  // twice
  // a manual GradScaler on the amp-managed optimizer
  amp::GradScaler scaler;
  EXPECT_THROW(scaler.step(opt), Error);
  EXPECT_THROW(scaler.unscale_(opt), Error);
  // scale_loss on an optimizer amp does not manage
  auto other = small_model();
  optim::SGD opt2(other->parameters(), {.lr = 0.1});
  EXPECT_THROW(amp::scale_loss(ops::sum(randn({2})), opt2), Error);
  // optimizer built after the model was cast
  auto cast_first = small_model();
  cast_first->to(kBFloat16);
  optim::SGD opt3(cast_first->parameters(), {.lr = 0.1});
  try {
    amp::initialize(*cast_first, opt3, {.opt_level = "O2"});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already bfloat16"), std::string::npos) << e.what();
  }
  // optimizer over tensors that are not the model's parameters
  auto m4 = small_model();
  Tensor stray = randn({3});
  stray.requires_grad_(true);
  optim::SGD opt4({stray}, {.lr = 0.1});
  EXPECT_THROW(amp::initialize(*m4, opt4, {.opt_level = "O2"}), Error);
  // after the Amp dies the optimizer is free again
  a.reset();
  EXPECT_FALSE(amp::is_amp_managed(opt));
}

// Memory: peak bytes of one W3 training step (batch 8, context 128, AdamW) at O0, O1 and O2.
// O2 stores weights and activations in bf16 (the residual stream too), so its peak must be below
// O1's, which keeps f32 weights plus their bf16 casts and an f32 residual stream.
TEST(AmpInitialize, W3PeakBytesPerLevel) {
  int64_t peak[3] = {0, 0, 0};
  const char* levels[3] = {"O0", "O1", "O2"};
  for (int l = 0; l < 3; ++l) {
    manual_seed(0);
    auto gpt = std::make_shared<nn::models::Gpt>();
    optim::AdamW opt(gpt->parameters(), {.lr = 3e-4});
    auto a = amp::initialize(*gpt, opt, {.opt_level = levels[l]});
    Generator g(1);
    const Tensor idx = randint(0, 256, {8, 128}, &g), tgt = randint(0, 256, {8, 128}, &g);
    // the step after a first one (optimizer state allocated), measured from the step's start
    for (int step = 0; step < 2; ++step) {
      if (step == 1) reset_peak_allocated_bytes();
      opt.zero_grad();
      Tensor loss;
      {
        auto ac = a->forward_autocast();
        loss = ops::cross_entropy(gpt->forward(a->cast_input(idx)).reshape({-1, 256}), tgt.reshape({-1}));
      }
      {
        auto s = amp::scale_loss(loss, opt);
        s.backward();
      }
      opt.step();
    }
    peak[l] = peak_allocated_bytes();
  }
  std::printf("W3 peak bytes per step: O0 %lld  O1 %lld  O2 %lld\n", static_cast<long long>(peak[0]),
              static_cast<long long>(peak[1]), static_cast<long long>(peak[2]));
  EXPECT_LT(peak[2], peak[1]);
}

}  // namespace
}  // namespace tandem
