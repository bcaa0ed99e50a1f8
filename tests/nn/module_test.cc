// nn::Module and the basic layers: PyTorch names, weight tying, modes, dtype conversion in place,
// state_dict round trips and validation, initialisation bounds, Embedding padding, Dropout.
#include <cmath>
#include <functional>
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

void expect_value_error_naming(const std::function<void()>& fn, const std::string& key) {
  try {
    fn();
    ADD_FAILURE() << "expected ValueError naming " << key;
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
}

class WithBuffers : public nn::Module {
 public:
  WithBuffers() : Module("WithBuffers") {
    lin = register_module("lin", std::make_shared<nn::Linear>(2, 3));
    register_buffer("running", td::full({3}, 0.5));
    register_buffer("scratch", td::zeros({2}), /*persistent=*/false);
  }
  std::shared_ptr<nn::Linear> lin;
};

}  // namespace

TEST(Module, MlpNamedParametersFollowPyTorch) {
  auto model = nn::models::mlp();
  const nn::NamedTensors params = model->named_parameters();
  EXPECT_EQ(names(params),
            (std::vector<std::string>{"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}));
  const std::vector<Shape> shapes = {{1024, 784}, {1024}, {1024, 1024}, {1024}, {10, 1024}, {10}};
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].second.shape(), shapes[i]) << params[i].first;
    EXPECT_TRUE(params[i].second.requires_grad());
    EXPECT_TRUE(params[i].second.is_leaf());
    EXPECT_EQ(params[i].second.dtype(), td::kFloat32);
  }
  EXPECT_EQ(model->num_parameters(), 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10);
  EXPECT_EQ(model->size(), 6u);
  EXPECT_EQ((*model)[0]->type_name(), "Flatten");
  EXPECT_EQ((*model)[5]->type_name(), "Linear");
  // The Linear member and the registered parameter are the same tensor.
  auto l1 = std::dynamic_pointer_cast<nn::Linear>((*model)[1]);
  ASSERT_NE(l1, nullptr);
  EXPECT_TRUE(l1->weight.is_same(params[0].second));
  // Forward: (N, 1, 28, 28) -> (N, 10).
  Tensor out = (*model)(td::zeros({3, 1, 28, 28}));
  EXPECT_EQ(out.shape(), (Shape{3, 10}));
  // named_modules: "" for the root, then the children.
  auto mods = model->named_modules();
  ASSERT_EQ(mods.size(), 7u);
  EXPECT_EQ(mods[0].first, "");
  EXPECT_EQ(mods[2].first, "1");
}

TEST(Module, SequentialNestedNames) {
  auto inner = std::make_shared<nn::Sequential>(
      std::initializer_list<std::shared_ptr<nn::Module>>{std::make_shared<nn::Linear>(3, 4), std::make_shared<nn::ReLU>()});
  nn::Sequential outer{std::make_shared<nn::Linear>(2, 3), inner, std::make_shared<nn::Linear>(4, 1, false)};
  EXPECT_EQ(names(outer.named_parameters()),
            (std::vector<std::string>{"0.weight", "0.bias", "1.0.weight", "1.0.bias", "2.weight"}));
  EXPECT_EQ(names(outer.named_parameters(/*recurse=*/false)), std::vector<std::string>{});
  EXPECT_EQ(outer.named_children().size(), 3u);
  EXPECT_EQ(outer.named_children()[1].first, "1");
  EXPECT_EQ(outer(td::ones({5, 2})).shape(), (Shape{5, 1}));
  const std::string repr = outer.to_string();
  EXPECT_NE(repr.find("(1): Sequential("), std::string::npos) << repr;
  EXPECT_NE(repr.find("in_features=2, out_features=3, bias=True"), std::string::npos) << repr;
}

TEST(Module, RegistrationValidatesNames) {
  nn::Module m("M");
  m.register_parameter("w", td::zeros({2}));
  EXPECT_THROW(m.register_parameter("w", td::zeros({2})), td::ValueError);
  EXPECT_THROW(m.register_buffer("w", td::zeros({2})), td::ValueError);
  EXPECT_THROW(m.register_parameter("a.b", td::zeros({2})), td::ValueError);
  EXPECT_THROW(m.register_parameter("", td::zeros({2})), td::ValueError);
  EXPECT_THROW(m.register_parameter("u", Tensor()), td::ValueError);
  EXPECT_THROW(m.register_module("w", std::make_shared<nn::ReLU>()), td::ValueError);
  Tensor frozen = m.register_parameter("f", td::zeros({2}), /*requires_grad=*/false);
  EXPECT_FALSE(frozen.requires_grad());
  EXPECT_THROW(m.forward(td::zeros({1})), td::Error);
}

TEST(Module, TiedWeightIsListedOnce) {
  auto enc = std::make_shared<nn::Linear>(4, 4);
  nn::Module tied("TiedModel");
  tied.register_parameter("emb", enc->weight);
  auto head = std::make_shared<nn::Module>("Head");
  head->register_parameter("weight", enc->weight);  // the same tensor in a second module
  head->register_parameter("bias", td::zeros({4}));
  tied.register_module("head", head);
  EXPECT_EQ(names(tied.named_parameters()), (std::vector<std::string>{"emb", "head.bias"}));
  EXPECT_EQ(tied.num_parameters(), 16 + 4);
  // The same module registered under two parents counts its parameters once per traversal.
  nn::Module twice("Twice");
  twice.register_module("x", enc);
  twice.register_module("y", enc);
  EXPECT_EQ(names(twice.named_parameters()), (std::vector<std::string>{"x.weight", "x.bias"}));
}

TEST(Module, TrainEvalPropagate) {
  auto model = nn::models::mlp({.in_features = 4, .hidden = {3}, .num_classes = 2});
  EXPECT_TRUE(model->is_training());
  model->eval();
  for (auto& [name, m] : model->named_modules()) EXPECT_FALSE(m->is_training()) << name;
  model->train();
  for (auto& [name, m] : model->named_modules()) EXPECT_TRUE(m->is_training()) << name;
  (*model)[1]->eval();  // a child alone
  EXPECT_TRUE(model->is_training());
  EXPECT_FALSE((*model)[1]->is_training());
}

TEST(Module, ToDtypeConvertsInPlace) {
  auto model = nn::models::mlp({.in_features = 6, .hidden = {5}, .num_classes = 3});
  auto l1 = std::dynamic_pointer_cast<nn::Linear>((*model)[1]);
  Tensor held = l1->weight;  // a handle taken before the conversion (as an optimizer holds one)
  const std::vector<double> before = held.to_vector();
  {
    Tensor loss = td::ops::sum((*model)(td::ones({2, 6})));
    loss.backward();
  }
  ASSERT_TRUE(l1->weight.grad().defined());
  model->to(td::kBFloat16);
  for (auto& [name, p] : model->named_parameters()) {
    EXPECT_EQ(p.dtype(), td::kBFloat16) << name;
    EXPECT_TRUE(p.requires_grad()) << name;
    EXPECT_EQ(p.grad().dtype(), td::kBFloat16) << name;
  }
  EXPECT_EQ(l1->weight.dtype(), td::kBFloat16);
  EXPECT_EQ(held.dtype(), td::kBFloat16);
  EXPECT_TRUE(held.is_same(l1->weight));
  const std::vector<double> after = held.to_vector();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i], static_cast<double>(td::bfloat16(static_cast<float>(before[i]))));
  }
  // It still runs, in bf16.
  EXPECT_EQ((*model)(td::ones({2, 6}, td::kBFloat16)).dtype(), td::kBFloat16);
  model->to(td::kFloat32);
  EXPECT_EQ(held.dtype(), td::kFloat32);
  EXPECT_THROW(model->to(td::kInt64), td::DTypeError);
}

TEST(Module, StateDictRoundTrip) {
  td::manual_seed(1);
  WithBuffers a;
  td::manual_seed(2);
  WithBuffers b;
  const nn::StateDict sd = a.state_dict();
  // PyTorch's order: the module's own parameters and persistent buffers, then its children's.
  EXPECT_EQ(names(sd), (std::vector<std::string>{"running", "lin.weight", "lin.bias"}));  // no non-persistent
  EXPECT_EQ(names(a.named_buffers()), (std::vector<std::string>{"running", "scratch"}));
  EXPECT_TRUE(sd[1].second.is_same(a.lin->weight));  // values shared, not copied
  ASSERT_NE(a.lin->weight.to_vector(), b.lin->weight.to_vector());
  Tensor b_weight = b.lin->weight;
  {
    td::NoGradGuard no_grad;
    a.named_buffers()[0].second.fill_(3.0);
  }
  b.load_state_dict(sd);
  EXPECT_EQ(b.lin->weight.to_vector(), a.lin->weight.to_vector());
  EXPECT_EQ(b.lin->bias.to_vector(), a.lin->bias.to_vector());
  EXPECT_EQ(b.named_buffers()[0].second.to_vector(), std::vector<double>(3, 3.0));
  EXPECT_TRUE(b_weight.is_same(b.lin->weight));  // copied into, not rebound
  EXPECT_NE(b.lin->weight.storage().get(), a.lin->weight.storage().get());
  // A checkpoint in another dtype is converted on load.
  nn::StateDict f64_sd;
  for (auto& [n, t] : sd) f64_sd.emplace_back(n, t.detach().to(td::kFloat64));
  b.load_state_dict(f64_sd);
  EXPECT_EQ(b.lin->weight.dtype(), td::kFloat32);
  EXPECT_EQ(b.lin->weight.to_vector(), a.lin->weight.to_vector());
}

TEST(Module, LoadStateDictRejectsBadCheckpointsUnchanged) {
  WithBuffers m;
  const std::vector<double> w0 = m.lin->weight.to_vector(), b0 = m.lin->bias.to_vector();
  auto good = [&] {
    nn::StateDict sd;
    sd.emplace_back("lin.weight", td::full({3, 2}, 9.0));
    sd.emplace_back("lin.bias", td::full({3}, 9.0));
    sd.emplace_back("running", td::full({3}, 9.0));
    return sd;
  };
  auto unchanged = [&] {
    EXPECT_EQ(m.lin->weight.to_vector(), w0);
    EXPECT_EQ(m.lin->bias.to_vector(), b0);
    EXPECT_EQ(m.named_buffers()[0].second.to_vector(), std::vector<double>(3, 0.5));
  };
  // Wrong shape: the message names the key and both shapes. The bad key comes last so that the
  // good ones before it would already have been copied by a careless implementation.
  {
    nn::StateDict sd = good();
    sd[2].second = td::full({4}, 9.0);
    try {
      m.load_state_dict(sd);
      ADD_FAILURE();
    } catch (const td::ValueError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("running"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
    }
    unchanged();
    EXPECT_THROW(m.load_state_dict(sd, /*strict=*/false), td::ValueError);  // shapes always checked
    unchanged();
  }
  {
    nn::StateDict sd = good();
    sd.erase(sd.begin() + 1);
    expect_value_error_naming([&] { m.load_state_dict(sd); }, "lin.bias");
    unchanged();
  }
  {
    nn::StateDict sd = good();
    sd.emplace_back("lin.extra", td::zeros({1}));
    expect_value_error_naming([&] { m.load_state_dict(sd); }, "lin.extra");
    unchanged();
    // Non-strict loading ignores the extra key and loads the rest.
    m.load_state_dict(sd, /*strict=*/false);
    EXPECT_EQ(m.lin->weight.to_vector(), std::vector<double>(6, 9.0));
  }
}

TEST(Layers, LinearInitBoundsAndForward) {
  td::manual_seed(0);
  for (int64_t in : {1, 3, 64, 784}) {
    nn::Linear lin(in, 50);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    // Values are f32 roundings of doubles inside [-bound, bound); allow one f32 ulp of the bound.
    const double slack = bound * 6e-8;
    double wmax = 0, bmax = 0;
    for (double w : lin.weight.to_vector()) wmax = std::max(wmax, std::fabs(w));
    for (double b : lin.bias.to_vector()) bmax = std::max(bmax, std::fabs(b));
    EXPECT_LE(wmax, bound + slack) << in;
    EXPECT_LE(bmax, bound + slack) << in;
    // ... and they use the range: the largest of 50*in uniforms is within 10% of the bound
    // (chance to miss: 0.9^(50 * in) < 0.006 for in = 1, far less otherwise; the seed is fixed).
    EXPECT_GT(wmax, 0.9 * bound) << in;
  }
  nn::Linear lin(2, 2);
  {
    td::NoGradGuard no_grad;
    lin.weight.copy_(td::tensor(std::vector<double>{1, 2, 3, 4}, {2, 2}));
    lin.bias.copy_(td::tensor(std::vector<double>{0.5, -0.5}, {2}));
  }
  EXPECT_EQ(lin(td::tensor(std::vector<double>{1, 1}, {1, 2})).to_vector(), (std::vector<double>{3.5, 6.5}));
  EXPECT_THROW(nn::Linear(0, 3), td::ValueError);
  nn::Linear nobias(3, 2, false);
  EXPECT_FALSE(nobias.bias.defined());
  EXPECT_EQ(names(nobias.named_parameters()), std::vector<std::string>{"weight"});
}

TEST(Layers, EmbeddingPaddingRowGetsNoGradient) {
  td::manual_seed(3);
  nn::Embedding emb(5, 3, /*padding_idx=*/2);
  EXPECT_EQ(emb.weight.select(0, 2).to_vector(), std::vector<double>(3, 0.0));
  EXPECT_NE(emb.weight.select(0, 1).to_vector(), std::vector<double>(3, 0.0));
  Tensor idx = td::tensor(std::vector<int64_t>{2, 1, 2, 4, 1}, {5});
  Tensor out = emb(idx);
  EXPECT_EQ(out.shape(), (Shape{5, 3}));
  EXPECT_EQ(out.select(0, 3).to_vector(), emb.weight.select(0, 4).to_vector());
  td::ops::sum(out * 2.0).backward();
  const std::vector<double> g = emb.weight.grad().to_vector();
  const std::vector<double> per_row = {0, 2, 0, 0, 1};  // times each row is used (row 2 is padding)
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(g[r * 3 + c], 2.0 * per_row[r]) << r;
  // -1 means no padding row; other negative values count from the end.
  nn::Embedding plain(4, 2);
  EXPECT_EQ(plain.padding_idx, -1);
  nn::Embedding neg(4, 2, -2);
  EXPECT_EQ(neg.padding_idx, 2);
  EXPECT_THROW(nn::Embedding(4, 2, 4), td::ValueError);
  EXPECT_THROW(emb(td::tensor(std::vector<int64_t>{5}, {1})), td::ValueError);
}

TEST(Layers, DropoutEvalIdentityTrainScalesAndIsSeeded) {
  nn::Dropout drop(0.25);
  Tensor x = td::ones({100000});
  drop.eval();
  EXPECT_TRUE(drop(x).is_same(x));
  drop.train();
  td::manual_seed(123);
  const std::vector<double> y = drop(x).to_vector();
  int64_t zeros = 0;
  for (double v : y) {
    if (v == 0) {
      ++zeros;
    } else {
      ASSERT_FLOAT_EQ(v, 1.0 / 0.75);  // survivors scaled by 1/(1-p)
    }
  }
  // Binomial(100000, 0.25): standard deviation 137; allow 5 of them.
  EXPECT_NEAR(static_cast<double>(zeros), 25000.0, 5 * 137.0);
  td::manual_seed(123);
  EXPECT_EQ(drop(x).to_vector(), y);  // same seed, same mask
  EXPECT_NE(drop(x).to_vector(), y);  // the stream moved on
  // Gradient uses the same mask and scale.
  td::manual_seed(9);
  Tensor xs = td::ones({1000});
  xs.requires_grad_(true);
  Tensor ys = drop(xs);
  td::ops::sum(ys).backward();
  EXPECT_EQ(xs.grad().to_vector(), ys.to_vector());
  // Edge probabilities.
  nn::Dropout all(1.0), none(0.0);
  EXPECT_EQ(all(x).to_vector(), std::vector<double>(100000, 0.0));
  EXPECT_EQ(none(x).to_vector(), x.to_vector());
  EXPECT_THROW(nn::Dropout(1.5), td::ValueError);
  EXPECT_THROW(nn::Dropout(-0.1), td::ValueError);
}

TEST(Layers, ZeroGrad) {
  nn::Linear lin(2, 2);
  td::ops::sum(lin(td::ones({1, 2}))).backward();
  ASSERT_TRUE(lin.weight.grad().defined());
  Tensor g = lin.weight.grad();
  lin.zero_grad(/*set_to_none=*/false);
  EXPECT_TRUE(lin.weight.grad().is_same(g));
  EXPECT_EQ(g.to_vector(), std::vector<double>(4, 0.0));
  lin.zero_grad();
  EXPECT_FALSE(lin.weight.grad().defined());
  EXPECT_FALSE(lin.bias.grad().defined());
}

// A DistributedDataParallel's state_dict names the model "module."; loading it into the bare model
// (or the bare model's into the wrapper) says so and names the fix, and
// consume_prefix_in_state_dict_if_present (PyTorch's) makes it load.
TEST(Module, WrapperPrefixMismatchNamesTheFixAndConsumingThePrefixLoads) {
  class Wrapper : public nn::Module {
   public:
    explicit Wrapper(std::shared_ptr<nn::Module> m) : Module("Wrapper") { register_module("module", std::move(m)); }
  };
  td::manual_seed(3);
  auto inner = std::make_shared<WithBuffers>();
  Wrapper wrapped(inner);
  td::manual_seed(4);
  WithBuffers bare;
  ASSERT_NE(bare.lin->weight.to_vector(), inner->lin->weight.to_vector());

  nn::StateDict sd = wrapped.state_dict();
  EXPECT_EQ(names(sd), (std::vector<std::string>{"module.running", "module.lin.weight", "module.lin.bias"}));
  expect_value_error_naming([&] { bare.load_state_dict(sd); },
                            "prefix \"module.\" (a DistributedDataParallel's state_dict names the model \"module.\"): "
                            "load it into the wrapper, or strip the prefix first with "
                            "nn::consume_prefix_in_state_dict_if_present(state, \"module.\")");
  // The other way round: the bare model's checkpoint into the wrapper.
  expect_value_error_naming([&] { wrapped.load_state_dict(bare.state_dict()); },
                            "Every model key is a checkpoint key with the prefix \"module.\"");
  // Keys that differ otherwise get no such hint.
  {
    nn::StateDict other = bare.state_dict();
    other.emplace_back("module.lin.extra", td::zeros({1}));
    try {
      wrapped.load_state_dict(other);
      ADD_FAILURE();
    } catch (const td::ValueError& e) {
      EXPECT_EQ(std::string(e.what()).find("prefix"), std::string::npos) << e.what();
    }
    nn::StateDict two_prefixes = sd;
    two_prefixes[0].first = "ddp.running";
    try {
      bare.load_state_dict(two_prefixes);
      ADD_FAILURE();
    } catch (const td::ValueError& e) {
      EXPECT_EQ(std::string(e.what()).find("prefix"), std::string::npos) << e.what();
    }
  }

  nn::consume_prefix_in_state_dict_if_present(sd, "module.");
  EXPECT_EQ(names(sd), (std::vector<std::string>{"running", "lin.weight", "lin.bias"}));
  bare.load_state_dict(sd);
  EXPECT_EQ(bare.lin->weight.to_vector(), inner->lin->weight.to_vector());
  EXPECT_EQ(bare.lin->bias.to_vector(), inner->lin->bias.to_vector());
  // Keys without the prefix are left as they are (PyTorch's "if present").
  nn::StateDict mixed = {{"module.a", td::zeros({1})}, {"b", td::zeros({1})}, {"modulex.c", td::zeros({1})}};
  nn::consume_prefix_in_state_dict_if_present(mixed, "module.");
  EXPECT_EQ(names(mixed), (std::vector<std::string>{"a", "b", "modulex.c"}));
}

// A BatchNorm checkpoint without num_batches_tracked (old torchvision weights) loads strictly, as
// in PyTorch, keeping the counter; other missing keys are still errors.
TEST(Module, BatchNormCheckpointWithoutNumBatchesTrackedLoadsStrictly) {
  nn::BatchNorm2d bn(3);
  bn.num_batches_tracked.fill_(5.0);
  td::nn::StateDict sd;
  for (const auto& [name, t] : bn.state_dict()) {
    if (name != "num_batches_tracked") sd.emplace_back(name, td::full(t.shape(), 2.0, t.dtype()));
  }
  bn.load_state_dict(sd);
  EXPECT_EQ(bn.running_mean.to_vector(), (std::vector<double>{2, 2, 2}));
  EXPECT_EQ(bn.num_batches_tracked.item(), 5.0);
  sd.erase(sd.begin());  // "weight"
  EXPECT_THROW(bn.load_state_dict(sd), td::ValueError);
}

// init functions refuse what PyTorch refuses: an empty range, a negative std, integer tensors.
TEST(Init, BadArgumentsAreErrors) {
  Tensor f = td::zeros({4});
  Tensor i = td::zeros({4}, td::kInt64);
  EXPECT_THROW(nn::init::uniform_(f, 1.0, 0.0), td::ValueError);
  EXPECT_THROW(nn::init::normal_(f, 0.0, -1.0), td::ValueError);
  EXPECT_THROW(nn::init::normal_(i, 0.0, 1.0), td::DTypeError);
  EXPECT_THROW(nn::init::uniform_(i, 0.0, 1.0), td::DTypeError);
}

// GPT.generate refuses float token ids (truncated before) and non-finite probabilities (a diverged
// model "sampled" the last token every time).
TEST(Gpt, GenerateRefusesFloatIdsAndNonFiniteProbabilities) {
  auto gpt = nn::models::gpt({.vocab_size = 16, .context = 4, .n_layer = 1, .d_model = 8, .n_head = 2});
  EXPECT_THROW(gpt->generate(td::tensor(std::vector<double>{1.7, 2.2}, {1, 2}), 1), td::DTypeError);
  EXPECT_EQ(gpt->generate(td::tensor(std::vector<int64_t>{1, 2}, {1, 2}), 2).size(1), 4);
  // An empty or 1-d prompt: an error that says what generate needs (it was select()'s).
  try {
    gpt->generate(td::zeros({2, 0}, td::kInt64), 2);
    ADD_FAILURE() << "expected ShapeError";
  } catch (const td::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("at least one token"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpt->generate(td::tensor(std::vector<int64_t>{1, 2}, {2}), 1), td::ShapeError);
  {
    td::NoGradGuard no_grad;
    for (auto& [name, p] : gpt->named_parameters()) p.fill_(NAN);
  }
  EXPECT_THROW(gpt->generate(td::tensor(std::vector<int64_t>{1, 2}, {1, 2}), 1), td::ValueError);
}

