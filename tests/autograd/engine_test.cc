// The backward engine and Tensor's autograd API: accumulation, freed graphs, grad mode,
// hooks, retain_grad, autograd::grad, and the in-place guard.
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/node.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::ops::sum;

namespace {

Tensor leaf(const std::vector<double>& v, td::DType dt = td::kFloat64) {
  Tensor t = td::tensor(v, {static_cast<int64_t>(v.size())}, dt);
  t.requires_grad_(true);
  return t;
}

std::vector<double> scaled(const std::vector<double>& v, double k, double add = 0) {
  std::vector<double> out;
  for (double x : v) out.push_back(k * x + add);
  return out;
}

}  // namespace

TEST(Backward, AccumulatesAcrossCalls) {
  const std::vector<double> xv = {1, -2, 3};
  Tensor x = leaf(xv);
  EXPECT_TRUE(x.is_leaf());
  EXPECT_FALSE(x.grad().defined());
  sum(x * x).backward();
  EXPECT_EQ(x.grad().to_vector(), scaled(xv, 2));
  sum(x * x).backward();  // a fresh graph: adds to the existing grad
  EXPECT_EQ(x.grad().to_vector(), scaled(xv, 4));
  EXPECT_EQ(x.grad().dtype(), td::kFloat64);
  EXPECT_FALSE(x.grad().requires_grad());
}

TEST(Backward, SecondBackwardThroughFreedGraphThrows) {
  Tensor x = leaf({1, 2});
  Tensor y = sum(x * x);
  y.backward();
  try {
    y.backward();
    FAIL() << "expected AutogradError";
  } catch (const td::AutogradError& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST(Backward, RetainGraphAllowsASecondBackward) {
  Tensor x = leaf({1, 2});
  Tensor y = sum(x * x);
  y.backward(Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 4}));
  y.backward(Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{4, 8}));
  y.backward();  // this one frees the graph
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 12}));
  EXPECT_THROW(y.backward(), td::AutogradError);
}

TEST(Backward, NonScalarNeedsAGradient) {
  Tensor x = leaf({1, 2, 3});
  Tensor y = x * 3.0;
  EXPECT_THROW(y.backward(), td::AutogradError);
  EXPECT_THROW(y.backward(td::ones({2}, td::kFloat64)), td::ShapeError);
  y.backward(td::tensor(std::vector<double>{1, 10, 100}, {3}, td::kFloat64));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 30, 300}));
  // A root that does not require grad.
  EXPECT_THROW(td::ones({1}).backward(), td::AutogradError);
}

TEST(Backward, LeafRootAndSeveralRoots) {
  // A leaf as the root: its grad is the given gradient.
  Tensor x = leaf({1, 2, 3});
  x.backward(td::tensor(std::vector<double>{4, 5, 6}, {3}, td::kFloat64));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{4, 5, 6}));
  // Two roots, one computed from the other: d(sum(y^2))/dx + d(y . g)/dx with y = 2x.
  Tensor z = leaf({1, 2, 3});
  Tensor y = z * 2.0;
  Tensor s = sum(y * y);
  td::autograd::backward({s, y}, {Tensor(), td::ones({3}, td::kFloat64)}, false, false);
  EXPECT_EQ(z.grad().to_vector(), (std::vector<double>{10, 18, 26}));  // 8z + 2
  EXPECT_THROW(td::autograd::backward({s, y}, {Tensor()}, false, false), td::AutogradError);  // 1 grad, 2 roots
}

TEST(Backward, GradDoesNotAliasCallerTensors) {
  // The gradient passed to backward, and the grads of two leaves fed the same gradient tensor,
  // must be separate buffers.
  Tensor x = leaf({1, 2, 3, 4});
  Tensor g = td::tensor(std::vector<double>{1, 1, 1, 1}, {2, 2}, td::kFloat64);
  x.view({2, 2}).backward(g);
  g.fill_(7.0);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 1, 1}));

  Tensor a = leaf({1, 2}), b = leaf({3, 4});
  sum(a + b).backward();
  Tensor ga = a.grad();
  td::NoGradGuard no_grad;
  ga.mul_(5.0);
  EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{1, 1}));
}

TEST(Backward, DiamondSumsGradients) {
  // x feeds two branches that meet again: c = (2x) * (3x) + x = 6x^2 + x, dc/dx = 12x + 1.
  const std::vector<double> xv = {0.5, -1, 2};
  Tensor x = leaf(xv);
  Tensor a = x * 2.0, b = x * 3.0;
  Tensor c = a * b + x;
  sum(c).backward();
  EXPECT_EQ(x.grad().to_vector(), scaled(xv, 12, 1));
  // The same tensor used twice in one op.
  Tensor z = leaf(xv);
  sum(z * z * z).backward();  // 3z^2
  std::vector<double> expected;
  for (double v : xv) expected.push_back(3 * v * v);
  EXPECT_EQ(z.grad().to_vector(), expected);
}

TEST(Backward, ViewsAreDifferentiable) {
  Tensor x = leaf({0, 1, 2, 3, 4, 5});
  Tensor m = x.view({2, 3});
  // Every other column, the transposed second row, an expanded element.
  Tensor y = sum(m.slice(1, 0, 3, 2)) + sum(m.t().select(1, 1) * 10.0) + sum(m.select(0, 0).narrow(0, 1, 1).expand({4}));
  y.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 4, 1, 11, 10, 11}));
}

TEST(GradMode, NoGradGuardStopsRecording) {
  Tensor x = leaf({1, 2});
  EXPECT_TRUE(td::autograd::is_grad_enabled());
  {
    td::NoGradGuard no_grad;
    EXPECT_FALSE(td::autograd::is_grad_enabled());
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    EXPECT_THROW(sum(y).backward(), td::AutogradError);
    {
      td::autograd::AutoGradMode enable(true);
      EXPECT_TRUE((x * 2.0).requires_grad());
    }
    EXPECT_FALSE(td::autograd::is_grad_enabled());
  }
  EXPECT_TRUE(td::autograd::is_grad_enabled());
  Tensor y = x * 2.0;
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
  EXPECT_FALSE(y.is_leaf());
}

TEST(GradMode, DetachSharesDataWithoutHistory) {
  Tensor x = leaf({1, 2, 3});
  Tensor y = x * 2.0;
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  EXPECT_EQ(d.grad_fn(), nullptr);
  EXPECT_EQ(d.storage().get(), y.storage().get());
  d.fill_(0.0);  // shares data: y changes too
  EXPECT_EQ(y.to_vector(), (std::vector<double>{0, 0, 0}));
  // Gradient does not flow through a detached tensor.
  Tensor z = sum(x * x.detach());
  z.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 2, 3}));
}

TEST(GradMode, RequiresGradOnlyForFloatingPoint) {
  Tensor i = td::arange(3);
  EXPECT_THROW(i.requires_grad_(true), td::AutogradError);
  EXPECT_FALSE(i.requires_grad());
  EXPECT_NO_THROW(i.requires_grad_(false));
  for (td::DType dt : {td::kFloat32, td::kFloat64, td::kBFloat16, td::kFloat16}) {
    Tensor f = td::zeros({2}, dt);
    f.requires_grad_(true);
    EXPECT_TRUE(f.requires_grad());
  }
  Tensor x = leaf({1});
  Tensor y = x * 2.0;
  EXPECT_THROW(y.requires_grad_(false), td::AutogradError);  // non-leaf
}

TEST(GradMode, InPlaceOnLeafRequiringGradThrows) {
  Tensor x = leaf({1, 2});
  x.set_name("w");
  EXPECT_THROW(x.fill_(0.0), td::AutogradError);
  EXPECT_THROW(x.zero_(), td::AutogradError);
  EXPECT_THROW(x.mul_(2.0), td::AutogradError);
  EXPECT_THROW(x.add_(td::ones({2}, td::kFloat64)), td::AutogradError);
  try {
    x.copy_(td::zeros({2}, td::kFloat64));
    FAIL();
  } catch (const td::AutogradError& e) {
    EXPECT_NE(std::string(e.what()).find("\"w\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(x.to_vector(), (std::vector<double>{1, 2}));  // untouched
  {
    td::NoGradGuard no_grad;
    x.mul_(3.0);
  }
  EXPECT_EQ(x.to_vector(), (std::vector<double>{3, 6}));
}

TEST(Hooks, LeafHookCanModifyGradient) {
  Tensor x = leaf({1, 2});
  int calls = 0;
  const int64_t h = x.register_hook([&](const Tensor& g) {
    ++calls;
    EXPECT_EQ(g.to_vector(), (std::vector<double>{3, 3}));
    return g * 2.0;
  });
  sum(x * 3.0).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 6}));
  x.remove_hook(h);
  x.set_grad(Tensor());
  sum(x * 3.0).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 3}));
  // A hook that returns an undefined tensor only observes.
  x.set_grad(Tensor());
  x.register_hook([&](const Tensor&) {
    ++calls;
    return Tensor();
  });
  sum(x * 3.0).backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 3}));
  EXPECT_THROW(td::ones({1}).register_hook([](const Tensor& g) { return g; }), td::AutogradError);
}

TEST(Hooks, NonLeafHookCanModifyGradient) {
  Tensor x = leaf({1, 2});
  Tensor z = x * 3.0;
  int calls = 0;
  const int64_t h = z.register_hook([&](const Tensor& g) {
    ++calls;
    return g * 10.0;
  });
  sum(z * 2.0).backward(Tensor(), true);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{60, 60}));
  z.remove_hook(h);
  x.set_grad(Tensor());
  sum(z * 2.0).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 6}));
}

TEST(Hooks, PostAccumulateGradHookRunsOncePerBackwardAfterGradIsSet) {
  Tensor x = leaf({1, 2});
  std::vector<std::vector<double>> seen;
  const int64_t h = x.register_post_accumulate_grad_hook([&](Tensor& p) {
    EXPECT_TRUE(p.is_same(x));
    ASSERT_TRUE(p.grad().defined());
    seen.push_back(p.grad().to_vector());
  });
  // x is used three times in this graph; the hook still fires once, with the summed grad.
  sum(x * x + x).backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<double>{3, 5}));
  sum(x * 2.0).backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], (std::vector<double>{5, 7}));  // after accumulation into the existing grad
  // autograd::grad accumulates nothing, so the hook does not fire.
  td::autograd::grad({sum(x * 2.0)}, {x});
  EXPECT_EQ(seen.size(), 2u);
  x.remove_hook(h);
  sum(x).backward();
  EXPECT_EQ(seen.size(), 2u);
  // Leaves only.
  Tensor y = x * 2.0;
  EXPECT_THROW(y.register_post_accumulate_grad_hook([](Tensor&) {}), td::AutogradError);
  EXPECT_THROW(td::ones({1}).register_post_accumulate_grad_hook([](Tensor&) {}), td::AutogradError);
}

TEST(RetainGrad, KeepsNonLeafGradient) {
  Tensor x = leaf({1, 2});
  Tensor z = x * 2.0;
  Tensor w = x * 3.0;
  z.retain_grad();
  Tensor loss = sum(z * z + w);
  loss.retain_grad();
  loss.backward();
  ASSERT_TRUE(z.grad().defined());
  EXPECT_EQ(z.grad().to_vector(), (std::vector<double>{4, 8}));  // 2z
  EXPECT_FALSE(w.grad().defined());  // not retained
  ASSERT_TRUE(loss.grad().defined());
  EXPECT_EQ(loss.grad().item(), 1.0);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{11, 19}));  // 8x + 3
  z.retain_grad();  // idempotent
}

TEST(AutogradGrad, ReturnsGradientsWithoutTouchingGrad) {
  Tensor x = leaf({1, 2, 3});
  Tensor y = leaf({4, 5, 6});
  std::vector<Tensor> g = td::autograd::grad({sum(x * y)}, {x, y});
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{4, 5, 6}));
  EXPECT_EQ(g[1].to_vector(), (std::vector<double>{1, 2, 3}));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(y.grad().defined());
  // An existing grad stays as it was.
  sum(x).backward();
  g = td::autograd::grad({sum(x * x)}, {x});
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{2, 4, 6}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 1}));
  // Only the requested inputs; a non-requiring input is an error.
  g = td::autograd::grad({sum(x * y)}, {y});
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{1, 2, 3}));
  EXPECT_FALSE(y.grad().defined());
  EXPECT_THROW(td::autograd::grad({sum(x * 2.0)}, {td::ones({3}, td::kFloat64)}), td::AutogradError);
  // Gradient w.r.t. an intermediate.
  Tensor h = x * 2.0;
  g = td::autograd::grad({sum(h * h)}, {h});
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{4, 8, 12}));
}

TEST(Engine, QueuedCallbackRunsOnceAfterEveryNodeOfThatBackward) {
  tandem::Tensor a = tandem::ones({3}).requires_grad_(), b = tandem::ones({3}).requires_grad_();
  tandem::Tensor loss = tandem::ops::sum(tandem::ops::mul(tandem::ops::mul(a, 2.0), b));
  int calls = 0;
  bool b_had_grad = false;
  // Queued from a's hook (a's gradient is ready before b's is accumulated, or after: either way
  // the callback must see both).
  a.register_post_accumulate_grad_hook([&](tandem::Tensor&) {
    tandem::autograd::queue_callback([&] {
      ++calls;
      b_had_grad = b.grad().defined();
      EXPECT_TRUE(tandem::autograd::in_backward());
    });
  });
  loss.backward();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(b_had_grad);
  EXPECT_FALSE(tandem::autograd::in_backward());
  EXPECT_THROW(tandem::autograd::queue_callback([] {}), tandem::AutogradError);
}

// ---- gradient destinations (set_grad_destination): a gradient produced where its leaf asked ----

namespace {

// A (rows x cols) f32 leaf with seeded normal values.
Tensor param(int64_t rows, int64_t cols, uint64_t seed) {
  td::Generator gen(seed);
  Tensor t = td::randn({rows, cols}, td::kFloat32, &gen);
  t.requires_grad_(true);
  return t;
}

// The same leaf's gradient of sum(linear(x, w) * k) computed without a destination and without
// any cast in the graph: for bf16, on a bf16 leaf holding w's bf16 values, whose gradient is then
// widened to f32 by hand (what the cast's backward computes).
Tensor plain_grad(const Tensor& x, const Tensor& w, bool bf16, int uses = 1) {
  Tensor w2 = bf16 ? w.detach().to(td::kBFloat16) : w.detach().clone();
  w2.requires_grad_(true);
  const Tensor xx = bf16 ? x.to(td::kBFloat16) : x;
  Tensor loss;
  for (int u = 0; u < uses; ++u) {
    Tensor l = sum(td::ops::linear(xx, w2, Tensor()).to(td::kFloat32) * 0.5);
    loss = loss.defined() ? loss + l : l;
  }
  loss.backward();
  return bf16 ? w2.grad().to(td::kFloat32) : w2.grad();
}

}  // namespace

// linear's weight GEMM writes the gradient straight into the destination, and AccumulateGrad
// adopts it (grad() is the destination's memory); the values are those of the plain backward,
// bit for bit (the same GEMM). Under a cast to bf16 (autocast's weight cast) the cast's backward
// converts into the f32 destination instead.
TEST(GradDestination, LinearWeightAndCastBackProduceTheGradientInPlace) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 cast" : "f32");
    Tensor x = param(6, 5, 1).detach();
    Tensor w = param(7, 5, 2);
    Tensor dest = td::zeros({7, 5}, td::kFloat32);
    td::autograd::set_grad_destination(w, dest);
    const Tensor xx = bf16 ? x.to(td::kBFloat16) : x;
    const Tensor ww = bf16 ? w.to(td::kBFloat16) : w;
    sum(td::ops::linear(xx, ww, Tensor()).to(td::kFloat32) * 0.5).backward();
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(w.grad().data_ptr(), dest.data_ptr()) << "the gradient was not produced in its destination";
    EXPECT_EQ(w.grad().to_vector(), plain_grad(x, w, bf16).to_vector());
    EXPECT_EQ(dest.to_vector(), w.grad().to_vector());
    td::autograd::set_grad_destination(w, Tensor());
  }
}

// No offer where it would be wrong or useless: a grad() that already exists accumulates as
// before (the destination untouched), a leaf reached by two edges gets the sum (not one part in
// the destination), and a cleared destination is not used.
TEST(GradDestination, OnlyOfferedForAFreshGradientFromOneEdge) {
  Tensor x = param(4, 3, 3).detach();
  const Tensor reference = plain_grad(x, param(5, 3, 4), false);
  {
    Tensor w = param(5, 3, 4);
    w.set_grad(td::ones({5, 3}, td::kFloat32));
    Tensor dest = td::zeros({5, 3}, td::kFloat32);
    td::autograd::set_grad_destination(w, dest);
    sum(td::ops::linear(x, w, Tensor()) * 0.5).backward();
    EXPECT_NE(w.grad().data_ptr(), dest.data_ptr());
    EXPECT_EQ(w.grad().to_vector(), (reference + 1.0).to_vector());
    EXPECT_EQ(dest.to_vector(), td::zeros({5, 3}, td::kFloat32).to_vector());
  }
  {
    Tensor w = param(5, 3, 4);
    Tensor dest = td::zeros({5, 3}, td::kFloat32);
    td::autograd::set_grad_destination(w, dest);
    (sum(td::ops::linear(x, w, Tensor()) * 0.5) + sum(w)).backward();  // two edges into w
    EXPECT_EQ(w.grad().to_vector(), (reference + 1.0).to_vector());
    EXPECT_EQ(dest.to_vector(), td::zeros({5, 3}, td::kFloat32).to_vector());
  }
  {
    Tensor w = param(5, 3, 4);
    Tensor dest = td::zeros({5, 3}, td::kFloat32);
    td::autograd::set_grad_destination(w, dest);
    td::autograd::set_grad_destination(w, Tensor());
    sum(td::ops::linear(x, w, Tensor()) * 0.5).backward();
    EXPECT_NE(w.grad().data_ptr(), dest.data_ptr());
    EXPECT_EQ(w.grad().to_vector(), reference.to_vector());
  }
  Tensor w = param(5, 3, 4);
  EXPECT_THROW(td::autograd::set_grad_destination(w, td::zeros({3, 5}, td::kFloat32)), td::ValueError);
  EXPECT_THROW(td::autograd::set_grad_destination(w, td::zeros({5, 3}, td::kFloat64)), td::ValueError);
}

// Rounded destinations: the bf16 gradient of a bf16 copy of an f32 leaf (autocast's weight cast)
// is produced by linear's weight GEMM already widened to f32 (rounded to bf16 in the GEMM's
// epilogue), into the leaf's destination or, without one, a new f32 tensor; the cast back passes
// it through. Bit for bit the bf16 product widened by hand; shapes with partial 16/32 blocks, with
// a bias (whose gradient takes the ordinary cast back), explicitly and under autocast.
TEST(GradDestination, CastBackGradientIsProducedWidenedInOnePass) {
  for (bool with_dest : {true, false}) {
    for (bool autocast : {false, true}) {
      SCOPED_TRACE(std::string(with_dest ? "destination" : "no destination") +
                   (autocast ? ", autocast" : ", explicit cast"));
      Tensor x = param(19, 45, 5).detach();
      Tensor w = param(37, 45, 6);
      Tensor b = param(1, 37, 7).view({37}).detach();
      b.requires_grad_(true);
      Tensor dest = td::zeros({37, 45}, td::kFloat32);
      if (with_dest) td::autograd::set_grad_destination(w, dest);
      const int64_t taken = td::autograd::detail::rounded_destinations_taken();
      Tensor y;
      if (autocast) {
        td::amp::autocast ac(td::kBFloat16);
        y = td::ops::linear(x, w, b);
      } else {
        y = td::ops::linear(x.to(td::kBFloat16), w.to(td::kBFloat16), b.to(td::kBFloat16));
      }
      ASSERT_EQ(y.dtype(), td::kBFloat16);
      sum(y.to(td::kFloat32) * 0.5).backward();
      EXPECT_EQ(td::autograd::detail::rounded_destinations_taken(), taken + 1);
      ASSERT_TRUE(w.grad().defined());
      EXPECT_EQ(w.grad().dtype(), td::kFloat32);
      if (with_dest) EXPECT_EQ(w.grad().data_ptr(), dest.data_ptr()) << "not produced in its destination";
      EXPECT_EQ(w.grad().to_vector(), plain_grad(x, w, true).to_vector());
      EXPECT_TRUE(b.grad().defined());
      EXPECT_EQ(b.grad().dtype(), td::kFloat32);
      td::autograd::set_grad_destination(w, Tensor());
    }
  }
}

// No rounded offer where the narrow gradient itself is needed: a bf16 copy used twice (its
// gradients are summed in bf16 first, as PyTorch's autocast cache does), a hook on the copy
// (it must see the bf16 gradient) and a leaf that already has a grad() (accumulated as before).
// The gradients are those of the plain graph in every case.
TEST(GradDestination, NoRoundedOfferWhereTheNarrowGradientIsNeeded) {
  Tensor x = param(9, 20, 8).detach();
  const Tensor xb = x.to(td::kBFloat16);
  auto loss_of = [&](const Tensor& wb) { return sum(td::ops::linear(xb, wb, Tensor()).to(td::kFloat32) * 0.5); };
  {
    Tensor w = param(11, 20, 9);
    const int64_t taken = td::autograd::detail::rounded_destinations_taken();
    const Tensor wb = w.to(td::kBFloat16);
    (loss_of(wb) + loss_of(wb)).backward();
    EXPECT_EQ(td::autograd::detail::rounded_destinations_taken(), taken);
    EXPECT_EQ(w.grad().to_vector(), plain_grad(x, w, true, 2).to_vector());
  }
  {
    Tensor w = param(11, 20, 9);
    const int64_t taken = td::autograd::detail::rounded_destinations_taken();
    const Tensor wb = w.to(td::kBFloat16);
    td::DType seen = td::kFloat64;
    wb.register_hook([&](const Tensor& g) {
      seen = g.dtype();
      return Tensor();
    });
    loss_of(wb).backward();
    EXPECT_EQ(td::autograd::detail::rounded_destinations_taken(), taken);
    EXPECT_EQ(seen, td::kBFloat16);
    EXPECT_EQ(w.grad().to_vector(), plain_grad(x, w, true).to_vector());
  }
  {
    Tensor w = param(11, 20, 9);
    w.set_grad(td::ones({11, 20}, td::kFloat32));
    const int64_t taken = td::autograd::detail::rounded_destinations_taken();
    loss_of(w.to(td::kBFloat16)).backward();
    EXPECT_EQ(td::autograd::detail::rounded_destinations_taken(), taken);
    EXPECT_EQ(w.grad().to_vector(), (plain_grad(x, w, true) + 1.0).to_vector());
  }
}

namespace {

std::string what_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// autograd::grad runs only the graph between outputs and inputs (PyTorch prunes with exec_info):
// it used to run and free the whole graph, so a later backward through the rest failed, and hooks
// past the inputs fired. An input's own hooks apply; an unused input is an error unless allowed.
TEST(Grad, RunsOnlyBetweenOutputsAndInputs) {
  Tensor x = leaf({1, 2});
  Tensor h = x * x;
  int past_input_hook = 0;
  h.register_hook([&](const Tensor&) {
    ++past_input_hook;
    return Tensor();
  });
  const Tensor k = h * 3.0;
  const auto g = td::autograd::grad({sum(k * 2.0)}, {k});
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{2, 2}));
  EXPECT_EQ(past_input_hook, 0);
  sum(h).backward();  // h's graph was left alone
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 4}));

  Tensor y = leaf({1, 1});
  y.register_hook([](const Tensor& g) { return g * 2.0; });
  EXPECT_EQ(td::autograd::grad({sum(y * 3.0)}, {y})[0].to_vector(), (std::vector<double>{6, 6}));

  Tensor unused = leaf({5});
  const std::string m = what_of([&] { td::autograd::grad({sum(y * 3.0)}, {y, unused}); });
  EXPECT_NE(m.find("input 1 does not appear to have been used"), std::string::npos) << m;
  const auto allowed = td::autograd::grad({sum(y * 3.0)}, {y, unused}, {}, false, /*allow_unused=*/true);
  EXPECT_FALSE(allowed[1].defined());
}

// Hooks: retain_grad records the gradient after every other hook on the tensor (PyTorch runs it
// last); a hook returning another shape is an error (it was broadcast silently); retain_grad on a
// tensor that does not require grad is an error; a hook may remove itself while it runs.
TEST(Hooks, RetainGradRunsLastAndHooksMustKeepTheShape) {
  Tensor x = leaf({1, 1});
  Tensor z = x * 3.0;
  z.retain_grad();
  z.register_hook([](const Tensor& g) { return g * 10.0; });
  sum(z * 2.0).backward();
  EXPECT_EQ(z.grad().to_vector(), (std::vector<double>{20, 20}));

  Tensor w = leaf({1, 2, 3});
  Tensor v = w * 2.0;
  v.register_hook([](const Tensor&) { return td::ones({1}); });
  const std::string m = what_of([&] { sum(v * 1.0).backward(); });
  EXPECT_NE(m.find("returned a gradient of shape [1] for a tensor of shape [3]"), std::string::npos) << m;

  EXPECT_THROW(td::ones({2}).retain_grad(), td::AutogradError);

  Tensor s = leaf({1});
  Tensor t = s * 2.0;
  int64_t handle = 0;
  int calls = 0;
  handle = t.register_hook([&](const Tensor&) {
    ++calls;
    t.remove_hook(handle);
    return Tensor();
  });
  sum(t).backward(Tensor(), true);
  sum(t).backward();
  EXPECT_EQ(calls, 1);
}

// Leaves and gradients: a leaf frozen after the forward gets no gradient; set_grad and an explicit
// backward gradient check the dtype (a f32 gradient into a bf16 output is cast, as PyTorch's
// validate_outputs; an integer one is an error); an expanded grad accumulates out of place.
TEST(Leaves, FrozenLeavesDtypesAndExpandedGradients) {
  Tensor x = leaf({1, 1});
  const Tensor y = sum(x * 2.0);
  x.requires_grad_(false);
  y.backward();
  EXPECT_FALSE(x.grad().defined());

  Tensor a = leaf({1, 2}, td::kFloat32);
  EXPECT_THROW(a.set_grad(td::ones({2}, td::kFloat64)), td::DTypeError);
  Tensor b = a.to(td::kBFloat16) * 3.0;
  b.backward(td::tensor(std::vector<double>{1.001, 1}, {2}));  // cast to bf16 (1.001 -> 1) first
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{3, 3}));
  EXPECT_THROW(b.backward(td::ones({2}, td::kInt64)), td::DTypeError);

  Tensor e = leaf({0, 0, 0});
  e.set_grad(td::zeros({1}, td::kFloat64).expand({3}));
  sum(e * td::tensor(std::vector<double>{1, 2, 3}, {3}, td::kFloat64)).backward();
  EXPECT_EQ(e.grad().to_vector(), (std::vector<double>{1, 2, 3}));  // was [6, 6, 6]
}

// create_graph is refused (higher-order gradients are not implemented): the gradients would carry
// no history and a penalty built from them would silently get no gradient.
TEST(Engine, CreateGraphIsRefusedNotSilentlyIgnored) {
  Tensor x = leaf({1, 2});
  const std::string m = what_of([&] { sum(x * x * x).backward(Tensor(), true, true); });
  EXPECT_NE(m.find("create_graph=true"), std::string::npos) << m;
  EXPECT_FALSE(x.grad().defined());
}

// Two threads running backward through graphs that share a leaf: every gradient is accumulated
// (unsynchronised accumulation lost updates and could corrupt the heap).
TEST(Engine, BackwardOnTwoThreadsIntoOneLeafLosesNothing) {
  for (int trial = 0; trial < 300; ++trial) {
    Tensor w = leaf({1, 1, 1, 1});
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) threads.emplace_back([&] { sum(w * 1.0).backward(); });
    for (auto& t : threads) t.join();
    ASSERT_EQ(w.grad().to_vector(), (std::vector<double>{2, 2, 2, 2})) << trial;
  }
}

// In-place writes that would write a memory location twice, or read what they already wrote,
// are errors as in PyTorch (an expanded target summed every source element into one location; an
// overlapping source gave a running sum).
TEST(Inplace, OverlappingWritesAreErrors) {
  td::NoGradGuard no_grad;
  Tensor e = td::zeros({1}).expand({3});
  EXPECT_THROW(e.add_(td::tensor(std::vector<double>{1, 2, 3}, {3})), td::ValueError);
  EXPECT_THROW(e.mul_(2.0), td::ValueError);
  EXPECT_THROW(e.copy_(td::ones({3})), td::ValueError);
  Tensor r = td::tensor(std::vector<double>{0, 1, 2, 3, 4}, {5});
  const std::string m = what_of([&] { r.slice(0, 1, 5).add_(r.slice(0, 0, 4)); });
  EXPECT_NE(m.find("overlap in part"), std::string::npos) << m;
  EXPECT_EQ(r.to_vector(), (std::vector<double>{0, 1, 2, 3, 4}));
  r.add_(r);  // the same view twice is fine
  EXPECT_EQ(r.to_vector(), (std::vector<double>{0, 2, 4, 6, 8}));
  // Interleaved views share a byte range but no element: allowed, as in PyTorch.
  Tensor mat = td::tensor(std::vector<double>{1, 2, 3, 4}, {2, 2});
  mat.select(1, 0).add_(mat.select(1, 1));
  EXPECT_EQ(mat.to_vector(), (std::vector<double>{3, 2, 7, 4}));
  // fill_ and zero_ write one value: allowed on an expanded view, as in PyTorch.
  Tensor base = td::zeros({1});
  base.expand({3}).fill_(2.0);
  EXPECT_EQ(base.item(), 2.0);
}

// relu's backward passes the gradient where the result is NaN (PyTorch's threshold_backward),
// matching its forward, which passes NaN.
TEST(Inplace, ReluBackwardPassesTheGradientAtNan) {
  Tensor x = td::tensor(std::vector<double>{NAN, 1, -1}, {3}, td::kFloat64);
  x.requires_grad_(true);
  sum(td::ops::relu(x)).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 0}));
}

// ---- version counter (PyTorch's _version and SavedVariable's check) ----

TEST(VersionCounter, InPlaceWritesBumpTheVersionSharedByViewsAndDetach) {
  Tensor t = td::zeros({2, 3});
  EXPECT_EQ(t.version(), 0u);
  t.add_(td::ones({2, 3}));
  EXPECT_EQ(t.version(), 1u);
  Tensor v = t.select(0, 1);
  Tensor d = t.detach();
  v.mul_(2.0);
  d.fill_(3.0);
  t.zero_();
  t.copy_(td::ones({3}));
  EXPECT_EQ(t.version(), 5u);
  EXPECT_EQ(v.version(), 5u);
  EXPECT_EQ(d.version(), 5u);
  EXPECT_EQ(t.clone().version(), 0u);  // a copy starts afresh
  // A refused write (partial overlap) leaves the version alone.
  Tensor r = td::zeros({5});
  EXPECT_THROW(r.slice(0, 1, 5).add_(r.slice(0, 0, 4)), td::ValueError);
  EXPECT_EQ(r.version(), 0u);
}

TEST(VersionCounter, BackwardRefusesASavedInputWrittenInPlaceAfterTheForward) {
  // x needs no gradient, so in-place writes to it are allowed; but w's gradient needs x's values
  // at the forward (PyTorch: "one of the variables needed for gradient computation has been
  // modified by an inplace operation").
  Tensor x = td::tensor(std::vector<double>{1, 2, 3, 4}, {2, 2}, td::kFloat64);
  Tensor w = td::tensor(std::vector<double>{1, 0, 0, 1}, {2, 2}, td::kFloat64);
  w.requires_grad_(true);
  Tensor loss = sum(td::ops::linear(x, w));
  x.mul_(10.0);
  const std::string m = what_of([&] { loss.backward(); });
  EXPECT_NE(m.find("modified by an inplace operation"), std::string::npos) << m;
  EXPECT_NE(m.find("LinearBackward"), std::string::npos) << m;
  EXPECT_NE(m.find("is at version 1; expected version 0"), std::string::npos) << m;
  EXPECT_FALSE(w.grad().defined());
  // The same through matmul and mul.
  Tensor a = td::tensor(std::vector<double>{1, 2}, {1, 2}, td::kFloat64);
  Tensor l2 = sum(td::ops::matmul(a, w));
  a.add_(td::ones({1, 2}, td::kFloat64));
  EXPECT_THROW(l2.backward(), td::AutogradError);
  Tensor b = td::tensor(std::vector<double>{1, 2}, {2}, td::kFloat64);
  Tensor l3 = sum(td::ops::mul(b, w.select(0, 0)));
  b.zero_();
  EXPECT_THROW(l3.backward(), td::AutogradError);
}

TEST(VersionCounter, WritesToTensorsTheBackwardDoesNotNeedAreFine) {
  // add saves nothing; mul saves b only when a needs a gradient (PyTorch saves the same).
  Tensor x = td::tensor(std::vector<double>{1, 2}, {2}, td::kFloat64);
  Tensor w = leaf({3, 4});
  Tensor y = sum(td::ops::add(x, w));
  x.fill_(7.0);
  y.backward();
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{1, 1}));
  Tensor c = td::tensor(std::vector<double>{5, 6}, {2}, td::kFloat64);
  Tensor w2 = leaf({1, 1});
  Tensor z = sum(td::ops::mul(c, w2));
  {
    td::NoGradGuard no_grad;
    w2.mul_(100.0);  // w2's own value is not needed for its gradient
  }
  z.backward();
  EXPECT_EQ(w2.grad().to_vector(), (std::vector<double>{5, 6}));
}

TEST(VersionCounter, SavedOutputsAndAnOptimizerStepBeforeBackwardAreCaught) {
  // relu saves its output: writing it under NoGradGuard would change the mask backward uses.
  Tensor x = leaf({-1, 2, 3});
  Tensor r = td::ops::relu(x);
  Tensor l = sum(r * 2.0);
  {
    td::NoGradGuard no_grad;
    r.fill_(0.0);
  }
  EXPECT_THROW(l.backward(), td::AutogradError);
  // The GAN mistake: step() between a forward and its backward changes a weight the backward needs.
  Tensor w1 = leaf({0.5, -0.25, 1.0, 2.0});
  Tensor w2 = leaf({1.0, -1.0});
  Tensor in = td::tensor(std::vector<double>{1, 2}, {1, 2}, td::kFloat64);
  auto forward = [&] {
    Tensor h = td::ops::relu(td::ops::linear(in, w1.view({2, 2})));
    return sum(td::ops::linear(h, w2.view({1, 2})));
  };
  forward().backward();
  td::optim::SGD opt({w1, w2}, {.lr = 0.1});
  Tensor again = forward();
  opt.step();
  const std::string m = what_of([&] { again.backward(); });
  EXPECT_NE(m.find("modified by an inplace operation"), std::string::npos) << m;
  EXPECT_NE(m.find("optimizer step()"), std::string::npos) << m;
  // retain_graph: a second backward after an in-place change is refused too.
  opt.zero_grad();
  Tensor kept = forward();
  kept.backward(Tensor(), /*retain_graph=*/true);
  opt.step();
  EXPECT_THROW(kept.backward(), td::AutogradError);
  // step() then a fresh forward is the normal order.
  opt.zero_grad();
  EXPECT_NO_THROW(forward().backward());
}

// A saved output is held without its grad_fn: a graph never backwarded (inference with grad on,
// a metric, an abandoned forward) is freed when its last tensor goes. Saving the output itself
// made node -> output -> grad_fn -> node, a cycle that leaked every such graph.
TEST(VersionCounter, SavedOutputsDoNotKeepTheirGraphAlive) {
  Tensor x = leaf({-1, 2, 3});
  std::weak_ptr<td::TensorImpl> out;
  std::weak_ptr<td::autograd::Node> node;
  {
    Tensor y = td::ops::exp(td::ops::relu(x * 2.0));
    out = y.impl_ptr();
    node = y.grad_fn();
    EXPECT_FALSE(node.expired());
  }
  EXPECT_TRUE(out.expired());
  EXPECT_TRUE(node.expired());
}
