#include "tandem/data/dataset.h"

#include <cstring>

namespace tandem::data {

Tensor& Batch::operator[](size_t i) {
  TANDEM_CHECK(i < fields.size(), ValueError, "Batch: field {} out of range for a batch of {} fields", i, fields.size());
  return fields[i];
}

const Tensor& Batch::operator[](size_t i) const {
  TANDEM_CHECK(i < fields.size(), ValueError, "Batch: field {} out of range for a batch of {} fields", i, fields.size());
  return fields[i];
}

void Batch::check_pair() const {
  TANDEM_CHECK(fields.size() == 2, ValueError,
               "Batch: structured binding `auto [x, y]` needs a batch of 2 fields, this one has {}; use batch[i]",
               fields.size());
}

namespace {

Shape tail(const Shape& s) { return Shape(s.begin() + 1, s.end()); }

// Copies `src` (any layout, same shape) into the contiguous block at `dst`.
void copy_into_block(void* dst, const Tensor& src) {
  if (src.is_contiguous()) {
    std::memcpy(dst, src.data_ptr(), src.nbytes());
    return;
  }
  Tensor view = from_blob(dst, src.shape(), src.dtype());
  view.copy_(src);
}

}  // namespace

Batch collate(const std::vector<Example>& examples) {
  TANDEM_CHECK(!examples.empty(), ValueError, "collate: expected at least one example, got none");
  const Example& first = examples[0];
  const int64_t n = static_cast<int64_t>(examples.size());
  for (size_t e = 1; e < examples.size(); ++e) {
    TANDEM_CHECK(examples[e].size() == first.size(), ValueError,
                 "collate: example {} has {} fields, example 0 has {}", e, examples[e].size(), first.size());
  }
  Batch batch;
  batch.fields.reserve(first.size());
  for (size_t f = 0; f < first.size(); ++f) {
    TANDEM_CHECK(first[f].defined(), ValueError, "collate: field {} of example 0 is an undefined tensor", f);
    Shape shape = first[f].shape();
    const DType dtype = first[f].dtype();
    for (size_t e = 1; e < examples.size(); ++e) {
      const Tensor& t = examples[e][f];
      TANDEM_CHECK(t.defined(), ValueError, "collate: field {} of example {} is an undefined tensor", f, e);
      TANDEM_CHECK(t.shape() == shape, ShapeError, "collate: field {} of example {} has shape {}, example 0 has {}", f,
                   e, shape_str(t.shape()), shape_str(shape));
      TANDEM_CHECK(t.dtype() == dtype, DTypeError, "collate: field {} of example {} is {}, example 0 is {}", f, e,
                   dtype_name(t.dtype()), dtype_name(dtype));
    }
    Shape out_shape = {n};
    out_shape.insert(out_shape.end(), shape.begin(), shape.end());
    Tensor out = empty(out_shape, dtype);
    const size_t row_bytes = first[f].nbytes();
    auto* dst = static_cast<unsigned char*>(out.data_ptr());
    for (int64_t e = 0; e < n; ++e) copy_into_block(dst + static_cast<size_t>(e) * row_bytes, examples[e][f].detach());
    batch.fields.push_back(std::move(out));
  }
  return batch;
}

void Dataset::check_index(int64_t i, const char* name) const {
  const int64_t n = size();
  TANDEM_CHECK(i >= 0 && i < n, ValueError, "{}: index {} out of range for a dataset of {} examples", name, i, n);
}

Batch Dataset::get_batch(std::span<const int64_t> indices) const {
  std::vector<Example> examples;
  examples.reserve(indices.size());
  for (int64_t i : indices) examples.push_back(get(i));
  return collate(examples);
}

Tensor row_view(const Tensor& t, int64_t i) {
  return make_view(t, tail(t.shape()), tail(t.strides()), t.offset() + i * t.stride(0));
}

Tensor gather_rows(const Tensor& t, std::span<const int64_t> indices) {
  Shape out_shape = t.shape();
  out_shape[0] = static_cast<int64_t>(indices.size());
  Tensor out = empty(out_shape, t.dtype());
  const size_t row_bytes = static_cast<size_t>(shape_numel(tail(t.shape()))) * t.element_size();
  auto* dst = static_cast<unsigned char*>(out.data_ptr());
  // A row of a tensor that is contiguous from dim 1 on is one block of row_bytes.
  const bool rows_contiguous = t.dim() == 1 || make_view(t, tail(t.shape()), tail(t.strides()), t.offset()).is_contiguous();
  const auto* base = static_cast<const unsigned char*>(t.storage()->data());
  for (size_t k = 0; k < indices.size(); ++k) {
    if (rows_contiguous) {
      const int64_t first = t.offset() + indices[k] * t.stride(0);
      std::memcpy(dst + k * row_bytes, base + static_cast<size_t>(first) * t.element_size(), row_bytes);
    } else {
      copy_into_block(dst + k * row_bytes, row_view(t, indices[k]));
    }
  }
  return out;
}

TensorDataset::TensorDataset(std::vector<Tensor> tensors) : tensors_(std::move(tensors)) {
  TANDEM_CHECK(!tensors_.empty(), ValueError, "TensorDataset: expected at least one tensor, got none");
  std::string sizes;
  bool agree = true;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    TANDEM_CHECK(tensors_[k].defined(), ValueError, "TensorDataset: tensor {} is undefined", k);
    TANDEM_CHECK(tensors_[k].dim() >= 1, ValueError,
                 "TensorDataset: tensor {} is 0-dimensional; every tensor needs a dim 0 to index examples along", k);
    tensors_[k] = tensors_[k].detach();
    sizes += fmt::format("{}tensor {}: {}", k ? ", " : "", k, tensors_[k].size(0));
    agree = agree && tensors_[k].size(0) == tensors_[0].size(0);
  }
  TANDEM_CHECK(agree, ValueError, "TensorDataset: size mismatch between tensors along dim 0 ({})", sizes);
  size_ = tensors_[0].size(0);
}

Example TensorDataset::get(int64_t i) const {
  check_index(i, "TensorDataset");
  Example ex;
  ex.reserve(tensors_.size());
  for (const Tensor& t : tensors_) ex.push_back(row_view(t, i));
  return ex;
}

Batch TensorDataset::get_batch(std::span<const int64_t> indices) const {
  for (int64_t i : indices) check_index(i, "TensorDataset");
  Batch batch;
  for (const Tensor& t : tensors_) batch.fields.push_back(gather_rows(t, indices));
  return batch;
}

}  // namespace tandem::data
