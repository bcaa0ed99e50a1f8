// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed, and the
// Fashion-MNIST dataset built on them.
#pragma once

#include <string>

#include "tandem/core/tensor.h"

namespace tandem::data {

// Reads an IDX file (gzip is detected and decompressed). Returns a tensor of the file's element
// type (u8, i32, f32, f64; i8 and i16 widen to i32) and shape. Throws IOError naming the file and
// what is wrong: missing, bad magic, truncated, or trailing data.
Tensor read_idx(const std::string& path);

struct ImageClassification {
  Tensor images;  // (N, 28, 28), u8
  Tensor labels;  // (N), int64
  int64_t size() const { return labels.numel(); }
};

// The directory holding the Fashion-MNIST files: $TANDEM_DATA_DIR/fashion-mnist if set, else
// /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
std::string fashion_mnist_dir();
// split: "train" (60000) or "test" (10000). root defaults to fashion_mnist_dir().
ImageClassification fashion_mnist(const std::string& split, const std::string& root = "");

}  // namespace tandem::data
