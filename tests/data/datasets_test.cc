// Datasets: CIFAR-10 on generated binary files and its errors, Fashion-MNIST over the IDX reader,
// TextBytes on Debian's license texts and on small files, TokenFile (raw and llm.c header),
// Synthetic.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "tandem/data/dataloader.h"
#include "tandem/data/synthetic.h"
#include "tandem/data/text.h"
#include "tandem/data/vision.h"
#include "util/test_util.h"

namespace td = tandem;
namespace fs = std::filesystem;
using td::Tensor;
using Bytes = std::vector<unsigned char>;

namespace {

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Pixel j (0..3071, CHW) of CIFAR record `id`.
unsigned char pixel(int id, int j) { return static_cast<unsigned char>((id * 31 + j * 7) % 256); }

Bytes cifar_records(const std::vector<std::pair<int, int>>& id_label) {
  Bytes b;
  for (auto [id, label] : id_label) {
    b.push_back(static_cast<unsigned char>(label));
    for (int j = 0; j < 3072; ++j) b.push_back(pixel(id, j));
  }
  return b;
}

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const td::IOError& e) {
    return e.what();
  }
  return "(no IOError)";
}

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v;
  for (double d : t.to_vector()) v.push_back(static_cast<int64_t>(d));
  return v;
}

}  // namespace

// ---- CIFAR-10 ----

TEST(CIFAR10, ReadsTheTestBatch) {
  td::testing::TempDir dir;
  write_file(dir.path() + "/test_batch.bin", cifar_records({{0, 3}, {1, 7}}));
  td::data::CIFAR10 raw(dir.path(), /*train=*/false, {.raw = true});
  ASSERT_EQ(raw.size(), 2);
  EXPECT_EQ(raw.images().shape(), (td::Shape{2, 3, 32, 32}));
  td::data::Example e = raw.get(1);
  EXPECT_EQ(e[0].dtype(), td::kUInt8);
  EXPECT_EQ(e[0].shape(), (td::Shape{3, 32, 32}));
  EXPECT_EQ(e[1].dtype(), td::kInt64);
  EXPECT_EQ(e[1].item<int64_t>(), 7);
  const std::vector<double> px = e[0].to_vector();
  for (int j : {0, 1, 1023, 1024, 2047, 2048 + 32 * 5 + 9, 3071}) EXPECT_EQ(px[j], pixel(1, j)) << j;
  // Float: (x / 255 - mean[c]) / std[c], per channel.
  td::data::CIFAR10 norm(dir.path(), false, {.mean = {0.5, 0.25, 0.0}, .std = {0.5, 1.0, 2.0}});
  const std::vector<double> f = norm.get(0)[0].to_vector();
  for (int j : {5, 1024 + 5, 2048 + 5}) {
    const int c = j / 1024;
    const double mean[] = {0.5, 0.25, 0.0}, sd[] = {0.5, 1.0, 2.0};
    EXPECT_NEAR(f[j], (pixel(0, j) / 255.0 - mean[c]) / sd[c], 1e-6) << j;
  }
  // A batch through the loader: [B, 3, 32, 32] float, [B] int64.
  td::data::DataLoader loader(norm, {.batch_size = 2});
  for (auto& [x, y] : loader) {
    EXPECT_EQ(x.shape(), (td::Shape{2, 3, 32, 32}));
    EXPECT_EQ(x.dtype(), td::kFloat32);
    EXPECT_EQ(ints(y), (std::vector<int64_t>{3, 7}));
    const std::vector<double> xv = x.to_vector();
    EXPECT_EQ(xv[5], f[5]);  // the batch path converts exactly like get()
    EXPECT_EQ(xv[3072 + 2048 + 5], norm.get(1)[0].to_vector()[2048 + 5]);
  }
}

TEST(CIFAR10, TrainConcatenatesFiveBatchesAndFindsTheTarballFolder) {
  td::testing::TempDir dir;
  const std::string sub = dir.path() + "/cifar-10-batches-bin";
  fs::create_directory(sub);
  for (int b = 1; b <= 5; ++b) write_file(fmt::format("{}/data_batch_{}.bin", sub, b), cifar_records({{b, b}, {10 + b, 9}}));
  td::data::CIFAR10 ds(dir.path(), true, {.raw = true});
  ASSERT_EQ(ds.size(), 10);
  EXPECT_EQ(ints(ds.labels()), (std::vector<int64_t>{1, 9, 2, 9, 3, 9, 4, 9, 5, 9}));
  EXPECT_EQ(ds.get(4)[0].to_vector()[100], pixel(3, 100));
  EXPECT_EQ(ds.get(9)[0].to_vector()[3000], pixel(15, 3000));
}

TEST(CIFAR10, ErrorsNameThePathAndTheSize) {
  td::testing::TempDir dir;
  std::string m = error_of([&] { td::data::CIFAR10(dir.path(), false); });
  EXPECT_NE(m.find(dir.path() + "/test_batch.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("no such file"), std::string::npos) << m;

  Bytes two = cifar_records({{0, 1}, {1, 2}});
  two.resize(two.size() + 5);
  write_file(dir.path() + "/test_batch.bin", two);
  m = error_of([&] { td::data::CIFAR10(dir.path(), false); });
  EXPECT_NE(m.find(dir.path() + "/test_batch.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("6151"), std::string::npos) << m;  // 2 * 3073 + 5
  EXPECT_NE(m.find("3073"), std::string::npos) << m;

  write_file(dir.path() + "/test_batch.bin", cifar_records({{0, 1}, {1, 10}}));
  m = error_of([&] { td::data::CIFAR10(dir.path(), false); });
  EXPECT_NE(m.find("record 1 has label 10"), std::string::npos) << m;

  // Train needs all five files.
  for (int b = 1; b <= 4; ++b) write_file(fmt::format("{}/data_batch_{}.bin", dir.path(), b), cifar_records({{0, 0}}));
  m = error_of([&] { td::data::CIFAR10(dir.path(), true); });
  EXPECT_NE(m.find("data_batch_5.bin"), std::string::npos) << m;
}

// ---- Fashion-MNIST ----

TEST(FashionMNIST, WrapsTheIdxReader) {
  const std::string root = td::data::fashion_mnist_dir();
  if (!fs::exists(root + "/t10k-labels-idx1-ubyte.gz") && !fs::exists(root + "/t10k-labels-idx1-ubyte")) {
    GTEST_SKIP() << "Fashion-MNIST not found in " << root << " (scripts/install-deps.sh installs it)";
  }
  const auto plain = td::data::fashion_mnist("test");
  td::data::FashionMNIST raw("test", {.raw = true});
  td::data::FashionMNIST std_("test", {.mean = td::data::FashionMNIST::kMean, .std = td::data::FashionMNIST::kStd});
  ASSERT_EQ(raw.size(), 10000);
  td::data::Example r = raw.get(123), s = std_.get(123);
  EXPECT_EQ(r[0].shape(), (td::Shape{1, 28, 28}));
  EXPECT_EQ(r[0].dtype(), td::kUInt8);
  EXPECT_EQ(s[0].dtype(), td::kFloat32);
  EXPECT_EQ(r[1].item<int64_t>(), plain.labels.to_vector()[123]);
  const std::vector<double> want = plain.images.select(0, 123).to_vector(), got = r[0].to_vector(), f = s[0].to_vector();
  EXPECT_EQ(got, want);
  for (size_t j = 0; j < want.size(); j += 37)
    EXPECT_NEAR(f[j], (want[j] / 255.0 - 0.2860) / 0.3530, 1e-5);
  td::data::FashionMNIST unit("test");  // default: x / 255 in [0, 1]
  const std::vector<double> u = unit.get(123)[0].to_vector();
  EXPECT_NEAR(*std::max_element(u.begin(), u.end()), *std::max_element(want.begin(), want.end()) / 255.0, 1e-6);
  EXPECT_THROW(td::data::FashionMNIST("validation"), td::ValueError);
}

// ---- TextBytes ----

TEST(TextBytes, DebianLicenseCorpus) {
  const std::string root = td::data::TextBytes::kDefaultCorpus;
  if (!fs::is_directory(root)) GTEST_SKIP() << root << " is missing (Debian's base-files provides it)";
  std::vector<std::string> files;
  int64_t total = 0;
  for (const auto& e : fs::directory_iterator(root)) {
    if (fs::is_regular_file(e.path())) {
      files.push_back(e.path().string());
      total += static_cast<int64_t>(fs::file_size(e.path()));
    }
  }
  std::sort(files.begin(), files.end());
  td::data::TextBytes ds({root}, 64, /*seed=*/1);
  EXPECT_EQ(ds.files(), files);
  EXPECT_EQ(ds.corpus_size(), total);
  EXPECT_EQ(ds.size(), (total - 1) / 64);
  // The corpus opens with the first file's first bytes.
  std::ifstream first(files[0], std::ios::binary);
  std::string head(16, '\0');
  first.read(head.data(), 16);
  EXPECT_EQ(std::string(ds.bytes().begin(), ds.bytes().begin() + 16), head);

  std::set<int64_t> starts;
  for (int64_t i = 0; i < 50; ++i) {
    td::data::Example e = ds.get(i);
    ASSERT_EQ(e[0].shape(), (td::Shape{64}));
    ASSERT_EQ(e[0].dtype(), td::kInt64);
    const int64_t s = td::data::window_start(1, i, ds.corpus_size(), 65);
    starts.insert(s);
    const std::vector<int64_t> x = ints(e[0]), y = ints(e[1]);
    for (int64_t t = 0; t < 64; ++t) {
      ASSERT_EQ(x[t], ds.bytes()[s + t]);
      ASSERT_EQ(y[t], ds.bytes()[s + t + 1]);  // the target is the input shifted by one
    }
    EXPECT_EQ(ints(ds.get(i)[0]), x);  // deterministic
  }
  EXPECT_GT(starts.size(), 45u);  // windows are spread over the corpus
  td::data::TextBytes other_seed({root}, 64, 2);
  EXPECT_NE(ints(other_seed.get(0)[0]), ints(ds.get(0)[0]));
  td::data::TextBytes default_corpus;
  EXPECT_EQ(default_corpus.corpus_size(), total);
  EXPECT_EQ(default_corpus.context(), 256);
}

TEST(TextBytes, SmallFilesWindowsAndErrors) {
  td::testing::TempDir dir;
  fs::create_directory(dir.path() + "/d");
  std::ofstream(dir.path() + "/d/b.txt") << "world";
  std::ofstream(dir.path() + "/d/a.txt") << "hello ";
  std::ofstream(dir.path() + "/z.txt") << "!";
  td::data::TextBytes ds({dir.path() + "/d", dir.path() + "/z.txt"}, 2, 0, /*samples_per_epoch=*/400);
  EXPECT_EQ(std::string(ds.bytes().begin(), ds.bytes().end()), "hello world!");
  EXPECT_EQ(ds.size(), 400);
  // 12 bytes, windows of 3: starts 0..9, all reached, none beyond.
  std::set<int64_t> starts;
  const std::string text = "hello world!";
  for (int64_t i = 0; i < 400; ++i) {
    const std::vector<int64_t> x = ints(ds.get(i)[0]), y = ints(ds.get(i)[1]);
    const auto at = text.find(std::string{static_cast<char>(x[0]), static_cast<char>(x[1]), static_cast<char>(y[1])});
    ASSERT_NE(at, std::string::npos);
    starts.insert(td::data::window_start(0, i, 12, 3));
  }
  EXPECT_EQ(starts.size(), 10u);
  EXPECT_EQ(*starts.rbegin(), 9);
  td::data::TextBytes exact({dir.path() + "/d/a.txt"}, 5);  // 6 bytes = context + 1: one window
  EXPECT_EQ(exact.size(), 1);
  EXPECT_EQ(ints(exact.get(0)[1]), (std::vector<int64_t>{'e', 'l', 'l', 'o', ' '}));

  std::string m = error_of([&] { td::data::TextBytes({dir.path() + "/z.txt"}, 8); });
  EXPECT_NE(m.find(dir.path() + "/z.txt"), std::string::npos) << m;
  EXPECT_NE(m.find("holds 1 bytes"), std::string::npos) << m;
  m = error_of([&] { td::data::TextBytes({dir.path() + "/missing"}, 8); });
  EXPECT_NE(m.find(dir.path() + "/missing"), std::string::npos) << m;
  EXPECT_THROW(td::data::TextBytes({dir.path() + "/d"}, 0), td::ValueError);
  EXPECT_THROW(ds.get(400), td::ValueError);
}

// A directory's regular files are taken and anything else skipped: a dangling symlink failed the
// whole directory with "cannot list the directory" when it happened to be listed last.
TEST(TextBytes, ADanglingSymlinkInADirectoryIsSkipped) {
  td::testing::TempDir dir;
  fs::create_directory(dir.path() + "/d");
  std::ofstream(dir.path() + "/d/a.txt") << "hello world";
  for (const char* link : {"/d/0", "/d/zzz"}) fs::create_symlink(dir.path() + "/nowhere", dir.path() + link);
  td::data::TextBytes ds({dir.path() + "/d"}, 2);
  EXPECT_EQ(std::string(ds.bytes().begin(), ds.bytes().end()), "hello world");
}

// Images without pixels (H or W 0) are a ShapeError, not a division by zero in get().
TEST(ImageClassificationDataset, ImagesWithoutPixelsAreAShapeError) {
  td::data::ImageClassification data{td::empty({2, 1, 0, 5}, td::kUInt8), td::zeros({2}, td::kInt64)};
  EXPECT_THROW(td::data::ImageClassificationDataset(data, /*raw=*/false, {0}, {1}), td::ShapeError);
}

// ---- TokenFile ----

TEST(TokenFile, RawAndLlmcFiles) {
  td::testing::TempDir dir;
  std::vector<uint16_t> tokens;
  for (int t = 0; t < 500; ++t) tokens.push_back(static_cast<uint16_t>((t * 40503u) & 0xFFFF));  // spans 0..65535
  Bytes raw;
  for (uint16_t t : tokens) {
    raw.push_back(static_cast<unsigned char>(t & 0xFF));
    raw.push_back(static_cast<unsigned char>(t >> 8));
  }
  write_file(dir.path() + "/train.bin", raw);
  td::data::TokenFile ds(dir.path() + "/train.bin", 16, 3);
  EXPECT_FALSE(ds.has_llmc_header());
  EXPECT_EQ(ds.num_tokens(), 500);
  EXPECT_EQ(ds.size(), 499 / 16);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const int64_t s = td::data::window_start(3, i, 500, 17);
    const std::vector<int64_t> x = ints(ds.get(i)[0]), y = ints(ds.get(i)[1]);
    for (int64_t t = 0; t < 16; ++t) {
      ASSERT_EQ(x[t], tokens[s + t]);
      ASSERT_EQ(y[t], tokens[s + t + 1]);
    }
  }
  EXPECT_GT(*std::max_element(tokens.begin(), tokens.end()), 32767);  // read as unsigned
  EXPECT_EQ(ds.token(2), tokens[2]);

  // llm.c: 256 int32 header {20240520, 1, count}, then the same tokens.
  Bytes llmc(1024, 0);
  const int32_t header[3] = {20240520, 1, 500};
  std::memcpy(llmc.data(), header, sizeof(header));
  llmc.insert(llmc.end(), raw.begin(), raw.end());
  write_file(dir.path() + "/val.bin", llmc);
  td::data::TokenFile lc(dir.path() + "/val.bin", 16, 3);
  EXPECT_TRUE(lc.has_llmc_header());
  EXPECT_EQ(lc.num_tokens(), 500);
  EXPECT_EQ(ints(lc.get(5)[0]), ints(ds.get(5)[0]));

  // Through the loader with workers: [B, 16] int64.
  td::data::DataLoader loader(ds, {.batch_size = 8, .shuffle = true, .num_workers = 2});
  for (auto& [x, y] : loader) {
    EXPECT_EQ(x.dtype(), td::kInt64);
    EXPECT_EQ(x.size(1), 16);
  }
}

TEST(TokenFile, Errors) {
  td::testing::TempDir dir;
  write_file(dir.path() + "/odd.bin", Bytes(2001, 1));
  std::string m = error_of([&] { td::data::TokenFile(dir.path() + "/odd.bin", 8); });
  EXPECT_NE(m.find(dir.path() + "/odd.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("2001"), std::string::npos) << m;
  EXPECT_NE(m.find("odd"), std::string::npos) << m;
  write_file(dir.path() + "/short.bin", Bytes(16, 1));
  m = error_of([&] { td::data::TokenFile(dir.path() + "/short.bin", 8); });
  EXPECT_NE(m.find("holds 8 tokens"), std::string::npos) << m;
  write_file(dir.path() + "/empty.bin", Bytes());
  EXPECT_THROW(td::data::TokenFile(dir.path() + "/empty.bin", 8), td::IOError);
  m = error_of([&] { td::data::TokenFile(dir.path() + "/none.bin", 8); });
  EXPECT_NE(m.find(dir.path() + "/none.bin"), std::string::npos) << m;
  EXPECT_THROW(td::data::TokenFile(dir.path() + "/short.bin", 0), td::ValueError);
}

TEST(TokenFile, AnLlmcFileIsNeverReadAsRawTokens) {
  // A file that starts with an llm.c magic but does not match its header used to be read as
  // headerless uint16 tokens: 512 tokens of header, then the data (truncated, or uint32 tokens
  // split in halves), with no error.
  td::testing::TempDir dir;
  auto llmc = [](int32_t magic, int32_t version, int32_t count, int64_t token_bytes) {
    Bytes b(1024, 0);
    const int32_t h[3] = {magic, version, count};
    std::memcpy(b.data(), h, sizeof(h));
    for (int64_t k = 0; k < token_bytes; ++k) b.push_back(static_cast<unsigned char>(k % 7));
    return b;
  };
  const std::string whole = dir.path() + "/whole.bin", truncated = dir.path() + "/truncated.bin";
  write_file(whole, llmc(20240520, 1, 500, 1000));
  EXPECT_EQ(td::data::TokenFile(whole, 16).num_tokens(), 500);
  write_file(truncated, llmc(20240520, 1, 500, 800));  // a download cut at 400 of 500 tokens
  std::string m = error_of([&] { td::data::TokenFile(truncated, 16); });
  EXPECT_NE(m.find(truncated), std::string::npos) << m;
  EXPECT_NE(m.find("announces 500 tokens (2024 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("holds 1824 bytes"), std::string::npos) << m;
  write_file(dir.path() + "/appended.bin", llmc(20240520, 1, 500, 1002));
  EXPECT_THROW(td::data::TokenFile(dir.path() + "/appended.bin", 16), td::IOError);
  // llm.c's LLaMA-3 files (magic 20240801, version 7) hold uint32 tokens.
  write_file(dir.path() + "/llama3.bin", llmc(20240801, 7, 300, 1200));
  m = error_of([&] { td::data::TokenFile(dir.path() + "/llama3.bin", 16); });
  EXPECT_NE(m.find(dir.path() + "/llama3.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("uint32"), std::string::npos) << m;
  write_file(dir.path() + "/v2.bin", llmc(20240520, 2, 500, 1000));
  m = error_of([&] { td::data::TokenFile(dir.path() + "/v2.bin", 16); });
  EXPECT_NE(m.find("version 2"), std::string::npos) << m;
  // Cut inside the header.
  Bytes head = llmc(20240520, 1, 500, 0);
  head.resize(600);
  write_file(dir.path() + "/head.bin", head);
  m = error_of([&] { td::data::TokenFile(dir.path() + "/head.bin", 16); });
  EXPECT_NE(m.find("holds 600 bytes"), std::string::npos) << m;
}

TEST(TokenFileAndTextBytes, ContextNearInt64MaxIsAClearError) {
  // context + 1 overflowed (undefined behaviour; the message read "context + 1 = -9223372036854775808").
  td::testing::TempDir dir;
  write_file(dir.path() + "/t.bin", Bytes(4000, 1));
  const int64_t big = std::numeric_limits<int64_t>::max();
  std::string m = error_of([&] { td::data::TokenFile(dir.path() + "/t.bin", big, 0, 4); });
  EXPECT_NE(m.find("holds 2000 tokens (4000 bytes), fewer than context + 1 = 9223372036854775808"),
            std::string::npos) << m;
  std::ofstream(dir.path() + "/t.txt") << "some text";
  m = error_of([&] { td::data::TextBytes({dir.path() + "/t.txt"}, big, 0, 4); });
  EXPECT_NE(m.find("holds 9 bytes (1 files), shorter than context + 1 = 9223372036854775808"), std::string::npos)
      << m;
}

// ---- Synthetic ----

TEST(Synthetic, DeterministicShapesAndRanges) {
  td::data::Synthetic img({.size = 32, .input_shape = {3, 4, 4}, .num_classes = 10, .seed = 7});
  EXPECT_EQ(img.size(), 32);
  td::data::Example a = img.get(3), b = img.get(3), c = img.get(4);
  EXPECT_EQ(a[0].shape(), (td::Shape{3, 4, 4}));
  EXPECT_EQ(a[0].to_vector(), b[0].to_vector());
  EXPECT_NE(a[0].to_vector(), c[0].to_vector());
  EXPECT_EQ(a[1].dim(), 0);
  td::data::Synthetic other({.size = 32, .input_shape = {3, 4, 4}, .num_classes = 10, .seed = 8});
  EXPECT_NE(other.get(3)[0].to_vector(), a[0].to_vector());
  std::set<int64_t> classes;
  for (int64_t i = 0; i < 32; ++i) classes.insert(img.get(i)[1].item<int64_t>());
  EXPECT_GE(*classes.begin(), 0);
  EXPECT_LE(*classes.rbegin(), 9);
  EXPECT_GT(classes.size(), 5u);

  td::data::Synthetic lm({.size = 8, .input_shape = {12}, .input_dtype = td::kInt64, .target_shape = {12}, .num_classes = 50});
  td::data::Example t = lm.get(0);
  EXPECT_EQ(t[0].dtype(), td::kInt64);
  EXPECT_EQ(t[1].shape(), (td::Shape{12}));
  for (double v : t[0].to_vector()) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, 50);
  }
  EXPECT_THROW(td::data::Synthetic({.size = -1}), td::ValueError);
  EXPECT_THROW(img.get(32), td::ValueError);
  // uint8 ids: 256 classes fit (ids 0..255), 257 would wrap 256 to 0.
  td::data::Synthetic bytes({.size = 4, .input_shape = {64}, .input_dtype = td::kUInt8, .num_classes = 256});
  for (double v : bytes.get(1)[0].to_vector()) EXPECT_LT(v, 256);
  EXPECT_THROW(td::data::Synthetic({.input_shape = {8}, .input_dtype = td::kUInt8, .num_classes = 257}), td::DTypeError);
  EXPECT_THROW(td::data::Synthetic({.input_shape = {8}, .input_dtype = td::kInt32, .num_classes = int64_t{1} << 32}),
               td::DTypeError);
}
