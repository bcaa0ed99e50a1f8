// Image-classification datasets held in memory as u8: Fashion-MNIST (over data::fashion_mnist)
// and CIFAR-10 (its binary format). Invariant: images stay u8 [N, C, H, W] in memory; the float
// conversion happens per example / per batch, so a dataset costs its raw size.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"
#include "tandem/data/idx.h"

namespace tandem::data {

// Examples {image, label}: image [C, H, W], float32 (x / 255 - mean[c]) / std[c] or, when raw,
// u8 as stored; label a 0-d int64 (so a batch's labels are [B] int64). Thread-safe (immutable).
class ImageClassificationDataset : public Dataset {
 public:
  // data.images: u8 [N, C, H, W]; data.labels: int64 [N]; mean/std: one per channel, or one for
  // all. Throws ShapeError / DTypeError / ValueError on anything else (or a std of 0).
  ImageClassificationDataset(ImageClassification data, bool raw, std::vector<double> mean, std::vector<double> std);

  int64_t size() const override { return labels_.numel(); }
  Example get(int64_t i) const override;
  Batch get_batch(std::span<const int64_t> indices) const override;

  const Tensor& images() const { return images_; }  // u8 [N, C, H, W]
  const Tensor& labels() const { return labels_; }  // int64 [N]
  bool raw() const { return raw_; }

 private:
  // u8 [.., C, H, W] -> float32 through a 256-entry table per channel.
  Tensor convert(const Tensor& u8) const;

  Tensor images_;
  Tensor labels_;
  bool raw_;
  std::vector<std::array<float, 256>> lut_;  // per channel: lut_[c][v] = (v / 255 - mean[c]) / std[c]
};

struct FashionMNISTOptions {
  std::string root;     // directory of the IDX files; "" = fashion_mnist_dir()
  bool raw = false;     // true: u8 pixels as stored
  double mean = 0.0;    // float pixels are (x / 255 - mean) / std; FashionMNIST::kMean/kStd standardise
  double std = 1.0;
};

// torchvision.datasets.FashionMNIST over data::fashion_mnist(): images [1, 28, 28], 10 classes.
class FashionMNIST : public ImageClassificationDataset {
 public:
  using Options = FashionMNISTOptions;
  static constexpr double kMean = 0.2860;  // of the training images, in [0, 1] units
  static constexpr double kStd = 0.3530;
  // split "train" (60000) or "test" (10000). Throws what fashion_mnist() throws (ValueError for
  // the split, IOError for the files).
  explicit FashionMNIST(const std::string& split = "train", const Options& options = {});
};

struct CIFAR10Options {
  bool raw = false;  // true: u8 pixels as stored
  // Float pixels are (x / 255 - mean[c]) / std[c]; CIFAR10::kMean/kStd standardise.
  std::array<double, 3> mean = {0.0, 0.0, 0.0};
  std::array<double, 3> std = {1.0, 1.0, 1.0};
};

// torchvision.datasets.CIFAR10 from the binary version (cifar-10-binary.tar.gz): train reads
// data_batch_1.bin .. data_batch_5.bin (50000 images), test reads test_batch.bin (10000), from
// `root` or, when absent there, root/cifar-10-batches-bin. Each file is records of 1 label byte
// (0..9) + 3072 pixel bytes (1024 R, 1024 G, 1024 B, row-major 32x32), so images are [3, 32, 32].
class CIFAR10 : public ImageClassificationDataset {
 public:
  using Options = CIFAR10Options;
  static constexpr std::array<double, 3> kMean = {0.4914, 0.4822, 0.4465};
  static constexpr std::array<double, 3> kStd = {0.2470, 0.2435, 0.2616};
  static constexpr int64_t kRecordBytes = 1 + 3 * 32 * 32;
  // Throws IOError naming the path: a file missing, of a size that is not a positive multiple of
  // 3073 (naming the size found), unreadable, or with a label above 9 (naming the record).
  CIFAR10(const std::string& root, bool train = true, const Options& options = {});
  // The files read for a split, in order (after resolving root).
  static std::vector<std::string> files(const std::string& root, bool train);
};

}  // namespace tandem::data
