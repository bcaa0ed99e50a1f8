// IDX reading (plain and gzip) on files written here, its error messages, and Fashion-MNIST.
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
using td::Shape;
using td::Tensor;

namespace {

using Bytes = std::vector<unsigned char>;

void put_be32(Bytes& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(v >> s));
}

Bytes idx_header(unsigned char type, const std::vector<uint32_t>& dims) {
  Bytes b = {0, 0, type, static_cast<unsigned char>(dims.size())};
  for (uint32_t d : dims) put_be32(b, d);
  return b;
}

std::string write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string write_gzip(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
  return path;
}

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

// read_idx(path) must throw IOError whose message names the file (and `what`, when given).
void expect_io_error(const std::string& path, const std::string& what = "") {
  try {
    td::data::read_idx(path);
    ADD_FAILURE() << "expected IOError for " << path;
  } catch (const td::IOError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    if (!what.empty()) EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

// A (2, 3, 4) u8 file holding 0..23.
Bytes u8_cube() {
  Bytes b = idx_header(0x08, {2, 3, 4});
  for (unsigned char i = 0; i < 24; ++i) b.push_back(i);
  return b;
}

}  // namespace

TEST(ReadIdx, PlainU8) {
  td::testing::TempDir dir;
  const Tensor t = td::data::read_idx(write_file(dir.path() + "/cube.idx", u8_cube()));
  EXPECT_EQ(t.dtype(), td::kUInt8);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  std::vector<double> expected;
  for (int i = 0; i < 24; ++i) expected.push_back(i);
  EXPECT_EQ(t.to_vector(), expected);
}

TEST(ReadIdx, GzipGivesTheSameTensor) {
  td::testing::TempDir dir;
  const std::string gz = write_gzip(dir.path() + "/cube.idx.gz", u8_cube());
  const Bytes raw = read_file(gz);
  ASSERT_GE(raw.size(), 2u);
  ASSERT_EQ(raw[0], 0x1f);  // really gzip-compressed on disk
  ASSERT_EQ(raw[1], 0x8b);
  const Tensor t = td::data::read_idx(gz);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.to_vector(), td::data::read_idx(write_file(dir.path() + "/cube.idx", u8_cube())).to_vector());
}

TEST(ReadIdx, AllElementTypesAreBigEndian) {
  td::testing::TempDir dir;
  {  // int8 widens to int32, sign kept
    Bytes b = idx_header(0x09, {3});
    for (unsigned char v : {0x7f, 0x80, 0xff}) b.push_back(v);
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/i8", b));
    EXPECT_EQ(t.dtype(), td::kInt32);
    EXPECT_EQ(t.to_vector(), (std::vector<double>{127, -128, -1}));
  }
  {  // int16 widens to int32
    Bytes b = idx_header(0x0B, {2});
    for (unsigned char v : {0x12, 0x34, 0xff, 0xfe}) b.push_back(v);
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/i16", b));
    EXPECT_EQ(t.dtype(), td::kInt32);
    EXPECT_EQ(t.to_vector(), (std::vector<double>{0x1234, -2}));
  }
  {  // int32
    Bytes b = idx_header(0x0C, {1, 2});
    put_be32(b, 0x01020304u);
    put_be32(b, 0xfffffffdu);
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/i32", b));
    EXPECT_EQ(t.dtype(), td::kInt32);
    EXPECT_EQ(t.shape(), (Shape{1, 2}));
    EXPECT_EQ(t.to_vector(), (std::vector<double>{0x01020304, -3}));
  }
  {  // float32
    Bytes b = idx_header(0x0D, {2});
    put_be32(b, 0x3fc00000u);  // 1.5
    put_be32(b, 0xc0490fdbu);  // -pi in f32
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/f32", b));
    EXPECT_EQ(t.dtype(), td::kFloat32);
    EXPECT_EQ(t.to_vector(), (std::vector<double>{1.5, static_cast<double>(-3.14159265f)}));
  }
  {  // float64
    Bytes b = idx_header(0x0E, {1});
    put_be32(b, 0x400921fbu);  // pi, high word first
    put_be32(b, 0x54442d18u);
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/f64", b));
    EXPECT_EQ(t.dtype(), td::kFloat64);
    EXPECT_EQ(t.item(), 3.141592653589793);
  }
  {  // a zero-length dimension is a valid, empty file
    const Tensor t = td::data::read_idx(write_file(dir.path() + "/empty", idx_header(0x08, {0, 28})));
    EXPECT_EQ(t.shape(), (Shape{0, 28}));
    EXPECT_EQ(t.numel(), 0);
  }
}

TEST(ReadIdx, MalformedFilesThrowIOErrorNamingTheFile) {
  td::testing::TempDir dir;
  const std::string d = dir.path();
  expect_io_error(d + "/does-not-exist.idx", "no such file");

  Bytes bad_magic = u8_cube();
  bad_magic[0] = 0x12;
  expect_io_error(write_file(d + "/bad-magic.idx", bad_magic), "not an IDX file");
  expect_io_error(write_gzip(d + "/bad-magic.idx.gz", bad_magic), "not an IDX file");

  expect_io_error(write_file(d + "/tiny.idx", Bytes{0, 0, 8}), "truncated");
  expect_io_error(write_file(d + "/empty.idx", Bytes{}), "truncated");

  Bytes short_header = idx_header(0x08, {2, 3, 4});
  short_header.resize(4 + 4 * 2 + 1);  // three dims announced, two and a bit present
  expect_io_error(write_file(d + "/short-header.idx", short_header), "truncated header");

  Bytes short_data = u8_cube();
  short_data.pop_back();
  expect_io_error(write_file(d + "/short-data.idx", short_data), "truncated");
  expect_io_error(write_gzip(d + "/short-data.idx.gz", short_data), "truncated");

  Bytes trailing = u8_cube();
  trailing.push_back(0);
  expect_io_error(write_file(d + "/trailing.idx", trailing), "1 unexpected bytes");

  Bytes bad_type = u8_cube();
  bad_type[2] = 0x0A;
  expect_io_error(write_file(d + "/bad-type.idx", bad_type), "element type");

  expect_io_error(write_file(d + "/zero-dims.idx", Bytes{0, 0, 8, 0}), "dimensions");

  // Dimensions whose product overflows 64 bits (2^31 * 2^31 * 4 = 2^64 wraps to 0) must not pass
  // for an empty data section.
  expect_io_error(write_file(d + "/overflow.idx", idx_header(0x08, {0x80000000u, 0x80000000u, 4})));
  expect_io_error(write_file(d + "/overflow32.idx", idx_header(0x0C, {0x80000000u, 0x80000000u})));

  // A gzip stream cut short.
  const std::string gz = write_gzip(d + "/cube.gz", u8_cube());
  Bytes cut = read_file(gz);
  cut.resize(cut.size() / 2);
  expect_io_error(write_file(d + "/cut.idx.gz", cut));
}

TEST(FashionMnist, SyntheticRootAndErrors) {
  td::testing::TempDir dir;
  const std::string d = dir.path();
  Bytes images = idx_header(0x08, {3, 28, 28});
  for (int i = 0; i < 3 * 28 * 28; ++i) images.push_back(static_cast<unsigned char>(i % 251));
  Bytes labels = idx_header(0x08, {3});
  for (unsigned char l : {7, 0, 9}) labels.push_back(l);
  // Plain images, gzip labels: both spellings are found.
  write_file(d + "/t10k-images-idx3-ubyte", images);
  write_gzip(d + "/t10k-labels-idx1-ubyte.gz", labels);
  const td::data::ImageClassification ds = td::data::fashion_mnist("test", d);
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.images.shape(), (Shape{3, 28, 28}));
  EXPECT_EQ(ds.images.dtype(), td::kUInt8);
  EXPECT_EQ(ds.labels.dtype(), td::kInt64);
  EXPECT_EQ(ds.labels.to_vector(), (std::vector<double>{7, 0, 9}));
  EXPECT_EQ(ds.images.to_vector()[300], 300 % 251);

  // No train files here: IOError naming the directory.
  try {
    td::data::fashion_mnist("train", d);
    ADD_FAILURE();
  } catch (const td::IOError& e) {
    EXPECT_NE(std::string(e.what()).find(d), std::string::npos) << e.what();
  }
  // Images and labels of different lengths.
  Bytes two_labels = idx_header(0x08, {2});
  two_labels.push_back(1);
  two_labels.push_back(2);
  write_file(d + "/train-images-idx3-ubyte", images);
  write_file(d + "/train-labels-idx1-ubyte", two_labels);
  EXPECT_THROW(td::data::fashion_mnist("train", d), td::IOError);
  // A valid IDX file of int32 values where the images belong: an IOError naming that file (the
  // dataset would otherwise fail later with a dtype error that names no file).
  Bytes int_images = idx_header(0x0C, {2, 28, 28});
  int_images.resize(int_images.size() + 2 * 28 * 28 * 4, 0);
  const std::string int_path = write_file(d + "/train-images-idx3-ubyte", int_images);
  try {
    td::data::fashion_mnist("train", d);
    ADD_FAILURE() << "int32 images accepted";
  } catch (const td::IOError& e) {
    EXPECT_NE(std::string(e.what()).find(int_path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("unsigned bytes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(td::data::fashion_mnist("bogus", d), td::ValueError);
  EXPECT_THROW(td::data::fashion_mnist("bogus"), td::ValueError);
  EXPECT_THROW(td::data::fashion_mnist("Train"), td::ValueError);
}

TEST(FashionMnist, DataDirFromEnvironment) {
  const char* old = std::getenv("TANDEM_DATA_DIR");
  const std::string saved = old ? old : "";
  setenv("TANDEM_DATA_DIR", "/some/where", 1);
  EXPECT_EQ(td::data::fashion_mnist_dir(), "/some/where/fashion-mnist");
  unsetenv("TANDEM_DATA_DIR");
  EXPECT_EQ(td::data::fashion_mnist_dir(), "/usr/share/datasets/fashion-mnist");
  if (old) setenv("TANDEM_DATA_DIR", saved.c_str(), 1);
}

TEST(FashionMnist, RealTrainAndTestSplits) {
  const std::string root = td::data::fashion_mnist_dir();
  if (!std::filesystem::exists(root + "/train-labels-idx1-ubyte.gz") &&
      !std::filesystem::exists(root + "/train-labels-idx1-ubyte")) {
    GTEST_SKIP() << "Fashion-MNIST not installed at " << root << " (scripts/install-deps.sh installs it)";
  }
  const td::data::ImageClassification train = td::data::fashion_mnist("train");
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(train.images.shape(), (Shape{60000, 28, 28}));
  EXPECT_EQ(train.images.dtype(), td::kUInt8);
  EXPECT_EQ(train.labels.shape(), (Shape{60000}));
  const std::vector<double> labels = train.labels.to_vector();
  std::vector<int> counts(10, 0);
  for (double l : labels) {
    ASSERT_GE(l, 0);
    ASSERT_LT(l, 10);
    counts[static_cast<int>(l)]++;
  }
  EXPECT_EQ(counts, std::vector<int>(10, 6000));  // the training set is exactly balanced
  // The published first labels (9 = ankle boot, 0 = T-shirt, 3 = dress, ...).
  EXPECT_EQ(std::vector<double>(labels.begin(), labels.begin() + 10),
            (std::vector<double>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  // The first image: pixel sum and maximum (computed independently with Python's gzip module).
  const Tensor first = train.images.select(0, 0);
  double sum = 0, mx = 0;
  for (double v : first.to_vector()) sum += v, mx = std::max(mx, v);
  EXPECT_EQ(sum, 76247);
  EXPECT_EQ(mx, 255);

  const td::data::ImageClassification test = td::data::fashion_mnist("test");
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(test.images.shape(), (Shape{10000, 28, 28}));
  const std::vector<double> tl = test.labels.to_vector();
  EXPECT_EQ(std::vector<double>(tl.begin(), tl.begin() + 10), (std::vector<double>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
}
