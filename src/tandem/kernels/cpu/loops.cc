#include "tandem/kernels/cpu/loops.h"

#include "tandem/core/convert.h"

namespace tandem::kernels {

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TANDEM_CHECK(da == db || da == 1 || db == 1, ShapeError,
                 "{}: shapes {} and {} cannot be broadcast together (dimension {}: {} vs {})", op, shape_str(a),
                 shape_str(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Shape broadcast_strides(const Tensor& t, const Shape& shape, const char* op) {
  const size_t n = shape.size(), m = static_cast<size_t>(t.dim());
  TANDEM_CHECK(m <= n, ShapeError, "{}: cannot broadcast shape {} to {}", op, shape_str(t.shape()), shape_str(shape));
  Shape st(n, 0);
  for (size_t i = 0; i < m; ++i) {
    const size_t j = n - m + i;
    const int64_t s = t.shape()[i];
    TANDEM_CHECK(s == shape[j] || s == 1, ShapeError, "{}: cannot broadcast shape {} to {}", op, shape_str(t.shape()),
                 shape_str(shape));
    st[j] = s == 1 ? 0 : t.strides()[i];
  }
  return st;
}

void copy_into(Tensor& dst, const Tensor& src) {
  const Shape& shape = dst.shape();
  const Shape sst = broadcast_strides(src, shape, "copy_");
  if (dst.is_contiguous() && src.is_contiguous() && src.shape() == shape) {
    convert(src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), dst.numel());
    return;
  }
  const size_t ds = dst.element_size(), ss = src.element_size();
  const DType sdt = src.dtype(), ddt = dst.dtype();
  for_each_row<2>(shape, {dst.strides(), sst}, {static_cast<char*>(dst.data_ptr()), static_cast<char*>(src.data_ptr())},
                  {ds, ss}, [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n, int64_t) {
                    if (st[0] == 1 && st[1] == 1) {
                      convert(p[1], sdt, p[0], ddt, n);
                      return;
                    }
                    if (sdt == ddt) {
                      auto strided_copy = [&](auto tag) {
                        using U = decltype(tag);
                        U* o = reinterpret_cast<U*>(p[0]);
                        const U* in = reinterpret_cast<const U*>(p[1]);
                        for (int64_t i = 0; i < n; ++i) o[i * st[0]] = in[i * st[1]];
                      };
                      switch (ds) {
                        case 8: return strided_copy(uint64_t{});
                        case 4: return strided_copy(uint32_t{});
                        case 2: return strided_copy(uint16_t{});
                        default: return strided_copy(uint8_t{});
                      }
                    }
                    for (int64_t i = 0; i < n; ++i) {
                      convert(p[1] + i * st[1] * static_cast<int64_t>(ss), sdt, p[0] + i * st[0] * static_cast<int64_t>(ds),
                              ddt, 1);
                    }
                  });
}

}  // namespace tandem::kernels
