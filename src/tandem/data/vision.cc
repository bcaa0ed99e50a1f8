#include "tandem/data/vision.h"

#include <cstring>
#include <filesystem>
#include <fstream>

namespace tandem::data {

ImageClassificationDataset::ImageClassificationDataset(ImageClassification data, bool raw, std::vector<double> mean,
                                                       std::vector<double> std)
    : images_(data.images.detach().contiguous()), labels_(data.labels.detach().contiguous()), raw_(raw) {
  TANDEM_CHECK(images_.dtype() == kUInt8, DTypeError, "ImageClassificationDataset: images must be uint8, got {}",
               dtype_name(images_.dtype()));
  TANDEM_CHECK(labels_.dtype() == kInt64, DTypeError, "ImageClassificationDataset: labels must be int64, got {}",
               dtype_name(labels_.dtype()));
  TANDEM_CHECK(images_.dim() == 4 && labels_.dim() == 1 && images_.size(0) == labels_.size(0), ShapeError,
               "ImageClassificationDataset: expected images [N, C, H, W] and labels [N], got {} and {}",
               shape_str(images_.shape()), shape_str(labels_.shape()));
  TANDEM_CHECK(images_.size(1) > 0 && images_.size(2) > 0 && images_.size(3) > 0, ShapeError,
               "ImageClassificationDataset: images {} have no pixels; expected C, H and W >= 1",
               shape_str(images_.shape()));
  const int64_t channels = images_.size(1);
  auto per_channel = [&](std::vector<double>& v, const char* name) {
    TANDEM_CHECK(v.size() == 1 || static_cast<int64_t>(v.size()) == channels, ValueError,
                 "ImageClassificationDataset: {} has {} values; expected 1 or one per channel ({})", name, v.size(),
                 channels);
    if (v.size() == 1) v.assign(static_cast<size_t>(channels), v[0]);
  };
  per_channel(mean, "mean");
  per_channel(std, "std");
  for (int64_t c = 0; c < channels; ++c) {
    TANDEM_CHECK(std[c] != 0.0, ValueError, "ImageClassificationDataset: std of channel {} is 0", c);
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) t[v] = static_cast<float>((v / 255.0 - mean[c]) / std[c]);
    lut_.push_back(t);
  }
}

Tensor ImageClassificationDataset::convert(const Tensor& u8) const {
  if (raw_) return u8;
  Tensor out = empty(u8.shape(), kFloat32);
  const int64_t channels = images_.size(1);
  const int64_t plane = images_.size(2) * images_.size(3);
  const int64_t planes = u8.numel() / plane;  // images * channels
  const uint8_t* src = static_cast<const uint8_t*>(u8.data_ptr());
  float* dst = out.data_ptr<float>();
  for (int64_t p = 0; p < planes; ++p) {
    const std::array<float, 256>& t = lut_[static_cast<size_t>(p % channels)];
    for (int64_t q = 0; q < plane; ++q) dst[p * plane + q] = t[src[p * plane + q]];
  }
  return out;
}

Example ImageClassificationDataset::get(int64_t i) const {
  check_index(i, "ImageClassificationDataset");
  Tensor image = row_view(images_, i);
  return {raw_ ? image : convert(image.contiguous()), row_view(labels_, i)};
}

Batch ImageClassificationDataset::get_batch(std::span<const int64_t> indices) const {
  for (int64_t i : indices) check_index(i, "ImageClassificationDataset");
  return {convert(gather_rows(images_, indices)), gather_rows(labels_, indices)};
}

// ---- Fashion-MNIST ----

namespace {

ImageClassification with_channel(ImageClassification d) {
  d.images = d.images.reshape({d.images.size(0), 1, d.images.size(1), d.images.size(2)});
  return d;
}

}  // namespace

FashionMNIST::FashionMNIST(const std::string& split, const Options& options)
    : ImageClassificationDataset(with_channel(fashion_mnist(split, options.root)), options.raw, {options.mean},
                                 {options.std}) {}

// ---- CIFAR-10 ----

std::vector<std::string> CIFAR10::files(const std::string& root, bool train) {
  namespace fs = std::filesystem;
  std::vector<std::string> names;
  if (train) {
    for (int b = 1; b <= 5; ++b) names.push_back(fmt::format("data_batch_{}.bin", b));
  } else {
    names.push_back("test_batch.bin");
  }
  // The tarball unpacks into cifar-10-batches-bin/; accept either that folder or its parent.
  std::string dir = root;
  if (!fs::exists(fs::path(root) / names[0]) && fs::is_directory(fs::path(root) / "cifar-10-batches-bin")) {
    dir = (fs::path(root) / "cifar-10-batches-bin").string();
  }
  std::vector<std::string> paths;
  for (const std::string& n : names) paths.push_back((fs::path(dir) / n).string());
  return paths;
}

namespace {

ImageClassification read_cifar10(const std::string& root, bool train) {
  namespace fs = std::filesystem;
  const std::vector<std::string> paths = CIFAR10::files(root, train);
  // Sizes first, so that a bad file fails before anything is read.
  std::vector<int64_t> records;
  int64_t total = 0;
  for (const std::string& path : paths) {
    std::error_code ec;
    TANDEM_CHECK(fs::is_regular_file(path, ec), IOError,
                 "CIFAR10: {}: no such file (expected the binary version of CIFAR-10, cifar-10-binary.tar.gz, "
                 "unpacked under {})",
                 path, root);
    const auto bytes = static_cast<int64_t>(fs::file_size(path, ec));
    TANDEM_CHECK(!ec, IOError, "CIFAR10: {}: cannot read its size: {}", path, ec.message());
    TANDEM_CHECK(bytes > 0 && bytes % CIFAR10::kRecordBytes == 0, IOError,
                 "CIFAR10: {}: size {} bytes is not a positive multiple of the record size {} (1 label byte + 3072 "
                 "pixel bytes)",
                 path, bytes, CIFAR10::kRecordBytes);
    records.push_back(bytes / CIFAR10::kRecordBytes);
    total += records.back();
  }
  ImageClassification d;
  d.images = empty({total, 3, 32, 32}, kUInt8);
  d.labels = empty({total}, kInt64);
  auto* images = d.images.data_ptr<uint8_t>();
  auto* labels = d.labels.data_ptr<int64_t>();
  std::vector<char> buf;
  int64_t at = 0;
  for (size_t f = 0; f < paths.size(); ++f) {
    std::ifstream in(paths[f], std::ios::binary);
    buf.resize(static_cast<size_t>(records[f] * CIFAR10::kRecordBytes));
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    TANDEM_CHECK(in && in.gcount() == static_cast<std::streamsize>(buf.size()), IOError,
                 "CIFAR10: {}: read {} of {} bytes", paths[f], in.gcount(), buf.size());
    for (int64_t r = 0; r < records[f]; ++r, ++at) {
      const auto* rec = reinterpret_cast<const uint8_t*>(buf.data()) + r * CIFAR10::kRecordBytes;
      TANDEM_CHECK(rec[0] <= 9, IOError, "CIFAR10: {}: record {} has label {}, expected 0..9", paths[f], r, rec[0]);
      labels[at] = rec[0];
      std::memcpy(images + at * (CIFAR10::kRecordBytes - 1), rec + 1, CIFAR10::kRecordBytes - 1);
    }
  }
  return d;
}

std::vector<double> to_vector(const std::array<double, 3>& a) { return {a.begin(), a.end()}; }

}  // namespace

CIFAR10::CIFAR10(const std::string& root, bool train, const Options& options)
    : ImageClassificationDataset(read_cifar10(root, train), options.raw, to_vector(options.mean),
                                 to_vector(options.std)) {}

}  // namespace tandem::data
