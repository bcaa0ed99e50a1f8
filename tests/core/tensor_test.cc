// Tensor: views share storage with the right shape/strides/offset/values, copies are deep,
// factories, dtype conversion, item(), printing.
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
using td::Shape;
using td::Tensor;

namespace {

std::vector<double> iota(int64_t n, double start = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = start + static_cast<double>(i);
  return v;
}

// 0, 1, ..., 23 as a (2, 3, 4) f32 tensor.
Tensor cube() { return td::arange(24, td::kFloat32).view({2, 3, 4}); }

}  // namespace

TEST(TensorView, ViewSharesStorage) {
  Tensor base = td::arange(24, td::kFloat32);
  Tensor v = base.view({2, 3, 4});
  EXPECT_EQ(v.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(v.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(v.storage().get(), base.storage().get());
  EXPECT_EQ(v.data_ptr(), base.data_ptr());
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.to_vector(), iota(24));
  // Writes through the view reach the base.
  v.select(0, 1).select(0, 2).fill_(-1.0);  // elements 20..23
  const std::vector<double> b = base.to_vector();
  EXPECT_EQ(b[19], 19.0);
  EXPECT_EQ(b[20], -1.0);
  EXPECT_EQ(b[23], -1.0);
  // One inferred dimension.
  EXPECT_EQ(base.view({-1, 6}).shape(), (Shape{4, 6}));
  EXPECT_THROW(base.view({-1, -1}), td::ShapeError);
  EXPECT_THROW(base.view({5, 5}), td::ShapeError);
  EXPECT_THROW(base.view({7, -1}), td::ShapeError);
}

TEST(TensorView, ViewOfNonContiguousThrowsReshapeCopies) {
  Tensor x = cube();
  Tensor t = x.transpose(1, 2);  // (2, 4, 3), strides (12, 1, 4)
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_THROW(t.view({24}), td::ShapeError);
  Tensor r = t.reshape({24});
  EXPECT_NE(r.storage().get(), x.storage().get());  // had to copy
  std::vector<double> expected;
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 3; ++j) expected.push_back(i * 12 + j * 4 + k);
  EXPECT_EQ(r.to_vector(), expected);
  // Merging dims that are still contiguous with each other is a view even on a strided tensor.
  Tensor s = x.slice(0, 1, 2);  // (1, 3, 4) at offset 12
  Tensor rv = s.reshape({12});
  EXPECT_EQ(rv.storage().get(), x.storage().get());
  EXPECT_EQ(rv.offset(), 12);
  EXPECT_EQ(rv.to_vector(), iota(12, 12));
  // Splitting the transposed dim keeps a view: (2, 4, 3) -> (2, 2, 2, 3).
  Tensor split = t.view({2, 2, 2, 3});
  EXPECT_EQ(split.storage().get(), x.storage().get());
  EXPECT_EQ(split.strides(), (Shape{12, 2, 1, 4}));
}

TEST(TensorView, PermuteAndTranspose) {
  Tensor x = cube();
  Tensor p = x.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  EXPECT_EQ(p.storage().get(), x.storage().get());
  const std::vector<double> v = p.to_vector();
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(v[(k * 2 + i) * 3 + j], i * 12 + j * 4 + k);
  EXPECT_THROW(x.permute({0, 0, 1}), td::ShapeError);
  EXPECT_THROW(x.permute({0, 1}), td::ShapeError);
  EXPECT_EQ(x.permute({-1, 0, 1}).shape(), (Shape{4, 2, 3}));

  Tensor t = x.transpose(0, -1);
  EXPECT_EQ(t.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(t.strides(), (Shape{1, 4, 12}));
  Tensor m = td::arange(6, td::kFloat32).view({2, 3});
  EXPECT_EQ(m.t().shape(), (Shape{3, 2}));
  EXPECT_EQ(m.t().to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_THROW(x.t(), td::ShapeError);
}

TEST(TensorView, SliceWithStepNarrowSelect) {
  Tensor a = td::arange(10, td::kFloat32);
  Tensor s = a.slice(0, 1, 8, 3);
  EXPECT_EQ(s.shape(), (Shape{3}));
  EXPECT_EQ(s.strides(), (Shape{3}));
  EXPECT_EQ(s.offset(), 1);
  EXPECT_EQ(s.storage().get(), a.storage().get());
  EXPECT_EQ(s.to_vector(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(a.slice(0, 1, 9, 3).to_vector(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(a.slice(0, 1, 10, 3).to_vector(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(a.slice(0, 0, 10, 3).to_vector(), (std::vector<double>{0, 3, 6, 9}));
  EXPECT_EQ(a.slice(0, -3, 100).to_vector(), (std::vector<double>{7, 8, 9}));  // clamped like Python
  EXPECT_EQ(a.slice(0, 5, 2).numel(), 0);
  EXPECT_THROW(a.slice(0, 0, 5, 0), td::ValueError);

  Tensor x = cube();
  Tensor c = x.slice(2, 1, 4, 2);  // columns 1 and 3
  EXPECT_EQ(c.shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(c.strides(), (Shape{12, 4, 2}));
  EXPECT_EQ(c.offset(), 1);
  EXPECT_EQ(c.to_vector(), (std::vector<double>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23}));

  Tensor n = x.narrow(1, 1, 2);
  EXPECT_EQ(n.shape(), (Shape{2, 2, 4}));
  EXPECT_EQ(n.offset(), 4);
  EXPECT_EQ(n.to_vector()[0], 4.0);
  EXPECT_THROW(x.narrow(1, 2, 2), td::ShapeError);

  Tensor sel = x.select(1, -1);
  EXPECT_EQ(sel.shape(), (Shape{2, 4}));
  EXPECT_EQ(sel.strides(), (Shape{12, 1}));
  EXPECT_EQ(sel.offset(), 8);
  EXPECT_EQ(sel.to_vector(), (std::vector<double>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(x.select(0, 1).select(0, 1).select(0, 1).item(), 17.0);
  EXPECT_THROW(x.select(1, 3), td::ShapeError);
  EXPECT_THROW(x.select(3, 0), td::ShapeError);
}

TEST(TensorView, ExpandSqueezeUnsqueezeFlatten) {
  Tensor col = td::tensor(std::vector<double>{1, 2, 3}, {3, 1});
  Tensor e = col.expand({2, 3, 4});
  EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(e.storage().get(), col.storage().get());
  const std::vector<double> ev = e.to_vector();
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) EXPECT_EQ(ev[(i * 3 + j) * 4 + k], j + 1);
  EXPECT_EQ(col.expand({-1, 5}).shape(), (Shape{3, 5}));
  EXPECT_THROW(col.expand({4, 4}), td::ShapeError);
  EXPECT_THROW(col.expand({3}), td::ShapeError);

  Tensor x = cube().unsqueeze(1);
  EXPECT_EQ(x.shape(), (Shape{2, 1, 3, 4}));
  EXPECT_EQ(cube().unsqueeze(-1).shape(), (Shape{2, 3, 4, 1}));
  EXPECT_EQ(cube().unsqueeze(3).shape(), (Shape{2, 3, 4, 1}));
  EXPECT_THROW(cube().unsqueeze(4), td::ShapeError);
  EXPECT_EQ(x.squeeze(1).shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(x.squeeze(0).shape(), (Shape{2, 1, 3, 4}));  // size 2: unchanged
  EXPECT_EQ(x.squeeze(1).storage().get(), x.storage().get());

  Tensor y = cube();
  EXPECT_EQ(y.flatten().shape(), (Shape{24}));
  EXPECT_EQ(y.flatten(1).shape(), (Shape{2, 12}));
  EXPECT_EQ(y.flatten(0, 1).shape(), (Shape{6, 4}));
  EXPECT_EQ(y.flatten(1).storage().get(), y.storage().get());
  EXPECT_EQ(td::scalar_tensor(3.0).flatten().shape(), (Shape{1}));
  EXPECT_THROW(y.flatten(2, 1), td::ShapeError);
  // Flattening a transposed tensor copies, in the logical order.
  EXPECT_EQ(td::arange(6, td::kFloat32).view({2, 3}).t().flatten().to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

TEST(TensorCopy, ContiguousToClone) {
  Tensor x = cube();
  EXPECT_TRUE(x.contiguous().is_same(x));
  Tensor t = x.permute({2, 1, 0});
  Tensor c = t.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.strides(), (Shape{6, 2, 1}));
  EXPECT_NE(c.storage().get(), x.storage().get());
  EXPECT_EQ(c.to_vector(), t.to_vector());

  // clone() is deep: changing the copy leaves the original alone, and vice versa.
  Tensor k = x.clone();
  EXPECT_NE(k.storage().get(), x.storage().get());
  k.fill_(5.0);
  EXPECT_EQ(x.to_vector(), iota(24));
  x.zero_();
  EXPECT_EQ(k.to_vector(), std::vector<double>(24, 5.0));
  EXPECT_TRUE(t.clone().is_contiguous());

  // to(dtype)
  Tensor f = td::tensor(std::vector<double>{-2.7, -0.5, 0.4, 1.0 + 1.0 / 256, 3.5}, {5});
  EXPECT_TRUE(f.to(td::kFloat32).is_same(f));
  EXPECT_EQ(f.to(td::kInt64).to_vector(), (std::vector<double>{-2, 0, 0, 1, 3}));  // truncation
  Tensor bf = f.to(td::kBFloat16);
  EXPECT_EQ(bf.dtype(), td::kBFloat16);
  EXPECT_EQ(bf.to_vector()[3], 1.0);  // 1 + 2^-8 is a tie -> even (1.0)
  EXPECT_EQ(bf.to_vector()[0], -2.703125);  // nearest bf16 to the f32 nearest -2.7
  EXPECT_EQ(f.to(td::kFloat64).to_vector()[2], static_cast<double>(0.4f));
  EXPECT_EQ(f.to(td::kBool).to_vector(), (std::vector<double>{1, 1, 1, 1, 1}));
  // Converting a strided view converts the viewed elements only.
  EXPECT_EQ(td::arange(10, td::kFloat32).slice(0, 1, 10, 4).to(td::kFloat16).to_vector(),
            (std::vector<double>{1, 5, 9}));
}

TEST(TensorFactory, ZerosOnesFullArange) {
  for (td::DType dt : {td::kFloat32, td::kFloat64, td::kFloat16, td::kBFloat16, td::kInt64, td::kInt32, td::kUInt8,
                       td::kBool}) {
    Tensor z = td::zeros({2, 3}, dt);
    EXPECT_EQ(z.dtype(), dt);
    EXPECT_EQ(z.shape(), (Shape{2, 3}));
    EXPECT_EQ(z.to_vector(), std::vector<double>(6, 0.0));
    EXPECT_EQ(td::ones({4}, dt).to_vector(), std::vector<double>(4, 1.0)) << td::dtype_name(dt);
  }
  EXPECT_EQ(td::full({2}, 2.5, td::kFloat16).to_vector(), (std::vector<double>{2.5, 2.5}));
  EXPECT_EQ(td::full({1}, 1.0 / 3, td::kBFloat16).to_vector()[0], static_cast<double>(td::bfloat16(1.0f / 3)));
  EXPECT_EQ(td::full({}, 7, td::kInt32).item(), 7.0);
  EXPECT_EQ(td::zeros({0, 3}).numel(), 0);
  EXPECT_THROW(td::zeros({-1}), td::ShapeError);

  Tensor a = td::arange(5);
  EXPECT_EQ(a.dtype(), td::kInt64);
  EXPECT_EQ(a.to_vector(), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(td::arange(0, 1, 0.25, td::kFloat32).to_vector(), (std::vector<double>{0, 0.25, 0.5, 0.75}));
  EXPECT_EQ(td::arange(1, 0, -0.25, td::kFloat64).to_vector(), (std::vector<double>{1, 0.75, 0.5, 0.25}));
  EXPECT_EQ(td::arange(2, 9, 3).to_vector(), (std::vector<double>{2, 5, 8}));
  EXPECT_THROW(td::arange(3, 1), td::ValueError);  // PyTorch: bounds inconsistent with the step sign
  EXPECT_THROW(td::arange(0, 1, 0), td::ValueError);
}

TEST(TensorFactory, TensorAndScalar) {
  Tensor t = td::tensor(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3}, td::kFloat64);
  EXPECT_EQ(t.dtype(), td::kFloat64);
  EXPECT_EQ(t.to_vector(), iota(6, 1));
  Tensor f = td::tensor(std::vector<float>{0.5f, 1.5f}, {2});
  EXPECT_EQ(f.dtype(), td::kFloat32);
  Tensor i = td::tensor(std::vector<int64_t>{-3, 9}, {2, 1});
  EXPECT_EQ(i.dtype(), td::kInt64);
  EXPECT_EQ(i.to_vector(), (std::vector<double>{-3, 9}));
  EXPECT_THROW(td::tensor(std::vector<double>{1, 2, 3}, {2, 2}), td::ShapeError);
  EXPECT_THROW(td::tensor(std::vector<float>{1, 2, 3}, {2}), td::ShapeError);
  Tensor s = td::scalar_tensor(4.25, td::kFloat64);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.item(), 4.25);
  EXPECT_EQ(s.item<int>(), 4);
  EXPECT_EQ(td::tensor(std::vector<double>{2}, {1, 1}).item(), 2.0);
}

TEST(TensorFactory, FromBlobBorrowsAndCallsDeleterOnce) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  int calls = 0;
  void* seen = nullptr;
  Tensor view;
  {
    Tensor t = td::from_blob(buf.data(), {2, 3}, td::kFloat32, [&](void* p) {
      ++calls;
      seen = p;
    });
    EXPECT_EQ(t.data_ptr(), buf.data());
    EXPECT_EQ(t.to_vector(), iota(6, 1));
    t.select(0, 0).fill_(0.0);  // writes into the caller's memory
    EXPECT_EQ(buf[0], 0.0f);
    EXPECT_EQ(buf[3], 4.0f);
    view = t.t();
  }
  EXPECT_EQ(calls, 0) << "a view still holds the storage";
  EXPECT_EQ(view.to_vector()[1], 4.0);
  view = Tensor();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, buf.data());

  // Explicit strides, and no deleter.
  std::vector<int32_t> ints = {0, 1, 2, 3, 4, 5, 6, 7};
  Tensor s = td::from_blob(ints.data(), {2, 2}, {4, 2}, td::kInt32);
  EXPECT_EQ(s.to_vector(), (std::vector<double>{0, 2, 4, 6}));
  EXPECT_THROW(td::from_blob(ints.data(), {2, 2}, {1}, td::kInt32), td::ShapeError);
}

TEST(TensorFactory, RandIntRange) {
  td::Generator g(7);
  Tensor r = td::randint(-3, 4, {2000}, &g);
  EXPECT_EQ(r.dtype(), td::kInt64);
  std::set<int64_t> values;
  for (double v : r.to_vector()) {
    ASSERT_GE(v, -3);
    ASSERT_LT(v, 4);
    values.insert(static_cast<int64_t>(v));
  }
  EXPECT_EQ(values.size(), 7u);  // each value has chance 1/7; missing one in 2000 draws is ~1e-133
  EXPECT_THROW(td::randint(5, 5, {1}), td::ValueError);
  td::Generator g2(7);
  EXPECT_EQ(td::randint(-3, 4, {2000}, &g2).to_vector(), r.to_vector());
}

TEST(TensorMeta, ItemSizeStrideErrors) {
  Tensor x = cube();
  EXPECT_THROW(x.item(), td::ShapeError);
  EXPECT_THROW(td::zeros({0}).item(), td::ShapeError);
  EXPECT_EQ(x.size(-1), 4);
  EXPECT_EQ(x.stride(0), 12);
  EXPECT_EQ(x.numel(), 24);
  EXPECT_EQ(x.nbytes(), 96u);
  EXPECT_EQ(x.dim(), 3);
  EXPECT_THROW(x.size(3), td::ShapeError);
  EXPECT_THROW(x.size(-4), td::ShapeError);
  EXPECT_THROW(x.data_ptr<double>(), td::DTypeError);
  EXPECT_NO_THROW(x.data_ptr<float>());
  EXPECT_THROW(Tensor().shape(), td::Error);
  EXPECT_FALSE(Tensor().defined());
}

TEST(TensorPrint, ToStringShowsValuesShapeDtype) {
  Tensor t = td::tensor(std::vector<double>{1.5, -2, 3.25, 4, 5, 6}, {2, 3});
  const std::string s = t.to_string();
  EXPECT_NE(s.find("1.5000"), std::string::npos) << s;
  EXPECT_NE(s.find("-2.0000"), std::string::npos) << s;
  EXPECT_NE(s.find("3.2500"), std::string::npos) << s;
  EXPECT_NE(s.find("shape=[2, 3]"), std::string::npos) << s;
  EXPECT_NE(s.find("dtype=float32"), std::string::npos) << s;
  EXPECT_EQ(s.find("requires_grad"), std::string::npos) << s;

  const std::string i = td::arange(3).to_string();
  EXPECT_NE(i.find("[0, 1, 2]"), std::string::npos) << i;
  EXPECT_NE(i.find("int64"), std::string::npos) << i;

  // Long rows are elided but keep the first and last three.
  const std::string l = td::arange(100).to_string();
  EXPECT_NE(l.find("[0, 1, 2, ..., 97, 98, 99]"), std::string::npos) << l;

  Tensor g = td::ones({2}, td::kBFloat16);
  g.requires_grad_(true);
  const std::string gs = g.to_string();
  EXPECT_NE(gs.find("bfloat16"), std::string::npos) << gs;
  EXPECT_NE(gs.find("requires_grad=True"), std::string::npos) << gs;

  std::ostringstream os;
  os << td::scalar_tensor(2.0);
  EXPECT_NE(os.str().find("2.0000"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("shape=[]"), std::string::npos) << os.str();
  EXPECT_EQ(Tensor().to_string(), "Tensor(undefined)");
  EXPECT_EQ(td::shape_str({2, 3}), "[2, 3]");
}

// Shapes whose element or byte count overflows are errors, not tiny buffers behind huge shapes
// (PyTorch: "numel: integer multiplication overflow"); a request past any size class is an error,
// not an endless loop in the allocator; negative sizes are errors in every factory.
TEST(TensorSafety, OverflowingOrNegativeShapesAreErrors) {
  EXPECT_THROW(td::empty({int64_t{1} << 62}), td::ShapeError);  // 2^64 bytes of f32
  EXPECT_THROW(td::zeros({int64_t{1} << 32, int64_t{1} << 32}), td::ShapeError);
  EXPECT_THROW(td::empty({3, int64_t{1} << 62}), td::ShapeError);
  EXPECT_THROW(td::empty_strided({-1}, {1}), td::ShapeError);
  EXPECT_EQ(td::zeros({0, int64_t{1} << 62}).numel(), 0);  // no elements: no overflow
  EXPECT_THROW(td::ones({1}).expand({-2}), td::ShapeError);
  EXPECT_THROW(td::ones({1}).expand({-5, 1}), td::ShapeError);
}

// A 0-d tensor has no dimension to index: size(0), select, narrow and transpose(5, 7) are errors
// (size(0) read past an empty shape and crashed).
TEST(TensorSafety, ZeroDimTensorsHaveNoDimensionsToIndex) {
  const Tensor s = td::scalar_tensor(3);
  EXPECT_THROW(s.size(0), td::ShapeError);
  EXPECT_THROW(s.stride(-1), td::ShapeError);
  EXPECT_THROW(s.select(0, 0), td::ShapeError);
  EXPECT_THROW(s.narrow(0, 0, 1), td::ShapeError);
  EXPECT_THROW(s.transpose(5, 7), td::ShapeError);
  EXPECT_EQ(s.transpose(0, -1).item(), 3.0);
}

// Literal values are checked as PyTorch's factories check them, integers come out of item()
// exactly, and arange refuses ranges it cannot produce.
TEST(TensorSafety, LiteralsItemAndArangeAreChecked) {
  EXPECT_THROW(td::full({2}, std::nan(""), td::kInt64), td::ValueError);
  EXPECT_THROW(td::full({2}, 1e10, td::kInt32), td::ValueError);
  EXPECT_THROW(td::full({2}, 300, td::kUInt8), td::ValueError);
  EXPECT_THROW(td::full({2}, 1e300, td::kFloat32), td::ValueError);
  EXPECT_THROW(td::tensor(std::vector<double>{3e9}, {1}, td::kInt32), td::ValueError);
  EXPECT_EQ(td::full({1}, -1, td::kUInt8).item(), 255.0);  // PyTorch wraps negatives into uint8
  EXPECT_TRUE(std::isinf(td::full({1}, INFINITY, td::kFloat32).item()));
  EXPECT_EQ(td::full({1}, 2.7, td::kInt64).item<int64_t>(), 2);
  // Values computed at run time (a loss total) overflow to inf as in PyTorch's tensor().
  EXPECT_TRUE(std::isinf(td::scalar_tensor(1e39).item()));
  EXPECT_TRUE(std::isinf(td::tensor(std::vector<double>{-1e39}, {1}).item()));

  const int64_t big = (int64_t{1} << 53) + 1;
  EXPECT_EQ(td::tensor(std::vector<int64_t>{big}, {1}).item<int64_t>(), big);  // not rounded through a double
  EXPECT_THROW(td::scalar_tensor(std::nan("")).item<int64_t>(), td::ValueError);
  EXPECT_THROW(td::scalar_tensor(300).item<uint8_t>(), td::ValueError);

  EXPECT_THROW(td::arange(5, 0), td::ValueError);
  EXPECT_THROW(td::arange(0, INFINITY), td::ValueError);
  EXPECT_THROW(td::arange(0, std::nan("")), td::ValueError);
  EXPECT_EQ(td::arange(3, 0, -1, td::kInt64).to_vector(), (std::vector<double>{3, 2, 1}));
  EXPECT_EQ(td::arange(2, 2).numel(), 0);
}
