#include "tandem/core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <sstream>

#include "tandem/core/convert.h"

namespace tandem {

bool has_internal_overlap(const Tensor& t) {
  if (t.numel() == 0) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.strides()[d] == 0 && t.shape()[d] > 1) return true;
  }
  return false;
}

bool has_partial_overlap(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.storage() != b.storage()) return false;
  // PyTorch decides only for two dense layouts; interleaved views (x[:, 0] and x[:, 1]) share a
  // byte range without sharing an element and are allowed, as there.
  if (!a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  // The byte ranges each touches (strides of views are >= 0 here).
  auto range = [](const Tensor& t) {
    int64_t lo = t.offset(), hi = t.offset();
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t span = (t.shape()[d] - 1) * t.strides()[d];
      if (span < 0) lo += span;
      else hi += span;
    }
    const int64_t item = static_cast<int64_t>(element_size(t.dtype()));
    return std::pair<int64_t, int64_t>{lo * item, (hi + 1) * item};
  };
  const auto [alo, ahi] = range(a);
  const auto [blo, bhi] = range(b);
  if (ahi <= blo || bhi <= alo) return false;
  const bool same = a.offset() == b.offset() && a.shape() == b.shape() && a.strides() == b.strides() &&
                    a.dtype() == b.dtype();
  return !same;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    // An overflow would make a huge shape look small (a tiny buffer behind it); PyTorch: "numel:
    // integer multiplication overflow". Shapes with a 0 anywhere have no elements.
    if (__builtin_mul_overflow(n, s, &n)) {
      for (int64_t z : shape) {
        if (z == 0) return 0;
      }
      throw ShapeError(fmt::format("shape {} has more than 2^63 elements", shape_str(shape)));
    }
  }
  return n;
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  TANDEM_CHECK(d >= lo && d <= hi, ShapeError, "{}: dimension {} out of range for a {}-d tensor (expected {}..{})", op, d,
               ndim, lo, hi);
  return d < 0 ? d + std::max<int64_t>(ndim, 1) : d;
}

int64_t Tensor::size(int64_t d) const {
  TANDEM_CHECK(dim() > 0, ShapeError, "size({}): a 0-d tensor has no dimensions", d);
  return shape()[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int64_t d) const {
  TANDEM_CHECK(dim() > 0, ShapeError, "stride({}): a 0-d tensor has no dimensions", d);
  return strides()[wrap_dim(d, dim(), "stride")];
}
int64_t Tensor::numel() const { return shape_numel(shape()); }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // as in PyTorch: an empty tensor has no layout to violate
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    const int64_t s = impl().shape[i];
    if (s == 1) continue;
    if (impl().strides[i] != expected) return false;
    expected *= s;
  }
  return true;
}

bool Tensor::is_non_overlapping_and_dense() const {
  if (is_contiguous()) return true;
  const int64_t nd = dim();
  std::vector<int64_t> order(static_cast<size_t>(nd));
  for (int64_t i = 0; i < nd; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (impl().strides[a] != impl().strides[b]) return impl().strides[a] < impl().strides[b];
    return a > b;
  });
  int64_t expected = 1;
  for (int64_t d : order) {
    const int64_t s = impl().shape[d];
    if (s == 1) continue;
    if (impl().strides[d] != expected) return false;
    expected *= s;
  }
  return true;
}

void* Tensor::data_ptr() const {
  const TensorImpl& t = impl();
  return static_cast<char*>(t.storage->data()) + t.offset * static_cast<int64_t>(tandem::element_size(t.dtype));
}

std::vector<double> Tensor::to_vector() const {
  const int64_t n = numel();
  std::vector<double> out(static_cast<size_t>(n));
  if (n == 0) return out;
  const int64_t nd = dim();
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  const char* base = static_cast<const char*>(data_ptr());
  const size_t es = element_size();
  TANDEM_DISPATCH_ALL(dtype(), "to_vector", [&] {
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int64_t d = 0; d < nd; ++d) off += idx[d] * impl().strides[d];
      scalar_t v;
      std::memcpy(&v, base + off * static_cast<int64_t>(es), sizeof(v));
      out[static_cast<size_t>(i)] = static_cast<double>(static_cast<compute_t<scalar_t>>(v));
      for (int64_t d = nd - 1; d >= 0; --d) {
        if (++idx[d] < impl().shape[d]) break;
        idx[d] = 0;
      }
    }
  });
  return out;
}

double Tensor::item_double() const {
  TANDEM_CHECK(numel() == 1, ShapeError, "item(): expected a tensor with one element, got shape {}", shape_str(shape()));
  return to_vector()[0];
}

int64_t Tensor::item_int64() const {
  TANDEM_CHECK(numel() == 1, ShapeError, "item(): expected a tensor with one element, got shape {}", shape_str(shape()));
  const Tensor c = contiguous();
  switch (dtype()) {
    case kInt64: return *static_cast<const int64_t*>(c.data_ptr());
    case kInt32: return *static_cast<const int32_t*>(c.data_ptr());
    case kUInt8: return *static_cast<const uint8_t*>(c.data_ptr());
    case kBool: return *static_cast<const uint8_t*>(c.data_ptr()) != 0;
    default: break;
  }
  const double v = item_double();
  TANDEM_CHECK(std::isfinite(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0, ValueError,
               "item(): {} ({}) cannot be converted to an integer", v, dtype_name(dtype()));
  return static_cast<int64_t>(v);
}

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  const std::vector<double> v = to_vector();
  const int64_t nd = dim();
  const bool integral = !is_floating(dtype());
  auto fmt_val = [&](double x) {
    if (integral) return fmt::format("{}", static_cast<int64_t>(x));
    return fmt::format("{:.4f}", x);
  };
  // Nested brackets, at most 6 values per innermost row shown in full, longer rows elided.
  std::function<void(int64_t, int64_t, int64_t)> rec = [&](int64_t d, int64_t start, int64_t indent) {
    if (d == nd) {
      os << fmt_val(v[static_cast<size_t>(start)]);
      return;
    }
    const int64_t n = shape()[d];
    const int64_t inner = shape_numel(Shape(shape().begin() + d + 1, shape().end()));
    os << '[';
    for (int64_t i = 0; i < n; ++i) {
      if (n > 6 && i == 3) {
        os << "..., ";
        i = n - 3;
      }
      rec(d + 1, start + i * inner, indent + 1);
      if (i + 1 < n) os << (d + 1 == nd ? ", " : ",\n" + std::string(static_cast<size_t>(indent + 8), ' '));
    }
    os << ']';
  };
  os << "tensor(";
  if (numel() == 0) {
    os << "[]";
  } else {
    rec(0, 0, 0);
  }
  os << ", shape=" << shape_str(shape()) << ", dtype=" << dtype_name(dtype());
  if (requires_grad()) os << ", requires_grad=True";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// ---- factories ----

// numel * element size in bytes, or ShapeError when it does not fit (PyTorch: "Storage size
// calculation overflowed").
static size_t checked_nbytes(const Shape& shape, DType dtype, const char* op) {
  for (int64_t s : shape) TANDEM_CHECK(s >= 0, ShapeError, "{}: negative dimension in shape {}", op, shape_str(shape));
  size_t bytes = 0;
  TANDEM_CHECK(!__builtin_mul_overflow(static_cast<size_t>(shape_numel(shape)), tandem::element_size(dtype), &bytes) &&
                   bytes <= (size_t{1} << 62),
               ShapeError, "{}: shape {} of {} needs more bytes than can be allocated", op, shape_str(shape),
               dtype_name(dtype));
  return bytes;
}

Tensor empty(const Shape& shape, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::allocate(checked_nbytes(shape, dtype, "empty"));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor empty_strided(const Shape& shape, const Shape& strides, DType dtype) {
  TANDEM_CHECK(shape.size() == strides.size(), ShapeError, "empty_strided: shape {} and strides {} differ in length",
               shape_str(shape), shape_str(strides));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::allocate(checked_nbytes(shape, dtype, "empty_strided"));
  impl->shape = shape;
  impl->strides = strides;
  impl->dtype = dtype;
  Tensor t(std::move(impl));
  TANDEM_CHECK(t.is_non_overlapping_and_dense(), ShapeError, "empty_strided: strides {} do not densely cover shape {}",
               shape_str(strides), shape_str(shape));
  return t;
}

Tensor empty_like(const Tensor& x, DType dtype) {
  if (!x.is_contiguous() && x.is_non_overlapping_and_dense()) return empty_strided(x.shape(), x.strides(), dtype);
  return empty(x.shape(), dtype);
}

// A literal value for `dtype`, checked as PyTorch's factories check it ("value cannot be converted
// to type X without overflow"): an integer type takes a finite value in its range (uint8 also
// negative ones, wrapped, as PyTorch does), fractions truncated; float32 a value within its range
// or an infinity; the 16-bit floats round (to inf past their range, as PyTorch).
static void check_literal(double value, DType dtype, const char* op) {
  bool ok = true;
  switch (dtype) {
    case kInt64: ok = value >= -9223372036854775808.0 && value < 9223372036854775808.0; break;
    case kInt32: ok = value > -2147483649.0 && value < 2147483648.0; break;
    case kUInt8: ok = value >= -9223372036854775808.0 && value < 256.0; break;
    case kFloat32: ok = std::isnan(value) || std::isinf(value) || std::abs(value) <= 3.4028235677973366e38; break;
    default: break;
  }
  TANDEM_CHECK(ok, ValueError, "{}: value {} cannot be converted to {} without overflow", op, value, dtype_name(dtype));
}

// value as a scalar_t: integers through int64 (a negative double cast straight to uint8 is
// undefined behaviour).
template <class T>
static T literal_as(double value) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return static_cast<T>(static_cast<int64_t>(value));
  } else {
    return static_cast<T>(static_cast<compute_t<T>>(value));
  }
}

Tensor full(const Shape& shape, double value, DType dtype) {
  if (dtype != kBool) check_literal(value, dtype, "full");
  Tensor t = empty(shape, dtype);
  const int64_t n = t.numel();
  TANDEM_DISPATCH_ALL(dtype, "full", [&] {
    auto* p = static_cast<scalar_t*>(t.data_ptr());
    const scalar_t v = literal_as<scalar_t>(value);
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
  return t;
}

Tensor zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

Tensor ones(const Shape& shape, DType dtype) { return full(shape, 1.0, dtype); }

Tensor arange(double end, DType dtype) { return arange(0.0, end, 1.0, dtype); }

Tensor arange(double start, double end, double step, DType dtype) {
  TANDEM_CHECK(step != 0.0, ValueError, "arange: step must be non-zero");
  TANDEM_CHECK(std::isfinite(start) && std::isfinite(end) && std::isfinite(step), ValueError,
               "arange: unsupported range: {} -> {} (step {}); bounds and step must be finite", start, end, step);
  TANDEM_CHECK((step > 0 && end >= start) || (step < 0 && end <= start), ValueError,
               "arange: upper bound ({}) and lower bound ({}) inconsistent with the step sign ({})", end, start, step);
  const double count = std::ceil((end - start) / step);
  TANDEM_CHECK(count < 9.0e18, ValueError, "arange: {} -> {} in steps of {} has too many elements", start, end, step);
  const int64_t n = std::max<int64_t>(0, static_cast<int64_t>(count));
  Tensor t = empty({n}, dtype);
  TANDEM_DISPATCH_ALL(dtype, "arange", [&] {
    auto* p = static_cast<scalar_t*>(t.data_ptr());
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(start + i * step));
  });
  return t;
}

Tensor rand(const Shape& shape, DType dtype, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  Tensor t = empty(shape, dtype);
  const int64_t n = t.numel();
  TANDEM_DISPATCH_FLOATING(dtype, "rand", [&] {
    auto* p = static_cast<scalar_t*>(t.data_ptr());
    if constexpr (std::is_same_v<scalar_t, double>) {
      const uint64_t base = g.reserve(2 * static_cast<uint64_t>(n));
      for (int64_t i = 0; i < n; ++i) p[i] = g.uniform_double(base, static_cast<uint64_t>(i));
    } else {
      const uint64_t base = g.reserve(static_cast<uint64_t>(n));
      for (int64_t i = 0; i < n; ++i) p[i] = scalar_t(g.uniform(base, static_cast<uint64_t>(i)));
      if constexpr (std::is_same_v<scalar_t, half> || std::is_same_v<scalar_t, bfloat16>) {
        // Rounding a 24-bit uniform to 16 bits carries the top ones up to 1.0: keep [0, 1) by
        // taking the largest value below 1 instead (bf16 1 - 2^-8, f16 1 - 2^-11).
        const scalar_t below_one = static_cast<scalar_t>(std::is_same_v<scalar_t, bfloat16> ? 0.99609375f : 0.99951171875f);
        for (int64_t i = 0; i < n; ++i)
          if (static_cast<float>(p[i]) >= 1.0f) p[i] = below_one;
      }
    }
  });
  return t;
}

Tensor randn(const Shape& shape, DType dtype, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  Tensor t = empty(shape, dtype);
  const int64_t n = t.numel();
  // Box-Muller on pairs of 53-bit uniforms: element 2k and 2k+1 share one pair.
  const uint64_t base = g.reserve(4 * static_cast<uint64_t>((n + 1) / 2));
  TANDEM_DISPATCH_FLOATING(dtype, "randn", [&] {
    auto* p = static_cast<scalar_t*>(t.data_ptr());
    for (int64_t k = 0; 2 * k < n; ++k) {
      const double u1 = 1.0 - g.uniform_double(base, static_cast<uint64_t>(2 * k));  // (0, 1]
      const double u2 = g.uniform_double(base, static_cast<uint64_t>(2 * k + 1));
      const double r = std::sqrt(-2.0 * std::log(u1));
      p[2 * k] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(r * std::cos(2.0 * M_PI * u2)));
      if (2 * k + 1 < n) p[2 * k + 1] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(r * std::sin(2.0 * M_PI * u2)));
    }
  });
  return t;
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator* gen) {
  TANDEM_CHECK(high > low, ValueError, "randint: expected low < high, got low={} high={}", low, high);
  Generator& g = gen ? *gen : default_generator();
  Tensor t = empty(shape, kInt64);
  const int64_t n = t.numel();
  const uint64_t range = static_cast<uint64_t>(high - low);
  const uint64_t base = g.reserve(2 * static_cast<uint64_t>(n));
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = (static_cast<uint64_t>(g.bits(base, 2 * i)) << 32) | g.bits(base, 2 * i + 1);
    p[i] = low + static_cast<int64_t>(r % range);
  }
  return t;
}

Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype, std::function<void(void*)> deleter) {
  TANDEM_CHECK(shape.size() == strides.size(), ShapeError, "from_blob: shape {} and strides {} differ in length",
               shape_str(shape), shape_str(strides));
  int64_t extent = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    TANDEM_CHECK(shape[i] >= 0 && strides[i] >= 0, ShapeError, "from_blob: negative size or stride in {} / {}",
                 shape_str(shape), shape_str(strides));
    if (shape[i] == 0) extent = 0;
    if (extent) extent += (shape[i] - 1) * strides[i];
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::borrow(data, static_cast<size_t>(extent) * tandem::element_size(dtype), std::move(deleter));
  impl->shape = shape;
  impl->strides = strides;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor from_blob(void* data, const Shape& shape, DType dtype, std::function<void(void*)> deleter) {
  return from_blob(data, shape, contiguous_strides(shape), dtype, std::move(deleter));
}

Tensor tensor(const std::vector<double>& values, const Shape& shape, DType dtype) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), ShapeError,
               "tensor: {} values do not fill shape {} ({} elements)", values.size(), shape_str(shape), shape_numel(shape));
  Tensor t = empty(shape, dtype);
  if (dtype == kBool || is_floating(dtype)) {
    // As PyTorch's tensor(): a float past the dtype's range becomes inf (values computed at run
    // time, e.g. a gradient's sums, come through here).
    convert(values.data(), kFloat64, t.data_ptr(), dtype, t.numel());
  } else {
    TANDEM_DISPATCH_ALL(dtype, "tensor", [&] {
      auto* p = static_cast<scalar_t*>(t.data_ptr());
      for (size_t i = 0; i < values.size(); ++i) {
        check_literal(values[i], dtype, "tensor");
        p[i] = literal_as<scalar_t>(values[i]);
      }
    });
  }
  return t;
}

Tensor tensor(const std::vector<float>& values, const Shape& shape) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), ShapeError,
               "tensor: {} values do not fill shape {} ({} elements)", values.size(), shape_str(shape), shape_numel(shape));
  Tensor t = empty(shape, kFloat32);
  std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(float));
  return t;
}

Tensor tensor(const std::vector<int64_t>& values, const Shape& shape) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), ShapeError,
               "tensor: {} values do not fill shape {} ({} elements)", values.size(), shape_str(shape), shape_numel(shape));
  Tensor t = empty(shape, kInt64);
  std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

Tensor scalar_tensor(double value, DType dtype) {
  // A computed value (a loss total) may pass float32's range: inf, as tensor() gives, not an error.
  if (is_floating(dtype) || dtype == kBool) return tensor(std::vector<double>{value}, {}, dtype);
  return full({}, value, dtype);
}

}  // namespace tandem
