// nn::Module semantics as a PyTorch 1.13 user expects them (issue #4 review): traversal order and
// de-duplication with shared modules and tied weights, train()/eval()/to()/requires_grad_()
// returning the module, apply()'s post-order, zero_grad after a create_graph backward,
// ModuleList/Sequential indexing (negative, out of range, wrong type), Embedding's padding_idx,
// the printed form, and the default initialisation of every layer and model, tested as
// distributions with bounds a wrong initialisation cannot meet.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
namespace nn = tandem::nn;
using td::Shape;
using td::Tensor;

namespace {

using td::testing::names;

template <class M>
std::vector<std::string> module_names(const std::vector<std::pair<std::string, std::shared_ptr<M>>>& v) {
  std::vector<std::string> out;
  for (const auto& [n, m] : v) out.push_back(n);
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const td::ValueError& e) {
    return e.what();
  }
  return "(no ValueError)";
}

// ---- sample statistics ----
struct Stats {
  double n = 0, mean = 0, var = 0, max_abs = 0;
  double frac_below(double t) const { return below_count / n; }  // share of |x| < threshold
  double below_count = 0;
};

Stats stats(const Tensor& t, double threshold = 0) {
  const std::vector<double> v = t.to_vector();
  Stats s;
  s.n = static_cast<double>(v.size());
  for (double x : v) s.mean += x;
  s.mean /= s.n;
  for (double x : v) {
    s.var += (x - s.mean) * (x - s.mean);
    s.max_abs = std::max(s.max_abs, std::fabs(x));
    if (std::fabs(x) < threshold) s.below_count += 1;
  }
  s.var /= s.n - 1;
  return s;
}

// Uniform(-b, b): every |x| <= b (plus one f32 rounding), the range used (max |x| > 0.99 b for
// n >= 2000: chance to miss 0.99^2000 ~ 2e-9), mean 0 and variance b^2/3 within 5 standard errors
// (sd of the mean b/sqrt(3n); of the sample variance b^2 sqrt(4/45) / sqrt(n)), and half of the
// values below b/2 within 5 standard errors (a normal of the same variance puts 61% there).
::testing::AssertionResult uniform_ok(const Tensor& t, double b) {
  const Stats s = stats(t, b / 2);
  std::string bad;
  if (s.n < 2000) bad += fmt::format(" too few samples ({});", s.n);
  if (!(s.max_abs <= b * (1 + 1e-7))) bad += fmt::format(" max |x| {} > bound {};", s.max_abs, b);
  if (!(s.max_abs > 0.99 * b)) bad += fmt::format(" max |x| {} <= 0.99 bound {};", s.max_abs, b);
  if (!(std::fabs(s.mean) <= 5 * b / std::sqrt(3 * s.n))) bad += fmt::format(" mean {};", s.mean);
  if (!(std::fabs(s.var - b * b / 3) <= 5 * b * b * std::sqrt(4.0 / 45.0) / std::sqrt(s.n)))
    bad += fmt::format(" variance {} vs {};", s.var, b * b / 3);
  if (!(std::fabs(s.frac_below(b / 2) - 0.5) <= 5 * 0.5 / std::sqrt(s.n)))
    bad += fmt::format(" share below b/2 {} vs 0.5;", s.frac_below(b / 2));
  if (bad.empty()) return ::testing::AssertionSuccess() << "uniform(+-" << b << ")";
  return ::testing::AssertionFailure() << "not uniform(+-" << b << "):" << bad;
}
#define EXPECT_UNIFORM(t, b, what) EXPECT_TRUE(uniform_ok((t), (b))) << (what)

// Normal(0, sd): mean within 5 standard errors (sd/sqrt(n)), variance within 5 (sd^2 sqrt(2/n)),
// and the share of |x| < sd is 68.27% within 5 standard errors (a uniform of the same variance
// gives 57.7%, so the shape is checked too).
::testing::AssertionResult normal_ok(const Tensor& t, double sd) {
  const Stats s = stats(t, sd);
  const double p = 0.682689492;
  std::string bad;
  if (s.n < 2000) bad += fmt::format(" too few samples ({});", s.n);
  if (!(std::fabs(s.mean) <= 5 * sd / std::sqrt(s.n))) bad += fmt::format(" mean {};", s.mean);
  if (!(std::fabs(s.var - sd * sd) <= 5 * sd * sd * std::sqrt(2.0 / s.n))) bad += fmt::format(" variance {} vs {};", s.var, sd * sd);
  if (!(std::fabs(s.frac_below(sd) - p) <= 5 * std::sqrt(p * (1 - p) / s.n)))
    bad += fmt::format(" share below sd {} vs {};", s.frac_below(sd), p);
  if (bad.empty()) return ::testing::AssertionSuccess() << "normal(0, " << sd << ")";
  return ::testing::AssertionFailure() << "not normal(0, " << sd << "):" << bad;
}
#define EXPECT_NORMAL(t, sd, what) EXPECT_TRUE(normal_ok((t), (sd))) << (what)

void expect_all(const Tensor& t, double value, const std::string& what) {
  for (double x : t.to_vector()) ASSERT_EQ(x, value) << what;
}

// Pearson correlation of the first n elements of a and b.
double correlation(const std::vector<double>& a, const std::vector<double>& b, size_t n) {
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) ma += a[i], mb += b[i];
  ma /= static_cast<double>(n), mb /= static_cast<double>(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

class Leaf : public nn::Module {
 public:
  explicit Leaf(const std::string& type) : Module(type) {}
};

}  // namespace

// ============================================================================ traversal

// The same module registered under two names: PyTorch's named_modules, named_children and
// named_parameters list it once (under the first name); state_dict lists it under both.
TEST(ModuleSemantics, SharedModuleListedOnceExceptInStateDict) {
  auto shared = std::make_shared<nn::Linear>(2, 3);
  auto root = std::make_shared<nn::Module>("Root");
  root->register_module("a", shared);
  auto mid = std::make_shared<nn::Sequential>();
  mid->push_back(shared);
  mid->push_back(std::make_shared<nn::ReLU>());
  root->register_module("mid", mid);
  root->register_module("b", shared);
  EXPECT_EQ(module_names(root->named_modules()), (std::vector<std::string>{"", "a", "mid", "mid.1"}));
  EXPECT_EQ(root->modules().size(), 4u);
  EXPECT_EQ(module_names(root->named_children()), (std::vector<std::string>{"a", "mid"}));
  EXPECT_EQ(root->children().size(), 2u);
  EXPECT_EQ(names(root->named_parameters()), (std::vector<std::string>{"a.weight", "a.bias"}));
  EXPECT_EQ(names(root->state_dict()), (std::vector<std::string>{"a.weight", "a.bias", "mid.0.weight", "mid.0.bias",
                                                                 "b.weight", "b.bias"}));
  // A strict load of that state_dict works and every name reaches the one tensor.
  nn::StateDict sd;
  for (const auto& [n, t] : root->state_dict()) sd.emplace_back(n, td::full(t.shape(), 2.0));
  EXPECT_NO_THROW(root->load_state_dict(sd));
  EXPECT_EQ(shared->weight.to_vector(), std::vector<double>(6, 2.0));
}

// A module the caller holds by value (not through a shared_ptr) lists itself too (was bad_weak_ptr).
TEST(ModuleSemantics, NamedModulesOfAModuleNotInASharedPtr) {
  nn::Sequential seq{std::make_shared<nn::Linear>(2, 2), std::make_shared<nn::ReLU>()};
  const auto mods = seq.named_modules();
  ASSERT_EQ(module_names(mods), (std::vector<std::string>{"", "0", "1"}));
  EXPECT_EQ(mods[0].second.get(), &seq);
  EXPECT_EQ(seq.modules().size(), 3u);
}

TEST(ModuleSemantics, TrainEvalToRequiresGradReturnTheModule) {
  auto model = nn::models::mlp({.in_features = 4, .hidden = {3}, .num_classes = 2});
  nn::Module& m = *model;
  EXPECT_EQ(&m.eval(), &m);
  EXPECT_FALSE(m.is_training());
  EXPECT_EQ(&m.train(), &m);
  EXPECT_TRUE(m.is_training());
  EXPECT_EQ(&m.train(false), &m);
  for (auto& [name, sub] : m.named_modules()) EXPECT_FALSE(sub->is_training()) << name;
  // A module shared by two parents follows whichever call came last.
  auto shared = std::make_shared<nn::Dropout>(0.5);
  nn::Module p1("P1"), p2("P2");
  p1.register_module("d", shared);
  p2.register_module("d", shared);
  p1.eval();
  EXPECT_FALSE(shared->is_training());
  p2.train();
  EXPECT_TRUE(shared->is_training());

  EXPECT_EQ(&m.requires_grad_(false), &m);
  for (auto& [name, p] : m.named_parameters()) EXPECT_FALSE(p.requires_grad()) << name;
  // Frozen: a forward builds no graph into the parameters.
  EXPECT_FALSE(m(td::ones({2, 4})).requires_grad());
  m.requires_grad_();
  for (auto& [name, p] : m.named_parameters()) EXPECT_TRUE(p.requires_grad()) << name;
  EXPECT_EQ(&m.to(td::kFloat64), &m);
  EXPECT_EQ(m.parameters()[0].dtype(), td::kFloat64);
}

// requires_grad_ on a module whose child shares a weight with another: one call freezes both names.
TEST(ModuleSemantics, RequiresGradOnTiedWeights) {
  auto gpt = nn::models::gpt({.vocab_size = 11, .context = 4, .n_layer = 1, .d_model = 8, .n_head = 2});
  gpt->tok_emb->requires_grad_(false);
  EXPECT_FALSE(gpt->tok_emb->weight.requires_grad());
  Tensor idx = td::tensor(std::vector<int64_t>{1, 2, 3}, {1, 3});
  td::ops::sum((*gpt)(idx)).backward();
  EXPECT_FALSE(gpt->tok_emb->weight.grad().defined());  // neither the lookup nor the tied head gives it one
  EXPECT_TRUE(gpt->pos_emb->weight.grad().defined());
}

// PyTorch's apply: children first (recursively), then the module itself.
TEST(ModuleSemantics, ApplyIsPostOrder) {
  auto inner = std::make_shared<nn::Sequential>();
  inner->push_back(std::make_shared<Leaf>("A"));
  inner->push_back(std::make_shared<Leaf>("B"));
  nn::Sequential outer;
  outer.push_back(std::make_shared<Leaf>("C"));
  outer.push_back(inner);
  outer.push_back(std::make_shared<Leaf>("D"));
  std::vector<std::string> order;
  nn::Module& r = outer.apply([&](nn::Module& m) { order.push_back(m.type_name()); });
  EXPECT_EQ(&r, &outer);
  EXPECT_EQ(order, (std::vector<std::string>{"C", "A", "B", "Sequential", "D", "Sequential"}));
  // A typical use: re-initialise every Linear.
  auto mlp = nn::models::mlp({.in_features = 3, .hidden = {4}, .num_classes = 2});
  mlp->apply([](nn::Module& m) {
    if (auto* lin = dynamic_cast<nn::Linear*>(&m)) td::nn::init::zeros_(lin->weight);
  });
  for (auto& [name, p] : mlp->named_parameters())
    if (name.find("weight") != std::string::npos) expect_all(p, 0.0, name);
}

// zero_grad(set_to_none=false) on a gradient that carries history (what backward(create_graph=true)
// leaves): PyTorch detaches it in place and zeroes it; the graph is dropped, the storage kept.
TEST(ModuleSemantics, ZeroGradKeepsStorageAndDropsGraph) {
  nn::Linear lin(3, 2);
  Tensor src = td::ones({2, 3});
  src.requires_grad_(true);
  lin.weight.set_grad(td::ops::mul(src, 2.0));  // a gradient with a grad_fn, as create_graph gives
  Tensor g = lin.weight.grad();
  ASSERT_TRUE(g.grad_fn() != nullptr);
  const void* storage = g.storage().get();
  lin.zero_grad(/*set_to_none=*/false);
  EXPECT_EQ(lin.weight.grad().storage().get(), storage);
  EXPECT_TRUE(lin.weight.grad().grad_fn() == nullptr);
  EXPECT_FALSE(lin.weight.grad().requires_grad());
  EXPECT_EQ(lin.weight.grad().to_vector(), std::vector<double>(6, 0.0));
  // A plain gradient is zeroed in place: the same tensor object.
  td::ops::sum(lin(td::ones({4, 3}))).backward();
  Tensor plain = lin.bias.grad();
  lin.zero_grad(false);
  EXPECT_TRUE(lin.bias.grad().is_same(plain));
  EXPECT_EQ(plain.to_vector(), std::vector<double>(2, 0.0));
  lin.zero_grad();
  EXPECT_FALSE(lin.weight.grad().defined());
}

// ============================================================================ containers

TEST(ModuleSemantics, ModuleListIndexing) {
  nn::ModuleList list;
  EXPECT_EQ(&list.append(std::make_shared<nn::Linear>(2, 2)), &list);
  list.append(std::make_shared<nn::ReLU>()).append(std::make_shared<nn::Linear>(2, 5));
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(module_names(list.named_children()), (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_EQ(list[-1]->type_name(), "Linear");
  EXPECT_TRUE(list[-1] == list[2]);
  EXPECT_TRUE(list[-3] == list[0]);
  EXPECT_EQ(list.at<nn::Linear>(-1)->out_features, 5);
  const std::string past_end = error_of([&] { (void)list[3]; });
  EXPECT_NE(past_end.find("index 3 is out of range"), std::string::npos) << past_end;
  const std::string before_start = error_of([&] { (void)list[-4]; });
  EXPECT_NE(before_start.find("index -4 is out of range"), std::string::npos) << before_start;
  const std::string wrong_type = error_of([&] { (void)list.at<nn::Linear>(1); });
  EXPECT_NE(wrong_type.find("ReLU"), std::string::npos) << wrong_type;
  size_t n = 0;
  for (const auto& m : list) n += m != nullptr;
  EXPECT_EQ(n, 3u);
  nn::ModuleList empty;
  EXPECT_THROW((void)empty[0], td::ValueError);

  nn::Sequential seq{std::make_shared<nn::Linear>(2, 3), std::make_shared<nn::ReLU>()};
  seq.append(std::make_shared<nn::Linear>(3, 1));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq[-1]->type_name(), "Linear");
  EXPECT_THROW((void)seq[3], td::ValueError);
  EXPECT_EQ(seq(td::ones({4, 2})).shape(), (Shape{4, 1}));
}

// PyTorch: padding_idx=-1 is the last row (not "none"); below -num_embeddings is an error.
TEST(ModuleSemantics, EmbeddingNegativePaddingIdxAsPyTorch) {
  td::manual_seed(5);
  nn::Embedding emb(4, 3, -1);
  EXPECT_EQ(emb.padding_idx, 3);
  EXPECT_EQ(emb.weight.select(0, 3).to_vector(), std::vector<double>(3, 0.0));
  EXPECT_EQ(emb.extra_repr(), "4, 3, padding_idx=3");
  nn::Embedding first(4, 3, -4);
  EXPECT_EQ(first.padding_idx, 0);
  const std::string msg = error_of([] { nn::Embedding(4, 3, -5); });
  EXPECT_NE(msg.find("-5"), std::string::npos) << msg;
  EXPECT_THROW(nn::Embedding(4, 3, 4), td::ValueError);
  nn::Embedding none(4, 3);
  EXPECT_EQ(none.padding_idx, -1);
  EXPECT_EQ(none.extra_repr(), "4, 3");
  for (int r = 0; r < 4; ++r) EXPECT_NE(none.weight.select(0, r).to_vector(), std::vector<double>(3, 0.0));
}

// PyTorch's repr of nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2,
// bias=False)) and of a module with both an extra_repr and children.
TEST(ModuleSemantics, PrintsLikePyTorch) {
  nn::Sequential seq{std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4, 3), std::make_shared<nn::ReLU>(),
                     std::make_shared<nn::Linear>(3, 2, false)};
  EXPECT_EQ(seq.to_string(),
            "Sequential(\n"
            "  (0): Flatten(start_dim=1, end_dim=-1)\n"
            "  (1): Linear(in_features=4, out_features=3, bias=True)\n"
            "  (2): ReLU()\n"
            "  (3): Linear(in_features=3, out_features=2, bias=False)\n"
            ")");
  class WithExtra : public nn::Module {
   public:
    WithExtra() : Module("WithExtra") { register_module("drop", std::make_shared<nn::Dropout>(0.1)); }
    std::string extra_repr() const override { return "k=1"; }
  };
  EXPECT_EQ(WithExtra().to_string(), "WithExtra(\n  k=1\n  (drop): Dropout(p=0.1, inplace=False)\n)");
  EXPECT_EQ(nn::ReLU().to_string(), "ReLU()");
}

// ============================================================================ initialisation

// The distribution checks can fail: each rejects a plausible wrong initialisation of the same size.
TEST(ModuleSemantics, DistributionChecksRejectWrongInits) {
  td::manual_seed(7);
  Tensor w = td::empty({512, 256});
  td::nn::init::kaiming_uniform_(w, 0.0);  // a = 0: bound sqrt(6 / fan_in), not 1 / sqrt(fan_in)
  EXPECT_FALSE(uniform_ok(w, 1.0 / 16.0));
  Tensor fan_out = td::empty({512, 256});
  td::nn::init::uniform_(fan_out, -1.0 / std::sqrt(512.0), 1.0 / std::sqrt(512.0));  // fan_out bound
  EXPECT_FALSE(uniform_ok(fan_out, 1.0 / 16.0));
  Tensor gauss = td::empty({512, 256});
  td::nn::init::normal_(gauss, 0.0, 1.0 / 16.0 / std::sqrt(3.0));  // right variance, wrong shape
  EXPECT_FALSE(uniform_ok(gauss, 1.0 / 16.0));
  Tensor flat = td::empty({128, 128});
  td::nn::init::uniform_(flat, -0.02 * std::sqrt(3.0), 0.02 * std::sqrt(3.0));  // right variance, wrong shape
  EXPECT_FALSE(normal_ok(flat, 0.02));
  Tensor wide = td::empty({128, 128});
  td::nn::init::normal_(wide, 0.0, 0.021);  // 5% too wide
  EXPECT_FALSE(normal_ok(wide, 0.02));
  Tensor shifted = td::empty({128, 128});
  td::nn::init::normal_(shifted, 0.002, 0.02);  // mean off by 1/10 sd (12.8 standard errors)
  EXPECT_FALSE(normal_ok(shifted, 0.02));
}

// Linear: weight and bias uniform in +-1/sqrt(in_features) (kaiming_uniform with a = sqrt(5)).
// in != out, so a fan_out bound (variance x in/out) or kaiming_uniform(a=0) (x6) fails.
TEST(ModuleSemantics, LinearInitDistribution) {
  td::manual_seed(11);
  nn::Linear lin(256, 512);
  EXPECT_UNIFORM(lin.weight, 1.0 / 16.0, "Linear(256, 512).weight");
  nn::Linear wide(64, 20000);  // enough bias samples: 20000
  EXPECT_UNIFORM(wide.bias, 1.0 / 8.0, "Linear(64, 20000).bias");
  nn::Linear tall(2048, 4000);
  EXPECT_UNIFORM(tall.bias, 1.0 / std::sqrt(2048.0), "Linear(2048, 4000).bias");
  // bf16 parameters: the same distribution, rounded (bound + one bf16 rounding).
  nn::Linear half(128, 256, true, td::kBFloat16);
  EXPECT_EQ(half.weight.dtype(), td::kBFloat16);
  const Stats s = stats(half.weight);
  EXPECT_LE(s.max_abs, (1.0 / std::sqrt(128.0)) * (1 + 1.0 / 256));
  EXPECT_NEAR(s.var, 1.0 / 128.0 / 3, 5 * (1.0 / 128.0) * std::sqrt(4.0 / 45.0) / std::sqrt(s.n) + 1e-5);
}

// Conv2d: fan_in = in_channels / groups * kH * kW for both the weight and the bias bound.
TEST(ModuleSemantics, Conv2dInitDistribution) {
  td::manual_seed(12);
  nn::Conv2d conv(16, 256, std::array<int64_t, 2>{3, 5}, {.groups = 4});
  EXPECT_EQ(conv.weight.shape(), (Shape{256, 4, 3, 5}));
  const double b = 1.0 / std::sqrt(4.0 * 15.0);
  EXPECT_UNIFORM(conv.weight, b, "Conv2d(16, 256, (3, 5), groups=4).weight");
  // 256 bias values: all within the bound, the largest above 0.9 b (miss: 0.9^256 ~ 2e-12) — a
  // bound from in_channels without groups (b/2) or from out_channels fails one of the two.
  const Stats bs = stats(conv.bias);
  EXPECT_LE(bs.max_abs, b * (1 + 1e-7));
  EXPECT_GT(bs.max_abs, 0.9 * b);
  td::manual_seed(13);
  nn::Conv2d many(64, 2048, 1);
  EXPECT_UNIFORM(many.bias, 1.0 / 8.0, "Conv2d(64, 2048, 1).bias");
}

TEST(ModuleSemantics, EmbeddingAndNormInit) {
  td::manual_seed(14);
  nn::Embedding emb(1000, 64);
  EXPECT_NORMAL(emb.weight, 1.0, "Embedding(1000, 64).weight");
  nn::LayerNorm ln(37);
  expect_all(ln.weight, 1.0, "LayerNorm.weight");
  expect_all(ln.bias, 0.0, "LayerNorm.bias");
  nn::BatchNorm2d bn(9);
  expect_all(bn.weight, 1.0, "BatchNorm2d.weight");
  expect_all(bn.bias, 0.0, "BatchNorm2d.bias");
  expect_all(bn.running_mean, 0.0, "running_mean");
  expect_all(bn.running_var, 1.0, "running_var");
  EXPECT_EQ(bn.num_batches_tracked.dtype(), td::kInt64);
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 0);
}

// Input ranks as PyTorch's _check_input_dim: BatchNorm1d (N, C) or (N, C, L), BatchNorm2d 4-d,
// BatchNorm3d 5-d; another rank is a ShapeError naming the expected layout and the shape.
TEST(ModuleSemantics, BatchNormInputRanks) {
  auto accepts = [](nn::BatchNorm& bn, const td::Shape& shape) {
    bn.train();
    const Tensor y = bn.forward(td::randn(shape));
    EXPECT_EQ(y.shape(), shape) << bn.type_name();
  };
  auto rejects = [](nn::BatchNorm& bn, const td::Shape& shape, const std::string& expected) {
    try {
      bn.forward(td::randn(shape));
      ADD_FAILURE() << bn.type_name() << " accepted " << td::shape_str(shape);
    } catch (const td::ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(td::shape_str(shape)), std::string::npos) << e.what();
    }
  };
  nn::BatchNorm1d b1(3);
  accepts(b1, {4, 3});
  accepts(b1, {4, 3, 5});
  rejects(b1, {4, 3, 2, 2}, "2-d (N, C) or 3-d (N, C, L)");
  nn::BatchNorm2d b2(3);
  accepts(b2, {2, 3, 2, 2});
  rejects(b2, {2, 3, 2, 2, 2}, "4-d (N, C, H, W)");
  nn::BatchNorm3d b3(3);
  accepts(b3, {2, 3, 2, 3, 2});
  rejects(b3, {2, 3, 2, 2}, "5-d (N, C, D, H, W)");
  EXPECT_THROW(nn::BatchNorm(3, 3, {}, "BatchNorm"), td::ValueError);
}

// Successive draws are independent: two layers built one after the other differ, and a layer's
// bias is not a rescaled copy of its weight's first draws (|r| < 5/sqrt(n) for independent values).
// The same seed gives the same layer.
TEST(ModuleSemantics, InitDrawsAreIndependentAndSeeded) {
  td::manual_seed(21);
  nn::Linear a(50, 4000), b(50, 4000);
  const std::vector<double> wa = a.weight.to_vector(), wb = b.weight.to_vector(), ba = a.bias.to_vector();
  EXPECT_LT(std::fabs(correlation(wa, wb, wa.size())), 5 / std::sqrt(static_cast<double>(wa.size())));
  EXPECT_LT(std::fabs(correlation(wa, ba, ba.size())), 5 / std::sqrt(static_cast<double>(ba.size())));
  std::vector<double> tail(wa.end() - static_cast<std::ptrdiff_t>(ba.size()), wa.end());
  EXPECT_LT(std::fabs(correlation(tail, ba, ba.size())), 5 / std::sqrt(static_cast<double>(ba.size())));
  std::vector<double> shifted(wa.begin() + 1, wa.end());
  EXPECT_LT(std::fabs(correlation(wa, shifted, shifted.size())), 5 / std::sqrt(static_cast<double>(shifted.size())));
  td::manual_seed(21);
  nn::Linear again(50, 4000);
  EXPECT_EQ(again.weight.to_vector(), wa);
  EXPECT_EQ(again.bias.to_vector(), ba);
}

// W3: every Linear weight and both embeddings normal(0, 0.02), every Linear bias exactly zero,
// LayerNorms 1 / 0 (GPT-2's recipe, as the header states).
TEST(ModuleSemantics, GptInit) {
  td::manual_seed(31);
  auto gpt = nn::models::gpt({.vocab_size = 256, .context = 64, .n_layer = 2, .d_model = 64, .n_head = 4});
  int checked = 0;
  for (auto& [name, p] : gpt->named_parameters()) {
    const bool is_ln = name.rfind("ln_f.", 0) == 0 || name.find(".ln1.") != std::string::npos ||
                       name.find(".ln2.") != std::string::npos;
    const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_ln) {
      expect_all(p, is_bias ? 0.0 : 1.0, name);
    } else if (is_bias) {
      expect_all(p, 0.0, name);
    } else {
      EXPECT_NORMAL(p, 0.02, name);
    }
    ++checked;
  }
  // tok_emb, pos_emb, 2 x (ln1 2, qkv 2, proj 2, ln2 2, fc1 2, fc2 2), ln_f 2
  EXPECT_EQ(checked, 2 + 2 * 12 + 2);
}

// CIFAR ResNet-18 (torchvision's recipe, as resnet.h states): convs kaiming_normal(fan_out, relu)
// = normal(0, sqrt(2 / (out * kH * kW))), BatchNorm 1 / 0, fc PyTorch's Linear default.
TEST(ModuleSemantics, ResNet18Init) {
  td::manual_seed(41);
  auto net = nn::models::resnet18();
  int convs = 0;
  for (auto& [name, m] : net->named_modules()) {
    if (auto* conv = dynamic_cast<nn::Conv2d*>(m.get())) {
      const Shape& s = conv->weight.shape();
      if (conv->weight.numel() >= 2000) EXPECT_NORMAL(conv->weight, std::sqrt(2.0 / static_cast<double>(s[0] * s[2] * s[3])), name);
      EXPECT_FALSE(conv->bias.defined()) << name;
      ++convs;
    } else if (auto* bn = dynamic_cast<nn::BatchNorm*>(m.get())) {
      expect_all(bn->weight, 1.0, name);
      expect_all(bn->bias, 0.0, name);
    }
  }
  EXPECT_EQ(convs, 1 + 16 + 3);
  EXPECT_UNIFORM(net->fc->weight, 1.0 / std::sqrt(512.0), "fc.weight");
}
