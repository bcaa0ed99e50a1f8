// Synthetic data for benchmarks and tests: random inputs and targets made on demand from a seed,
// so a dataset of any size costs no memory. Invariant: example i is a pure function of (seed, i).
#pragma once

#include <cstdint>

#include "tandem/data/dataset.h"

namespace tandem::data {

struct SyntheticOptions {
  int64_t size = 1024;             // examples per epoch
  Shape input_shape = {784};
  // Floating dtypes: standard normal; integer dtypes: uniform in [0, num_classes) (token ids).
  DType input_dtype = kFloat32;
  Shape target_shape = {};         // {} : one class label per example; {T}: per-token targets
  int64_t num_classes = 10;        // targets are int64, uniform in [0, num_classes)
  uint64_t seed = 0;
};

// Examples {input, target} drawn from a Philox generator whose seed mixes (seed, i). Examples:
//   image classification: {.input_shape = {3, 32, 32}, .num_classes = 10}
//   language model:       {.input_shape = {T}, .input_dtype = kInt64, .target_shape = {T}, .num_classes = V}
// Immutable, thread-safe.
class Synthetic : public Dataset {
 public:
  using Options = SyntheticOptions;
  // Throws ValueError when size < 0, a shape has a negative extent, or num_classes < 1;
  // DTypeError for a boolean input dtype, or an integer one that cannot hold num_classes - 1.
  explicit Synthetic(const Options& options = {});

  int64_t size() const override { return options_.size; }
  Example get(int64_t i) const override;
  const Options& options() const { return options_; }

 private:
  Options options_;
};

}  // namespace tandem::data
