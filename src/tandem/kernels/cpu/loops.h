// Elementwise loop machinery for CPU kernels: broadcasting, strided iteration over rows,
// dtype dispatch, and run-time splitting over the intra-op pool. Kernels are written as
// functors on compute_t<T> (float for bf16/f16); loads and stores convert.
// Invariant: outputs are freshly allocated, contiguous or in the dense layout of their input
// (channels-last stays channels-last); inputs may be any strided view.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "tandem/core/convert.h"
#include "tandem/core/parallel.h"
#include "tandem/core/tensor.h"

namespace tandem::kernels {

// PyTorch's broadcast of two shapes; throws ShapeError naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Strides that view `t` as `shape` (right-aligned; broadcast dims get stride 0).
Shape broadcast_strides(const Tensor& t, const Shape& shape, const char* op);

// Elements per parallel chunk for cheap elementwise work.
inline constexpr int64_t kElementwiseGrain = 32768;

// Calls row(ptrs, inner_strides, n, outer_index) for each innermost row of the index space
// `shape`, where operand k's element (i0, ..., i_{d-1}) lives at base[k] + sum(i * strides[k]),
// strides in elements. Dimensions are coalesced first so contiguous data is one long row.
template <size_t N, class Row>
void for_each_row(Shape shape, std::array<Shape, N> strides, std::array<char*, N> base, std::array<size_t, N> esize,
                  Row row) {
  // ---- drop size-1 dims, then merge neighbours that are contiguous for every operand ----
  Shape s;
  std::array<Shape, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    s.push_back(shape[d]);
    for (size_t k = 0; k < N; ++k) st[k].push_back(strides[k][d]);
  }
  if (s.empty()) {
    s.push_back(1);
    for (size_t k = 0; k < N; ++k) st[k].push_back(0);
  }
  for (int64_t d = static_cast<int64_t>(s.size()) - 2; d >= 0; --d) {
    bool mergeable = true;
    for (size_t k = 0; k < N; ++k) mergeable &= st[k][d] == st[k][d + 1] * s[d + 1];
    if (!mergeable) continue;
    s[d] *= s[d + 1];
    s.erase(s.begin() + d + 1);
    for (size_t k = 0; k < N; ++k) {
      st[k][d] = st[k][d + 1];
      st[k].erase(st[k].begin() + d + 1);
    }
  }
  const int64_t nd = static_cast<int64_t>(s.size());
  const int64_t inner = s.back();
  int64_t outer = 1;
  for (int64_t d = 0; d + 1 < nd; ++d) outer *= s[d];
  std::array<int64_t, N> inner_stride;
  for (size_t k = 0; k < N; ++k) inner_stride[k] = st[k].back();

  auto run_rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::array<char*, N> p = base;
      int64_t rem = r;
      for (int64_t d = nd - 2; d >= 0; --d) {
        const int64_t i = rem % s[d];
        rem /= s[d];
        for (size_t k = 0; k < N; ++k) p[k] += i * st[k][d] * static_cast<int64_t>(esize[k]);
      }
      row(p, inner_stride, inner, r);
    }
  };
  if (outer == 1) {
    // One long row: split it.
    parallel_for(0, inner, kElementwiseGrain, [&](int64_t b, int64_t e) {
      std::array<char*, N> p = base;
      for (size_t k = 0; k < N; ++k) p[k] += b * inner_stride[k] * static_cast<int64_t>(esize[k]);
      row(p, inner_stride, e - b, 0);
    });
  } else {
    const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(inner, 1));
    parallel_for(0, outer, grain, run_rows);
  }
}

// 16-bit floats on dense data go through f32 in blocks: vectorised conversion in, the functor
// on plain float arrays (which the compiler vectorises), vectorised rounding out.
inline constexpr int64_t kConvertBlock = 256;

template <class T>
inline constexpr bool kIsReduced = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <class T>
inline compute_t<T> load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return static_cast<compute_t<T>>(v);
}

// out = f(x), same dtype as x (or `out_dtype` for predicates), contiguous.
template <class F>
Tensor unary_op(const Tensor& x, const char* name, F f) {
  Tensor out = empty_like(x);
  TANDEM_DISPATCH_FLOATING(x.dtype(), name, [&] {
    using T = scalar_t;
    if (x.is_non_overlapping_and_dense()) {  // out has x's strides: walk both linearly
      const T* in = static_cast<const T*>(x.data_ptr());
      T* o = static_cast<T*>(out.data_ptr());
      parallel_for(0, x.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
        if constexpr (kIsReduced<T>) {
          float bi[kConvertBlock], bo[kConvertBlock];
          for (int64_t s = b; s < e; s += kConvertBlock) {
            const int64_t n = std::min(kConvertBlock, e - s);
            convert(in + s, x.dtype(), bi, kFloat32, n);
            for (int64_t i = 0; i < n; ++i) bo[i] = f(bi[i]);
            convert(bo, kFloat32, o + s, x.dtype(), n);
          }
        } else {
          for (int64_t i = b; i < e; ++i) o[i] = static_cast<T>(f(static_cast<compute_t<T>>(in[i])));
        }
      });
      return;
    }
    for_each_row<2>(x.shape(), {out.strides(), x.strides()},
                    {static_cast<char*>(out.data_ptr()), static_cast<char*>(x.data_ptr())}, {sizeof(T), sizeof(T)},
                    [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n, int64_t) {
                      T* o = reinterpret_cast<T*>(p[0]);
                      const T* in = reinterpret_cast<const T*>(p[1]);
                      for (int64_t i = 0; i < n; ++i) o[i * st[0]] = static_cast<T>(f(static_cast<compute_t<T>>(in[i * st[1]])));
                    });
  });
  return out;
}

// out = f(a, b) with broadcasting; a and b must share a floating dtype (callers promote).
template <class F>
Tensor binary_op(const Tensor& a, const Tensor& b, const char* name, F f) {
  TANDEM_CHECK(a.dtype() == b.dtype(), DTypeError, "{}: dtypes differ ({} vs {})", name, dtype_name(a.dtype()),
               dtype_name(b.dtype()));
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const bool same_dense = a.shape() == b.shape() && a.strides() == b.strides() && a.is_non_overlapping_and_dense();
  Tensor out = same_dense ? empty_like(a) : empty(shape, a.dtype());
  TANDEM_DISPATCH_FLOATING(a.dtype(), name, [&] {
    using T = scalar_t;
    if (same_dense || (a.is_contiguous() && b.is_contiguous() && a.shape() == b.shape())) {
      const T* pa = static_cast<const T*>(a.data_ptr());
      const T* pb = static_cast<const T*>(b.data_ptr());
      T* o = static_cast<T*>(out.data_ptr());
      parallel_for(0, out.numel(), kElementwiseGrain, [&](int64_t s, int64_t e) {
        if constexpr (kIsReduced<T>) {
          float ba[kConvertBlock], bb[kConvertBlock], bo[kConvertBlock];
          for (int64_t k = s; k < e; k += kConvertBlock) {
            const int64_t n = std::min(kConvertBlock, e - k);
            convert(pa + k, a.dtype(), ba, kFloat32, n);
            convert(pb + k, a.dtype(), bb, kFloat32, n);
            for (int64_t i = 0; i < n; ++i) bo[i] = f(ba[i], bb[i]);
            convert(bo, kFloat32, o + k, a.dtype(), n);
          }
        } else {
          for (int64_t i = s; i < e; ++i)
            o[i] = static_cast<T>(f(static_cast<compute_t<T>>(pa[i]), static_cast<compute_t<T>>(pb[i])));
        }
      });
      return;
    }
    for_each_row<3>(shape, {out.strides(), broadcast_strides(a, shape, name), broadcast_strides(b, shape, name)},
                    {static_cast<char*>(out.data_ptr()), static_cast<char*>(a.data_ptr()),
                     static_cast<char*>(b.data_ptr())},
                    {sizeof(T), sizeof(T), sizeof(T)},
                    [&](std::array<char*, 3> p, std::array<int64_t, 3> st, int64_t n, int64_t) {
                      T* o = reinterpret_cast<T*>(p[0]);
                      const T* pa = reinterpret_cast<const T*>(p[1]);
                      const T* pb = reinterpret_cast<const T*>(p[2]);
                      if (st[0] == 1 && st[1] == 1 && st[2] == 0) {
                        const compute_t<T> bv = static_cast<compute_t<T>>(pb[0]);
                        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f(static_cast<compute_t<T>>(pa[i]), bv));
                        return;
                      }
                      for (int64_t i = 0; i < n; ++i)
                        o[i * st[0]] = static_cast<T>(
                            f(static_cast<compute_t<T>>(pa[i * st[1]]), static_cast<compute_t<T>>(pb[i * st[2]])));
                    });
  });
  return out;
}

// out = f(a, b, c) with broadcasting of all three, same floating dtype.
template <class F>
Tensor ternary_op(const Tensor& a, const Tensor& b, const Tensor& c, const char* name, F f) {
  TANDEM_CHECK(a.dtype() == b.dtype() && b.dtype() == c.dtype(), DTypeError, "{}: dtypes differ ({}, {}, {})", name,
               dtype_name(a.dtype()), dtype_name(b.dtype()), dtype_name(c.dtype()));
  const Shape shape = broadcast_shapes(broadcast_shapes(a.shape(), b.shape(), name), c.shape(), name);
  Tensor out = empty(shape, a.dtype());
  TANDEM_DISPATCH_FLOATING(a.dtype(), name, [&] {
    using T = scalar_t;
    for_each_row<4>(shape,
                    {out.strides(), broadcast_strides(a, shape, name), broadcast_strides(b, shape, name),
                     broadcast_strides(c, shape, name)},
                    {static_cast<char*>(out.data_ptr()), static_cast<char*>(a.data_ptr()),
                     static_cast<char*>(b.data_ptr()), static_cast<char*>(c.data_ptr())},
                    {sizeof(T), sizeof(T), sizeof(T), sizeof(T)},
                    [&](std::array<char*, 4> p, std::array<int64_t, 4> st, int64_t n, int64_t) {
                      T* o = reinterpret_cast<T*>(p[0]);
                      const T* pa = reinterpret_cast<const T*>(p[1]);
                      const T* pb = reinterpret_cast<const T*>(p[2]);
                      const T* pc = reinterpret_cast<const T*>(p[3]);
                      for (int64_t i = 0; i < n; ++i)
                        o[i * st[0]] = static_cast<T>(f(static_cast<compute_t<T>>(pa[i * st[1]]),
                                                        static_cast<compute_t<T>>(pb[i * st[2]]),
                                                        static_cast<compute_t<T>>(pc[i * st[3]])));
                    });
  });
  return out;
}

// Copies src (any strides, any dtype, broadcast to dst's shape) into dst (any strides).
void copy_into(Tensor& dst, const Tensor& src);

}  // namespace tandem::kernels
