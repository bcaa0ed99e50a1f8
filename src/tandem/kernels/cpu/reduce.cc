#include "tandem/kernels/cpu/reduce.h"

#include <algorithm>
#include <cmath>

#include "tandem/core/parallel.h"
#include "tandem/kernels/cpu/row_math.h"

namespace tandem::kernels {

std::vector<int64_t> reduction_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  TANDEM_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), ShapeError, "{}: dimension repeated in the list",
               op);
  if (ndim == 0) out.clear();
  return out;
}

Shape reduced_shape(const Shape& shape, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    const bool reduced = std::binary_search(dims.begin(), dims.end(), d);
    if (!reduced) out.push_back(shape[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

namespace {

// Permutes x to (kept..., reduced...) and makes it contiguous: rows of length R, O rows.
Tensor kept_then_reduced(const Tensor& x, const std::vector<int64_t>& dims, int64_t& O, int64_t& R) {
  Shape perm;
  O = 1;
  R = 1;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!std::binary_search(dims.begin(), dims.end(), d)) {
      perm.push_back(d);
      O *= x.size(d);
    }
  }
  for (int64_t d : dims) {
    perm.push_back(d);
    R *= x.size(d);
  }
  return x.detach().permute(perm).contiguous();
}

// acc[j] += row[j] in Acc; f32 rows into f64 sums through the vectorised row kernel (the same sums).
template <class Acc, class T>
void add_row(Acc* acc, const T* row, int64_t n) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, double>) {
    add_into_f64_f32(acc, row, n);
  } else {
    for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<Acc>(static_cast<compute_t<T>>(row[j]));
  }
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, DType out_dtype) {
  Tensor out = empty(reduced_shape(x.shape(), dims, keepdim), out_dtype);
  TANDEM_DISPATCH_FLOATING(x.dtype(), "sum", [&] {
    using T = scalar_t;
    using Acc = std::conditional_t<std::is_same_v<compute_t<T>, float> && !std::is_same_v<T, float>, float, double>;
    // Leading dims reduced on a contiguous tensor (a bias gradient): add rows into an accumulator.
    bool leading = x.is_contiguous() && !dims.empty();
    for (size_t i = 0; i < dims.size(); ++i) leading &= dims[i] == static_cast<int64_t>(i);
    if (leading) {
      int64_t R = 1, O = 1;
      for (int64_t d : dims) R *= x.size(d);
      // The kept dims' product (not numel / R: with a reduced dim of size 0 that was 0, and the
      // output was left unwritten).
      for (int64_t d = static_cast<int64_t>(dims.size()); d < x.dim(); ++d) O *= x.size(d);
      const T* p = static_cast<const T*>(x.data_ptr());
      std::vector<Acc> acc(static_cast<size_t>(O), Acc(0));
      // f32 sums of 16-bit values are folded into f64 every kFoldEvery rows (an f32 sum that
      // reached 2^24 would stop growing by values near 1).
      std::vector<double> total(std::is_same_v<Acc, float> ? static_cast<size_t>(O) : 0, 0.0);
      for (int64_t r = 0; r < R; ++r) {
        const T* row = p + r * O;
        add_row(acc.data(), row, O);
        if (std::is_same_v<Acc, float> && ((r + 1) % kFoldEvery == 0 || r + 1 == R)) {
          for (int64_t j = 0; j < O; ++j) total[j] += static_cast<double>(acc[j]);
          std::fill(acc.begin(), acc.end(), Acc(0));
        }
      }
      TANDEM_DISPATCH_FLOATING(out_dtype, "sum", [&] {
        auto* o = static_cast<scalar_t*>(out.data_ptr());
        for (int64_t j = 0; j < O; ++j) {
          const double v = std::is_same_v<Acc, float> ? total[j] : static_cast<double>(acc[j]);
          o[j] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(v));
        }
      });
      return;
    }
    int64_t O, R;
    const Tensor xc = kept_then_reduced(x, dims, O, R);
    const T* p = static_cast<const T*>(xc.data_ptr());
    TANDEM_DISPATCH_FLOATING(out_dtype, "sum", [&] {
      auto* o = static_cast<scalar_t*>(out.data_ptr());
      parallel_for(0, O, std::max<int64_t>(1, 32768 / std::max<int64_t>(R, 1)), [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const T* row = p + i * R;
          // Four partial sums: independent chains vectorise and lose less to rounding. In f32
          // (16-bit inputs) each block of kFoldEvery elements is then added into an f64 total.
          double total = 0;
          for (int64_t j0 = 0; j0 < R; j0 += kFoldEvery) {
            const int64_t end = std::min(R, j0 + kFoldEvery);
            Acc s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int64_t j = j0;
            for (; j + 4 <= end; j += 4) {
              s0 += static_cast<Acc>(static_cast<compute_t<T>>(row[j]));
              s1 += static_cast<Acc>(static_cast<compute_t<T>>(row[j + 1]));
              s2 += static_cast<Acc>(static_cast<compute_t<T>>(row[j + 2]));
              s3 += static_cast<Acc>(static_cast<compute_t<T>>(row[j + 3]));
            }
            for (; j < end; ++j) s0 += static_cast<Acc>(static_cast<compute_t<T>>(row[j]));
            total += static_cast<double>((s0 + s1) + (s2 + s3));
          }
          o[i] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(total));
        }
      });
    });
  });
  return out;
}

std::pair<Tensor, Tensor> max_dim(const Tensor& x, int64_t dim, bool keepdim, bool minimum) {
  const std::vector<int64_t> dims{dim};
  const char* op = minimum ? "min" : "max";
  TANDEM_CHECK(x.dim() == 0 || x.size(dim) > 0, ShapeError, "{}: cannot reduce over an empty dimension {} of shape {}",
               op, dim, shape_str(x.shape()));
  const Shape oshape = reduced_shape(x.shape(), x.dim() == 0 ? std::vector<int64_t>{} : dims, keepdim);
  Tensor values = empty(oshape, x.dtype());
  Tensor indices = empty(oshape, kInt64);
  int64_t O, R;
  const Tensor xc = kept_then_reduced(x, x.dim() == 0 ? std::vector<int64_t>{} : dims, O, R);
  TANDEM_DISPATCH_ALL(x.dtype(), "max", [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    const T* p = static_cast<const T*>(xc.data_ptr());
    T* v = static_cast<T*>(values.data_ptr());
    int64_t* ix = indices.data_ptr<int64_t>();
    // The first extreme element; a NaN wins (and the first NaN stops the search), as PyTorch's.
    const auto better = [minimum](C cur, C best) { return minimum ? cur < best : cur > best; };
    for (int64_t i = 0; i < O; ++i) {
      const T* row = p + i * R;
      int64_t best = 0;
      C bv = static_cast<C>(row[0]);
      for (int64_t j = 1; j < R; ++j) {
        const C cur = static_cast<C>(row[j]);
        if constexpr (std::is_floating_point_v<C>) {
          if (std::isnan(bv)) break;
          if (std::isnan(cur) || better(cur, bv)) {
            bv = cur;
            best = j;
          }
        } else if (better(cur, bv)) {
          bv = cur;
          best = j;
        }
      }
      v[i] = row[best];
      ix[i] = best;
    }
  });
  return {values, indices};
}

}  // namespace tandem::kernels
