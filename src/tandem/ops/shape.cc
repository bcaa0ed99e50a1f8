// Tensor's view methods (declared in core/tensor.h) and the shape ops of shape.h, each with its
// backward beside it.
#include "tandem/ops/shape.h"

#include <algorithm>
#include <numeric>

#include "tandem/amp/policy.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/core/convert.h"
#include "tandem/kernels/cpu/loops.h"
#include "tandem/ops/elementwise.h"

namespace tandem {

using autograd::record;

namespace {

// Strides for viewing a tensor of (shape, strides) as `target`, or empty when impossible
// without a copy (PyTorch's computeStride).
Shape view_strides(const Shape& shape, const Shape& strides, const Shape& target) {
  if (shape_numel(shape) == 0 || shape.empty()) return contiguous_strides(target);
  Shape out(target.size());
  int64_t view_d = static_cast<int64_t>(target.size()) - 1;
  int64_t chunk_base_stride = strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[d];
    if (d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || target[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= target[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return {};
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return {};
  return out;
}

Shape infer_shape(Shape target, int64_t numel, const Shape& from, const char* op) {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] == -1) {
      TANDEM_CHECK(infer < 0, ShapeError, "{}: only one dimension can be inferred (-1) in {}", op, shape_str(target));
      infer = static_cast<int64_t>(i);
    } else {
      TANDEM_CHECK(target[i] >= 0, ShapeError, "{}: invalid size {} in shape {}", op, target[i], shape_str(target));
      known *= target[i];
    }
  }
  if (infer >= 0) {
    TANDEM_CHECK(known != 0 && numel % known == 0, ShapeError, "{}: shape {} is invalid for input of shape {} ({} elements)",
                 op, shape_str(target), shape_str(from), numel);
    target[infer] = numel / known;
  }
  TANDEM_CHECK(shape_numel(target) == numel, ShapeError, "{}: shape {} is invalid for input of shape {} ({} elements)", op,
               shape_str(target), shape_str(from), numel);
  return target;
}

Tensor view_of(const Tensor& self, const char* name, Shape shape, Shape strides, int64_t offset) {
  Tensor out = make_view(self, std::move(shape), std::move(strides), offset);
  return out;
}

}  // namespace

Tensor Tensor::view(Shape target) const {
  const Shape shape_in = shape();
  target = infer_shape(std::move(target), numel(), shape_in, "view");
  Shape st = view_strides(shape_in, strides(), target);
  TANDEM_CHECK(!st.empty() || target.empty(), ShapeError,
               "view: size {} is not compatible with input of shape {} and strides {}; use reshape() instead",
               shape_str(target), shape_str(shape_in), shape_str(strides()));
  Tensor out = view_of(*this, "view", target, st, offset());
  record("ViewBackward", {*this}, {out}, [shape_in](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].reshape(shape_in)};
  });
  return out;
}

Tensor Tensor::reshape(Shape target) const {
  target = infer_shape(std::move(target), numel(), shape(), "reshape");
  Shape st = view_strides(shape(), strides(), target);
  if (!st.empty() || target.empty()) return view(target);
  return contiguous().view(target);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  start_dim = wrap_dim(start_dim, dim(), "flatten");
  end_dim = wrap_dim(end_dim, dim(), "flatten");
  TANDEM_CHECK(start_dim <= end_dim, ShapeError, "flatten: start_dim {} is after end_dim {}", start_dim, end_dim);
  Shape target;
  int64_t merged = 1;
  for (int64_t d = 0; d < dim(); ++d) {
    if (d < start_dim || d > end_dim) {
      target.push_back(size(d));
    } else {
      merged *= size(d);
      if (d == end_dim) target.push_back(merged);
    }
  }
  return reshape(target);
}

Tensor Tensor::permute(Shape dims) const {
  TANDEM_CHECK(static_cast<int64_t>(dims.size()) == dim(), ShapeError, "permute: {} dims given for a {}-d tensor",
               dims.size(), dim());
  Shape shp(dims.size()), st(dims.size()), inverse(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    TANDEM_CHECK(!seen[d], ShapeError, "permute: dimension {} repeated in {}", d, shape_str(dims));
    seen[d] = true;
    shp[i] = shape()[d];
    st[i] = strides()[d];
    inverse[d] = static_cast<int64_t>(i);
  }
  Tensor out = view_of(*this, "permute", shp, st, offset());
  record("PermuteBackward", {*this}, {out}, [inverse](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].permute(inverse)};
  });
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (dim() == 0) {
    wrap_dim(d0, 0, "transpose");  // only -1 and 0 name the dimension of a 0-d tensor
    wrap_dim(d1, 0, "transpose");
    return *this;
  }
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Shape perm(static_cast<size_t>(dim()));
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[d0], perm[d1]);
  return permute(perm);
}

Tensor Tensor::t() const {
  TANDEM_CHECK(dim() <= 2, ShapeError, "t(): expected a tensor with <= 2 dims, got shape {}", shape_str(shape()));
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d, dim(), "slice");
  TANDEM_CHECK(step > 0, ValueError, "slice: step must be positive, got {}", step);
  const int64_t n = size(d);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shp = shape(), st = strides();
  shp[d] = (end - start + step - 1) / step;
  st[d] *= step;
  Tensor out = view_of(*this, "slice", shp, st, offset() + start * strides()[d]);
  const Shape in_shape = shape();
  const DType dt = dtype();
  record("SliceBackward", {*this}, {out}, [in_shape, dt, d, start, end, step](const std::vector<Tensor>& g) {
    Tensor gi = zeros(in_shape, g[0].dtype());
    Tensor region = gi.slice(d, start, end, step);
    region.copy_(g[0]);
    (void)dt;
    return std::vector<Tensor>{gi};
  });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim(), "narrow");
  TANDEM_CHECK(start >= 0 && length >= 0 && start + length <= size(d), ShapeError,
               "narrow: start {} + length {} exceeds dimension {} of size {}", start, length, d, size(d));
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  const int64_t n = size(d);
  TANDEM_CHECK(index >= -n && index < n, ShapeError, "select: index {} out of range for dimension {} of size {}", index,
               d, n);
  if (index < 0) index += n;
  return slice(d, index, index + 1).squeeze(d);
}

Tensor Tensor::expand(Shape target) const {
  TANDEM_CHECK(static_cast<int64_t>(target.size()) >= dim(), ShapeError,
               "expand: the target {} has fewer dims than the tensor {}", shape_str(target), shape_str(shape()));
  const size_t lead = target.size() - static_cast<size_t>(dim());
  Shape st(target.size(), 0);
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      TANDEM_CHECK(target[i] >= 0, ShapeError, "expand: size {} is not allowed in a new leading dimension ({})",
                   target[i], shape_str(target));
      continue;
    }
    const int64_t s = shape()[i - lead];
    if (target[i] == -1) target[i] = s;
    TANDEM_CHECK(target[i] >= 0, ShapeError, "expand: the size {} of dimension {} is negative (only -1 keeps a size)",
                 target[i], i);
    TANDEM_CHECK(s == target[i] || s == 1, ShapeError,
                 "expand: the size {} of dimension {} must match {} or be 1 (tensor {} to {})", s, i - lead, target[i],
                 shape_str(shape()), shape_str(target));
    st[i] = s == target[i] ? strides()[i - lead] : 0;
  }
  Tensor out = view_of(*this, "expand", target, st, offset());
  const Shape in_shape = shape();
  record("ExpandBackward", {*this}, {out}, [in_shape](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{ops::sum_to(g[0], in_shape)};
  });
  return out;
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "squeeze");
  if (dim() == 0 || size(d) != 1) return *this;
  Shape shp = shape();
  shp.erase(shp.begin() + d);
  return view(shp);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape shp = shape();
  shp.insert(shp.begin() + d, 1);
  return view(shp);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype());
  kernels::copy_into(out, *this);
  record("CloneBackward", {*this}, {out}, [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  Tensor out = empty(shape(), target);
  kernels::copy_into(out, *this);
  if (is_floating(target)) {
    const DType src = dtype();
    // A leaf's (a parameter's) gradient is read again only by the optimizer, after the rest of
    // backward: a large one is widened with streaming stores (convert_for_later).
    const bool to_leaf = is_leaf();
    const bool recorded = record("ToCopyBackward", {*this}, {out}, [src, to_leaf](const std::vector<Tensor>& g) {
      // Converted straight into the source's gradient destination when one is offered (the f32
      // parameter's DDP bucket slot under autocast).
      Tensor d = autograd::take_output_destination(0, g[0].shape(), src);
      // Already widened: the node before took the rounded offer (node.h) and wrote into d.
      if (g[0].dtype() == src && (!d.defined() || g[0].data_ptr() == d.data_ptr())) return std::vector<Tensor>{g[0]};
      if (to_leaf && g[0].is_contiguous()) {
        Tensor w = d.defined() ? d : empty(g[0].shape(), src);  // a destination is contiguous (node.h)
        convert_for_later(g[0].data_ptr(), g[0].dtype(), w.data_ptr(), src, g[0].numel());
        return std::vector<Tensor>{w};
      }
      if (d.defined()) {
        kernels::copy_into(d, g[0]);
        return std::vector<Tensor>{d};
      }
      return std::vector<Tensor>{g[0].to(src)};
    });
    // Narrowing f32 -> bf16: the backward widens exactly, so the producer of the bf16 gradient
    // may write it widened into the f32 source's destination (rounded destinations, node.h).
    if (recorded && src == kFloat32 && target == kBFloat16) {
      out.impl().autograd->grad_fn->set_widening_cast_from(kBFloat16);
    }
  }
  return out;
}

namespace ops {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::cat, [](const auto&... args) { return cat(args...); }, tensors, dim);
  TANDEM_CHECK(!tensors.empty(), ValueError, "cat: expected a non-empty list of tensors");
  const Tensor& first = tensors[0];
  dim = wrap_dim(dim, first.dim(), "cat");
  DType dt = first.dtype();
  for (const Tensor& t : tensors) dt = promote_types(dt, t.dtype());
  Shape out_shape = first.shape();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    TANDEM_CHECK(t.dim() == first.dim(), ShapeError, "cat: tensor {} has {} dims, tensor 0 has {}", i, t.dim(),
                 first.dim());
    for (int64_t d = 0; d < first.dim(); ++d) {
      TANDEM_CHECK(d == dim || t.size(d) == first.size(d), ShapeError,
                   "cat: sizes must match except in dimension {}; tensor {} has shape {}, tensor 0 has {}", dim, i,
                   shape_str(t.shape()), shape_str(first.shape()));
    }
    total += t.size(dim);
  }
  out_shape[dim] = total;
  Tensor out = empty(out_shape, dt);
  std::vector<int64_t> sizes;
  int64_t at = 0;
  for (const Tensor& t : tensors) {
    Tensor region = out.detach().narrow(dim, at, t.size(dim));
    kernels::copy_into(region, t);
    at += t.size(dim);
    sizes.push_back(t.size(dim));
  }
  std::vector<DType> dtypes;
  for (const Tensor& t : tensors) dtypes.push_back(t.dtype());
  autograd::record("CatBackward", tensors, {out}, [sizes, dim, dtypes](const std::vector<Tensor>& g) {
    std::vector<Tensor> grads;
    int64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      grads.push_back(g[0].narrow(dim, at, sizes[i]).to(dtypes[i]));
      at += sizes[i];
    }
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  if (amp::autocast_active()) return amp::autocast_call(amp::Op::stack, [](const auto&... args) { return stack(args...); }, tensors, dim);
  TANDEM_CHECK(!tensors.empty(), ValueError, "stack: expected a non-empty list of tensors");
  dim = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TANDEM_CHECK(tensors[i].shape() == tensors[0].shape(), ShapeError,
                 "stack: all tensors must have the same shape; tensor {} has {}, tensor 0 has {}", i,
                 shape_str(tensors[i].shape()), shape_str(tensors[0].shape()));
    parts.push_back(tensors[i].unsqueeze(dim));
  }
  return cat(parts, dim);
}

namespace {

// The view of shape in_shape that the pieces g tile along dim, when they are views of one
// storage with one set of strides at consecutive offsets and that view is dense; else undefined.
Tensor joined_view(const std::vector<Tensor>& g, const Shape& in_shape, int64_t dim, const std::vector<int64_t>& sizes) {
  if (g.size() != sizes.size() || g.empty() || !g[0].defined()) return Tensor();
  const Tensor& g0 = g[0];
  if (g0.dim() != static_cast<int64_t>(in_shape.size())) return Tensor();
  int64_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const Tensor& gi = g[i];
    if (!gi.defined() || gi.storage() != g0.storage() || gi.dtype() != g0.dtype() || gi.strides() != g0.strides() ||
        gi.size(dim) != sizes[i] || gi.offset() != g0.offset() + at * g0.stride(dim)) {
      return Tensor();
    }
    at += sizes[i];
  }
  Tensor whole = make_view(g0, in_shape, g0.strides(), g0.offset());
  return whole.is_non_overlapping_and_dense() ? whole : Tensor();
}

}  // namespace

std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    TANDEM_CHECK(s >= 0, ValueError, "split: negative size {}", s);
    total += s;
  }
  TANDEM_CHECK(total == x.size(dim), ShapeError, "split: sizes sum to {} but dimension {} has size {}", total, dim,
               x.size(dim));
  std::vector<Tensor> out;
  int64_t at = 0;
  if (sizes.size() < 2 || !autograd::any_requires_grad({&x})) {
    for (int64_t s : sizes) {
      out.push_back(x.narrow(dim, at, s));
      at += s;
    }
    return out;
  }
  // One backward node for all pieces (as PyTorch's SplitBackward): the input gradient is built
  // once, each piece's gradient copied into its slice, zeros only where a piece got none —
  // instead of one zero-filled full-size gradient per piece, summed afterwards.
  for (int64_t s : sizes) {
    Shape shp = x.shape();
    shp[dim] = s;
    out.push_back(view_of(x, "split", shp, x.strides(), x.offset() + at * x.stride(dim)));
    at += s;
  }
  record("SplitBackward", {x}, out, [in_shape = x.shape(), dim, sizes](const std::vector<Tensor>& g) {
    // Pieces' gradients that are adjacent views of one buffer (attention's packed q, k, v
    // gradients) already form the input gradient: it is passed on as a view, not copied.
    if (Tensor whole = joined_view(g, in_shape, dim, sizes); whole.defined()) return std::vector<Tensor>{whole};
    DType dt = kFloat32;
    for (const Tensor& gi : g)
      if (gi.defined()) dt = gi.dtype();
    Tensor gx = empty(in_shape, dt);
    int64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor region = gx.narrow(dim, at, sizes[i]);
      if (i < g.size() && g[i].defined()) region.copy_(g[i]);
      else region.zero_();
      at += sizes[i];
    }
    return std::vector<Tensor>{gx};
  });
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  TANDEM_CHECK(split_size > 0, ValueError, "split: split_size must be positive, got {}", split_size);
  dim = wrap_dim(dim, x.dim(), "split");
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < x.size(dim); at += split_size) sizes.push_back(std::min(split_size, x.size(dim) - at));
  if (sizes.empty()) sizes.push_back(0);
  return split_with_sizes(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  TANDEM_CHECK(chunks > 0, ValueError, "chunk: expected a positive number of chunks, got {}", chunks);
  dim = wrap_dim(dim, x.dim(), "chunk");
  const int64_t n = x.size(dim);
  return split(x, std::max<int64_t>(1, (n + chunks - 1) / chunks), dim);
}

namespace {

Tensor index_as_i64(const Tensor& index, const char* op) {
  TANDEM_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, DTypeError,
               "{}: expected int64 or int32 indices, got {}", op, dtype_name(index.dtype()));
  return index.to(kInt64).contiguous();
}

void check_indices(const int64_t* ix, int64_t n, int64_t limit, const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(ix[i] >= 0 && ix[i] < limit, ValueError, "{}: index {} at position {} is out of range [0, {})", op,
                 ix[i], i, limit);
  }
}

// gi.select(dim, ix[i]) += g.select(dim, i) for every i (duplicate indices add up).
Tensor index_add_rows(const Shape& in_shape, int64_t dim, const Tensor& ix, const Tensor& g, int64_t skip = -1) {
  Tensor gi = zeros(in_shape, g.dtype());
  const int64_t* p = ix.data_ptr<int64_t>();
  const Tensor gc = g.contiguous();
  if (dim == 0) {
    // Rows are contiguous blocks: add directly.
    const int64_t row = shape_numel(in_shape) / std::max<int64_t>(in_shape[0], 1);
    TANDEM_DISPATCH_FLOATING(g.dtype(), "index_select backward", [&] {
      auto* dst = static_cast<scalar_t*>(gi.data_ptr());
      const auto* src = static_cast<const scalar_t*>(gc.data_ptr());
      for (int64_t i = 0; i < ix.numel(); ++i) {
        if (p[i] == skip) continue;
        scalar_t* d = dst + p[i] * row;
        const scalar_t* s = src + i * row;
        for (int64_t j = 0; j < row; ++j)
          d[j] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(d[j]) + static_cast<compute_t<scalar_t>>(s[j]));
      }
    });
    return gi;
  }
  for (int64_t i = 0; i < ix.numel(); ++i) {
    if (p[i] == skip) continue;
    Tensor dst = gi.select(dim, p[i]);
    Tensor sum = ops::add(dst, gc.select(dim, i));
    dst.copy_(sum);
  }
  return gi;
}

}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, x.dim(), "index_select");
  TANDEM_CHECK(index.dim() <= 1, ShapeError, "index_select: expected a 1-d index, got shape {}", shape_str(index.shape()));
  const Tensor ix = index_as_i64(index, "index_select").reshape({-1});
  const int64_t n = ix.numel();
  check_indices(ix.data_ptr<int64_t>(), n, x.size(dim), "index_select");
  Shape out_shape = x.shape();
  out_shape[dim] = n;
  Tensor out = empty(out_shape, x.dtype());
  const int64_t* p = ix.data_ptr<int64_t>();
  if (dim == 0 && x.is_contiguous()) {
    const int64_t row = x.numel() / std::max<int64_t>(x.size(0), 1);
    const size_t bytes = static_cast<size_t>(row) * x.element_size();
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    parallel_for(0, n, std::max<int64_t>(1, 65536 / std::max<int64_t>(row, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) std::memcpy(dst + i * bytes, src + p[i] * bytes, bytes);
    });
  } else {
    for (int64_t i = 0; i < n; ++i) {
      Tensor dst = out.select(dim, i);
      kernels::copy_into(dst, x.detach().select(dim, p[i]));
    }
  }
  const Shape in_shape = x.shape();
  record("IndexSelectBackward", {x}, {out}, [in_shape, dim, ix](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{index_add_rows(in_shape, dim, ix, g[0])};
  }, {ix});
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding) {
  TANDEM_CHECK(weight.dim() == 2, ShapeError, "embedding: expected a 2-d weight (num_embeddings, dim), got {}",
               shape_str(weight.shape()));
  int64_t padding_idx = -1;  // none
  if (padding) {
    const int64_t n = weight.size(0);
    TANDEM_CHECK(*padding >= -n && *padding < n, ValueError,
                 "embedding: padding_idx {} must be within num_embeddings ({}): expected {} <= padding_idx < {}",
                 *padding, n, -n, n);
    padding_idx = *padding < 0 ? *padding + n : *padding;
  }
  const Tensor ix = index_as_i64(indices, "embedding").reshape({-1});
  check_indices(ix.data_ptr<int64_t>(), ix.numel(), weight.size(0), "embedding");
  Tensor rows;
  {
    autograd::AutoGradMode off(false);
    rows = index_select(weight, 0, ix);
  }
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  Tensor out = rows.view(out_shape);
  Tensor result = make_view(out, out.shape(), out.strides(), out.offset());
  const Shape in_shape = weight.shape();
  record("EmbeddingBackward", {weight}, {result}, [in_shape, ix, padding_idx](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{index_add_rows(in_shape, 0, ix, g[0].reshape({-1, in_shape[1]}), padding_idx)};
  }, {ix});
  return result;
}

}  // namespace ops
}  // namespace tandem
