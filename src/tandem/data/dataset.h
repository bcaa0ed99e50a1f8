// Datasets (torch.utils.data.Dataset): a fixed number of examples, each a short list of tensors
// (e.g. {input, target}), and the collate step that stacks examples into a batch.
// Invariant: a Dataset is immutable after construction, so get() may run on many threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <tuple>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem::data {

// One example: its fields in a fixed order, usually {input, target}.
using Example = std::vector<Tensor>;

// A batch: field j is the examples' field j stacked along a new dim 0. Tensors are shared
// (copying a Batch is shallow, like copying a Tensor). Two-field batches unpack with structured
// bindings, `auto& [x, y] = batch` (binding throws ValueError when the batch has another number
// of fields); any batch indexes with operator[].
struct Batch {
  std::vector<Tensor> fields;

  Batch() = default;
  Batch(std::vector<Tensor> f) : fields(std::move(f)) {}  // NOLINT: implicit on purpose
  Batch(std::initializer_list<Tensor> f) : fields(f) {}

  size_t size() const { return fields.size(); }
  // Field i; throws ValueError when i >= size().
  Tensor& operator[](size_t i);
  const Tensor& operator[](size_t i) const;
  auto begin() { return fields.begin(); }
  auto end() { return fields.end(); }
  auto begin() const { return fields.begin(); }
  auto end() const { return fields.end(); }

  // Structured binding support (two fields: input and target).
  template <size_t I> Tensor& get() { check_pair(); return fields[I]; }
  template <size_t I> const Tensor& get() const { check_pair(); return fields[I]; }

 private:
  void check_pair() const;
};

// Stacks each field of `examples` along a new dim 0 (torch's default_collate for tensors):
// field j of the result has shape [examples.size(), *shape of field j] and the field's dtype
// (integer targets stay int64). Contiguous fields are copied with memcpy, others with copy_.
// Throws ValueError when `examples` is empty or the examples have different numbers of fields,
// ShapeError / DTypeError naming the example and field whose shape or dtype differs from example 0's.
// The result has no autograd history. Thread-safe.
Batch collate(const std::vector<Example>& examples);

// Abstract dataset. Subclasses implement size() and get(); they may override get_batch() with a
// faster gather. Thread safety: get() and get_batch() are const and must be safe to call from
// several threads at once (DataLoader workers do); nothing in the base class mutates.
class Dataset {
 public:
  virtual ~Dataset() = default;
  // Number of examples (len(dataset)).
  virtual int64_t size() const = 0;
  // Example i, 0 <= i < size(); throws ValueError naming i and size() otherwise.
  virtual Example get(int64_t i) const = 0;
  // The batch of the examples at `indices`, in that order. Default: collate(get(i) for i).
  // Throws what get() or collate() throw.
  virtual Batch get_batch(std::span<const int64_t> indices) const;

 protected:
  // Throws ValueError "<name>: index i out of range for a dataset of n examples".
  void check_index(int64_t i, const char* name) const;
};

// Rows of tensors along dim 0 (torch.utils.data.TensorDataset): example i is {t[i] for t in
// tensors}, each a view sharing storage with the tensor (no copy, no autograd history).
class TensorDataset : public Dataset {
 public:
  // Throws ValueError when `tensors` is empty, a tensor is 0-dimensional or undefined, or the
  // tensors' sizes along dim 0 differ (naming every size).
  explicit TensorDataset(std::vector<Tensor> tensors);

  int64_t size() const override { return size_; }
  Example get(int64_t i) const override;
  // Gathers the rows straight into each batch tensor (one memcpy per row when contiguous).
  Batch get_batch(std::span<const int64_t> indices) const override;
  const std::vector<Tensor>& tensors() const { return tensors_; }

 private:
  std::vector<Tensor> tensors_;
  int64_t size_ = 0;
};

// Row i of `t` along dim 0, as a view without autograd history.
Tensor row_view(const Tensor& t, int64_t i);
// Rows `indices` of `t` gathered into a new contiguous tensor of shape [indices.size(), *t.shape()[1:]].
// Indices must already be in range.
Tensor gather_rows(const Tensor& t, std::span<const int64_t> indices);

}  // namespace tandem::data

// Structured bindings: `auto& [input, target] = batch`.
template <> struct std::tuple_size<tandem::data::Batch> : std::integral_constant<size_t, 2> {};
template <size_t I> struct std::tuple_element<I, tandem::data::Batch> { using type = tandem::Tensor; };
