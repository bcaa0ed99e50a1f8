// safetensors files (core/safetensors.h) and module checkpoints (nn/serialize.h): bit-exact round
// trips of every dtype, one file compared byte for byte with hand-computed bytes, every kind of
// corrupt header refused with an IOError naming the file and the problem, truncation, bit flips
// and random garbage that must never crash, atomic saves, loading into a different model, tied
// weights stored under one name or both, and the keys a non-strict load reports.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/core/safetensors.h"
#include "tandem/nn/layers.h"
#include "tandem/nn/serialize.h"
#include "util/test_util.h"

namespace td = tandem;
namespace nn = tandem::nn;
using td::Shape;
using td::Tensor;
using Named = std::vector<std::pair<std::string, Tensor>>;

namespace {

// ---- helpers ----

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  // A new file rather than truncating the old one: ext4 flushes a truncated-and-rewritten file on
  // close (auto_da_alloc), which makes the thousands of rewrites below slow on a busy disk.
  std::filesystem::remove(path);
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// The 8-byte little-endian length field.
std::string length_field(uint64_t n) {
  std::string s(8, '\0');
  for (int b = 0; b < 8; ++b) s[b] = static_cast<char>((n >> (8 * b)) & 0xff);
  return s;
}

// A file: length + header (space-padded to a multiple of 8) + data.
std::string make_file(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return length_field(header.size()) + header + data;
}

// `n` bytes of float data 1, 2, 3, ...
std::string f32_bytes(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    const float v = static_cast<float>(i + 1);
    s.append(reinterpret_cast<const char*>(&v), 4);
  }
  return s;
}

// The contiguous bytes of a tensor.
std::string bytes_of(const Tensor& t) {
  const Tensor c = t.detach().contiguous();
  if (c.nbytes() == 0) return "";
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// A tensor of `dtype` whose elements have exactly these bit patterns (16/32/64-bit floats).
template <class Bits>
Tensor from_bits(const std::vector<Bits>& bits, const Shape& shape, td::DType dtype) {
  Tensor t = td::empty(shape, dtype);
  EXPECT_EQ(t.nbytes(), bits.size() * sizeof(Bits));
  std::memcpy(t.data_ptr(), bits.data(), t.nbytes());
  return t;
}

// Loading `path` must throw IOError whose message names the file and contains `problem`.
void expect_io_error(const std::string& path, const std::string& problem) {
  try {
    td::load_safetensors(path);
    ADD_FAILURE() << "expected IOError containing \"" << problem << "\" for " << path;
  } catch (const td::IOError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << "message does not name the file: " << what;
    EXPECT_NE(what.find(problem), std::string::npos) << "expected \"" << problem << "\" in: " << what;
  }
}

// Loads `path`; true when it loaded, false on IOError; any other exception fails the test.
bool loads_or_io_error(const std::string& path, const std::string& context) {
  try {
    const td::SafetensorsFile f = td::load_safetensors(path);
    for (const auto& [name, t] : f.tensors) (void)bytes_of(t);  // touch every byte
    return true;
  } catch (const td::IOError& e) {
    if (std::string(e.what()).find(path) == std::string::npos) ADD_FAILURE() << context << ": " << e.what();
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << context << ": not an IOError: " << e.what();
  } catch (...) {
    ADD_FAILURE() << context << ": unknown exception";
  }
  return false;
}

// One tensor of every dtype with edge values (NaN payloads, -0, infinities, subnormals, integer
// extremes), a 0-d tensor, empty tensors, and a non-contiguous view.
Named all_dtypes() {
  Named t;
  t.emplace_back("f32", from_bits<uint32_t>({0x3fc00000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00123u, 0x00000001u},
                                            {2, 3}, td::kFloat32));
  t.emplace_back("f64", from_bits<uint64_t>({0x400921fb54442d18ull, 0xfff8000000000001ull, 0x0000000000000001ull},
                                            {3}, td::kFloat64));
  t.emplace_back("f16", from_bits<uint16_t>({0x3c00, 0x7bff, 0x0001, 0x8000, 0x7e01}, {5}, td::kFloat16));
  t.emplace_back("bf16", from_bits<uint16_t>({0x3f80, 0xff80, 0x0001, 0x7fc1}, {2, 2}, td::kBFloat16));
  t.emplace_back("i64", td::tensor(std::vector<int64_t>{std::numeric_limits<int64_t>::min(), -1, 0,
                                                        std::numeric_limits<int64_t>::max()},
                                   {4}));
  t.emplace_back("i32", td::tensor({-2147483648.0, -7, 2147483647.0}, {3}, td::kInt32));
  t.emplace_back("u8", td::tensor({0, 255, 7}, {3}, td::kUInt8));           // odd byte count
  t.emplace_back("bool", td::tensor({1, 0, 1, 1, 0}, {5, 1}, td::kBool));    // odd byte count
  t.emplace_back("scalar", td::scalar_tensor(3.25, td::kFloat32));           // 0-d
  t.emplace_back("empty", td::zeros({0, 4}, td::kFloat64));                  // no bytes
  t.emplace_back("empty_i32", td::zeros({3, 0}, td::kInt32));
  t.emplace_back("transposed", td::arange(12, td::kFloat32).reshape({3, 4}).t());  // non-contiguous
  return t;
}

// ---------------------------------------------------------------------------------------------
// round trips

TEST(Safetensors, RoundTripsEveryDtypeBitExactWithMetadata) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/all.safetensors";
  const Named in = all_dtypes();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "h\xc3\xa9llo \xe2\x9c\x93"}, {"empty", ""}};
  td::save_safetensors(path, in, meta);

  const td::SafetensorsFile f = td::load_safetensors(path);
  EXPECT_EQ(f.metadata, meta);
  ASSERT_EQ(f.tensors.size(), in.size());
  for (const auto& [name, t] : in) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    const Tensor& got = f.at(name);
    EXPECT_EQ(got.dtype(), t.dtype());
    EXPECT_EQ(got.shape(), t.shape());
    // (Tensor::is_contiguous() is false for some empty shapes such as [3, 0], whose strides
    // are [1, 1]; the bytes, none, are still in row-major order.)
    if (got.numel() > 0) EXPECT_TRUE(got.is_contiguous());
    EXPECT_EQ(bytes_of(got), bytes_of(t));
  }
  // The transposed view was written in its logical (row-major) order.
  EXPECT_EQ(f.at("transposed").to_vector(), in.back().second.to_vector());
  EXPECT_THROW(f.at("nope"), td::ValueError);

  // Stored largest element first, stable: 8-byte, then 4-, 2-, 1-byte tensors, each group in the
  // caller's order; load returns the header's order.
  std::vector<std::string> order;
  for (const auto& [name, t] : f.tensors) order.push_back(name);
  EXPECT_EQ(order, (std::vector<std::string>{"f64", "i64", "empty", "f32", "i32", "scalar", "empty_i32", "transposed",
                                             "f16", "bf16", "u8", "bool"}));
}

TEST(Safetensors, HeaderIsPaddedAndEveryTensorAligned) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/all.safetensors";
  td::save_safetensors(path, all_dtypes(), {{"k", "v"}});
  const std::string bytes = read_file(path);
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[b])) << (8 * b);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  uint64_t expected_begin = 0;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    const std::map<std::string, uint64_t> size = {{"F64", 8}, {"I64", 8}, {"F32", 4}, {"I32", 4},
                                                  {"F16", 2}, {"BF16", 2}, {"U8", 1},  {"BOOL", 1}};
    EXPECT_EQ(begin, expected_begin) << name;  // header order is storage order, no gaps
    EXPECT_EQ((8 + n + begin) % size.at(e["dtype"]), 0u) << name << " starts unaligned";
    expected_begin = end;
  }
  EXPECT_EQ(8 + n + expected_begin, bytes.size());
}

TEST(Safetensors, KnownFileByteForByte) {
  // One tensor "x", F32, shape [2], values [1, -2], no metadata. The header
  //   {"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}
  // is 54 bytes, padded with 2 spaces to 56 = 0x38; 1.0f = 0x3f800000, -2.0f = 0xc0000000.
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(header.size(), 54u);
  std::string expected("\x38\x00\x00\x00\x00\x00\x00\x00", 8);
  expected += header + "  ";
  expected += std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);
  ASSERT_EQ(expected.size(), 72u);

  td::testing::TempDir dir;
  const std::string path = dir.path() + "/x.safetensors";
  td::save_safetensors(path, {{"x", td::tensor(std::vector<float>{1.0f, -2.0f}, {2})}});
  EXPECT_EQ(read_file(path), expected);

  // And the hand-made bytes load.
  write_file(path, expected);
  const td::SafetensorsFile f = td::load_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.at("x").dtype(), td::kFloat32);
  EXPECT_EQ(f.at("x").to_vector(), (std::vector<double>{1.0, -2.0}));
  EXPECT_TRUE(f.metadata.empty());
}

TEST(Safetensors, KnownFileWithMetadataByteForByte) {
  // {"__metadata__":{"a":"b"},"e":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}} is 78 bytes,
  // padded to 80 = 0x50; no data.
  const std::string header = R"({"__metadata__":{"a":"b"},"e":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
  ASSERT_EQ(header.size(), 78u);
  const std::string expected = std::string("\x50\0\0\0\0\0\0\0", 8) + header + "  ";
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/e.safetensors";
  td::save_safetensors(path, {{"e", td::zeros({0}, td::kUInt8)}}, {{"a", "b"}});
  EXPECT_EQ(read_file(path), expected);
}

TEST(Safetensors, ReadsWhatOtherWritersMayProduce) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/other.safetensors";
  // Header listed out of storage order, unpadded, with whitespace, null metadata and an unknown
  // field (Python's reader ignores unknown fields).
  std::string header = R"({ "__metadata__" : null, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8], "extra": {"x": [1, {"y": null}]}},
                          "a": {"shape": [], "data_offsets": [0, 4], "dtype": "F32"} } )";
  write_file(path, length_field(header.size()) + header + f32_bytes(2));
  const td::SafetensorsFile f = td::load_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].first, "b");  // header order
  EXPECT_EQ(f.tensors[1].first, "a");
  EXPECT_EQ(f.at("a").shape(), Shape{});
  EXPECT_EQ(f.at("a").item(), 1.0);
  EXPECT_EQ(f.at("b").to_vector(), std::vector<double>{2.0});

  // No tensors at all.
  write_file(path, make_file("{}", ""));
  EXPECT_TRUE(td::load_safetensors(path).tensors.empty());

  // An empty tensor with the largest extent whose strides still fit int64 (the one just past it
  // is refused in corrupt_cases).
  write_file(path, make_file(R"({"e":{"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,0]}})", ""));
  EXPECT_EQ(td::load_safetensors(path).at("e").shape(), (Shape{0, std::numeric_limits<int64_t>::max()}));
}

TEST(Safetensors, TiedTensorsAreWrittenUnderEachName) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/tied.safetensors";
  const Tensor w = td::tensor(std::vector<float>{1, 2, 3}, {3});
  td::save_safetensors(path, {{"embed.weight", w}, {"head.weight", w}});
  const td::SafetensorsFile f = td::load_safetensors(path);
  EXPECT_EQ(f.at("embed.weight").to_vector(), w.to_vector());
  EXPECT_EQ(f.at("head.weight").to_vector(), w.to_vector());
  EXPECT_NE(f.at("embed.weight").storage(), f.at("head.weight").storage());  // loaded untied
}

// ---------------------------------------------------------------------------------------------
// saving: argument errors and atomicity

TEST(Safetensors, SaveRejectsBadArgumentsAndLeavesTheOldFile) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/keep.safetensors";
  const Tensor a = td::ones({2});
  td::save_safetensors(path, {{"a", a}});
  const std::string before = read_file(path);

  EXPECT_THROW(td::save_safetensors(path, {{"a", a}, {"b", a}, {"a", a}}), td::ValueError);  // duplicate
  EXPECT_THROW(td::save_safetensors(path, {{"__metadata__", a}}), td::ValueError);           // reserved
  EXPECT_THROW(td::save_safetensors(path, {{"u", Tensor()}}), td::ValueError);               // undefined
  EXPECT_THROW(td::save_safetensors(path, {{"bad\xff", a}}), td::ValueError);                // not UTF-8
  EXPECT_THROW(td::save_safetensors(path, {{"a", a}}, {{"k", "\xc3"}}), td::ValueError);     // not UTF-8
  try {
    td::save_safetensors(path, {{"a", a}, {"a", a}});
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("\"a\" appears twice"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(path), before);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()), 1);
}

TEST(Safetensors, SaveIsAtomicAndReplaces) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/ckpt.safetensors";
  td::save_safetensors(path, {{"a", td::ones({4})}});
  td::save_safetensors(path, {{"b", td::full({2}, 7.0, td::kFloat64)}});
  const td::SafetensorsFile f = td::load_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].first, "b");
  EXPECT_EQ(f.at("b").to_vector(), (std::vector<double>{7, 7}));
  // The temporary "<path>.tmp.<pid>" is gone.
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) files.push_back(e.path().filename().string());
  EXPECT_EQ(files, std::vector<std::string>{"ckpt.safetensors"});

  // A directory that does not exist: IOError naming the path, nothing created.
  const std::string bad = dir.path() + "/no/such/dir/x.safetensors";
  try {
    td::save_safetensors(bad, {{"a", td::ones({1})}});
    ADD_FAILURE() << "expected IOError";
  } catch (const td::IOError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/no"));
}

// ---------------------------------------------------------------------------------------------
// loading: every kind of corruption is an IOError naming the file and the problem

struct Corrupt {
  std::string name;
  std::string bytes;
  std::string problem;  // a substring the message must contain
};

std::vector<Corrupt> corrupt_cases() {
  const std::string one = R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";  // a valid entry
  auto file = [](const std::string& header, const std::string& data) { return make_file(header, data); };
  std::vector<Corrupt> c = {
      {"empty file", "", "file is 0 bytes, shorter than the 8-byte header length"},
      {"5 bytes", std::string("\x10\0\0\0\0", 5), "file is 5 bytes, shorter than the 8-byte header length"},
      {"header past the end", length_field(1000) + "{}      ", "header length 1000 runs past the end of the file (16 bytes"},
      {"absurd header length", length_field(uint64_t{1} << 63) + "{}      ", "is over the 100000000-byte limit"},
      {"header just over the cap", length_field(100'000'001) + "{}      ", "header length 100000001 is over the"},
      {"empty header", length_field(0), "header is not valid JSON"},
      {"truncated JSON", file(R"({"x":{"dtype":"F32",)", ""), "header is not valid JSON"},
      {"JSON then garbage", file("{} x", ""), "header is not valid JSON"},
      {"NUL padding", length_field(8) + std::string("{}\0\0\0\0\0\0", 8), "header is not valid JSON: NUL byte at byte 2"},
      {"NUL then garbage", make_file(std::string("{}\0{", 4), ""), "NUL byte at byte 2"},
      {"not UTF-8", file("{\"\xff\":{}}", ""), "header is not valid JSON"},
      {"header is an array", file("[1,2]", ""), "the header must be a JSON object, got an array"},
      {"header is a number", file("5", ""), "the header must be a JSON object, got an integer"},
      {"missing dtype", file(R"({"x":{"shape":[2],"data_offsets":[0,8]}})", f32_bytes(2)), "tensor \"x\" has no \"dtype\""},
      {"missing shape", file(R"({"x":{"dtype":"F32","data_offsets":[0,8]}})", f32_bytes(2)), "tensor \"x\" has no \"shape\""},
      {"missing data_offsets", file(R"({"x":{"dtype":"F32","shape":[2]}})", f32_bytes(2)),
       "tensor \"x\" has no \"data_offsets\""},
      {"unknown dtype", file(R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", f32_bytes(2)),
       "tensor \"x\": unknown dtype \"F33\""},
      {"dtype Tandem lacks", file(R"({"x":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})", f32_bytes(2)),
       "dtype \"I8\" has no Tandem equivalent"},
      {"dtype not a string", file(R"({"x":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", f32_bytes(2)),
       "tensor \"x\": \"dtype\" must be a string, got an integer"},
      {"dtype given twice", file(R"({"x":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32_bytes(2)),
       "tensor \"x\": \"dtype\" is given twice"},
      {"negative shape", file(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32_bytes(2)),
       "\"shape\" must be a list of non-negative integers, got a negative integer"},
      {"fractional shape", file(R"({"x":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32_bytes(2)),
       "\"shape\" must be a list of non-negative integers, got a non-integer number"},
      {"shape not a list", file(R"({"x":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", f32_bytes(2)),
       "\"shape\" must be a list of non-negative integers, got an integer"},
      {"nested shape", file(R"({"x":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", f32_bytes(2)),
       "\"shape\" must be a list of non-negative integers, got an array"},
      {"shape overflows", file(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", f32_bytes(2)),
       "shape [4294967296, 4294967296, 16] has too many elements"},
      {"empty tensor whose strides overflow",
       file(R"({"x":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})", ""),
       "tensor \"x\": shape [0, 4611686018427387904, 4611686018427387904] is too large: its strides overflow int64"},
      {"three offsets", file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", f32_bytes(2)),
       "\"data_offsets\" must be a list of two non-negative integers, got more than two"},
      {"one offset", file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", f32_bytes(2)),
       "\"data_offsets\" must be a list of two non-negative integers, got 1"},
      {"offsets end before begin", file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", f32_bytes(2)),
       "tensor \"x\": data_offsets [8, 0] end before they begin"},
      {"offsets past the data", file(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f32_bytes(2)),
       "tensor \"x\": data_offsets [0, 16] run past the end of the data (8 bytes after the header)"},
      {"huge offsets", file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,18446744073709551615]}})",
                            f32_bytes(2)),
       "run past the end of the data"},
      {"offsets disagree with shape", file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32_bytes(2)),
       "tensor \"x\": data_offsets [0, 8] span 8 bytes, but shape [3] of F32 needs 12 (3 x 4)"},
      {"overlap", file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       f32_bytes(3)),
       "tensors \"a\" (data_offsets [0, 8]) and \"b\" (data_offsets [4, 12]) overlap"},
      {"same bytes twice", file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                f32_bytes(2)),
       "overlap"},
      {"gap", file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                   f32_bytes(5)),
       "gap in the data: bytes [8, 12) before tensor \"b\" belong to no tensor"},
      {"gap at the start", file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32_bytes(2)),
       "gap in the data: bytes [0, 4)"},
      {"trailing garbage", file("{" + one + "}", f32_bytes(2) + "abc"),
       "3 trailing bytes after the last tensor's data (bytes [8, 11) belong to no tensor)"},
      {"data but no tensors", file("{}", "abcd"), "4 trailing bytes"},
      {"metadata value not a string", file(R"({"__metadata__":{"k":1},)" + one + "}", f32_bytes(2)),
       "\"__metadata__\" value of \"k\" must be a string, got an integer"},
      {"metadata not an object", file(R"({"__metadata__":["k"],)" + one + "}", f32_bytes(2)),
       "\"__metadata__\" must be an object of strings, got an array"},
      {"metadata key twice", file(R"({"__metadata__":{"k":"1","k":"2"},)" + one + "}", f32_bytes(2)),
       "\"__metadata__\" has the key \"k\" twice"},
      {"duplicate name", file("{" + one + "," + one + "}", f32_bytes(2)), "the name \"x\" appears twice"},
      {"entry not an object", file(R"({"x":[0,8]})", f32_bytes(2)),
       "tensor \"x\" must be an object with \"dtype\", \"shape\" and \"data_offsets\", got an array"},
      {"entry is a string", file(R"({"x":"F32"})", ""), "tensor \"x\" must be an object"},
      {"bool byte 2", file(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x01\x02\x00", 3)),
       "tensor \"m\": BOOL element 1 is the byte 2, expected 0 or 1"},
  };
  return c;
}

TEST(Safetensors, EveryCorruptionIsAnIOErrorNamingFileAndProblem) {
  td::testing::TempDir dir;
  int i = 0;
  for (const Corrupt& c : corrupt_cases()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.path() + "/case" + std::to_string(i++) + ".safetensors";
    write_file(path, c.bytes);
    expect_io_error(path, c.problem);
  }
  expect_io_error(dir.path() + "/missing.safetensors", "cannot open: No such file or directory");
  expect_io_error(dir.path(), "not a regular file");
}

TEST(Safetensors, EveryTruncationIsAnIOError) {
  td::testing::TempDir dir;
  const std::string good = dir.path() + "/good.safetensors";
  td::save_safetensors(good, all_dtypes(), {{"k", "v"}});
  const std::string bytes = read_file(good);
  const std::string path = dir.path() + "/cut.safetensors";
  for (size_t len = 0; len < bytes.size(); ++len) {
    write_file(path, bytes.substr(0, len));
    EXPECT_FALSE(loads_or_io_error(path, fmt::format("truncated to {} of {} bytes", len, bytes.size())))
        << "a file truncated to " << len << " of " << bytes.size() << " bytes loaded";
  }
  expect_io_error(path, "run past the end of the data");  // the last one: one data byte missing
}

TEST(Safetensors, FlippedHeaderBitsNeverCrash) {
  td::testing::TempDir dir;
  const std::string good = dir.path() + "/good.safetensors";
  td::save_safetensors(good, all_dtypes(), {{"k", "v"}});
  const std::string bytes = read_file(good);
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[b])) << (8 * b);
  const std::string path = dir.path() + "/flip.safetensors";

  // Specific flips with known outcomes.
  auto flipped = [&](size_t byte, int bit) {
    std::string b = bytes;
    b[byte] = static_cast<char>(b[byte] ^ (1 << bit));
    return b;
  };
  write_file(path, flipped(8, 0));  // '{' -> 'z'
  expect_io_error(path, "header is not valid JSON");
  write_file(path, flipped(0, 7));  // header length + 128
  expect_io_error(path, "header is not valid JSON");
  write_file(path, flipped(5, 0));  // header length + 2^40
  expect_io_error(path, "is over the 100000000-byte limit");
  // The first stored tensor is "f64" (3 elements): "data_offsets":[0,24].
  const size_t digit = bytes.find("\"data_offsets\":[0,24]") + std::strlen("\"data_offsets\":[0,");
  ASSERT_LT(digit, 8 + n);
  write_file(path, flipped(digit, 4));  // '2' (0x32) -> '"' (0x22): a string runs to the next quote
  expect_io_error(path, "tensor \"f64\": \"data_offsets\" must be a list of two non-negative integers, got a string");
  write_file(path, flipped(digit, 0));  // '2' -> '3': the tensor's end moves by ten bytes
  expect_io_error(path, "tensor \"f64\": data_offsets [0, 34] span 34 bytes, but shape [3] of F64 needs 24");

  // Every single-bit flip of the length field and header: loads or IOError, never a crash.
  int errors = 0, loaded = 0;
  for (size_t byte = 0; byte < 8 + n; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      write_file(path, flipped(byte, bit));
      (loads_or_io_error(path, fmt::format("bit {} of byte {}", bit, byte)) ? loaded : errors)++;
    }
  }
  EXPECT_GT(errors, 0);
  // Flips in the padding (space <-> other whitespace is possible only for some bits) or inside a
  // name or metadata string may still load; most flips must not.
  EXPECT_GT(errors, loaded);
}

TEST(Safetensors, RandomGarbageNeverCrashes) {
  td::testing::TempDir dir;
  const std::string good = dir.path() + "/good.safetensors";
  td::save_safetensors(good, all_dtypes(), {{"k", "v"}});
  const std::string valid = read_file(good);
  const std::string path = dir.path() + "/fuzz.safetensors";
  const std::string alphabet = R"({}[]":,. -0123456789eE"FIUBOLdtypeshapedata_offsets__metadata__)";
  std::mt19937_64 rng(20240611);
  auto below = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
  int errors = 0;
  for (int i = 0; i < 200; ++i) {
    std::string b;
    switch (i % 4) {
      case 0:  // random bytes
        b.resize(below(300));
        for (char& ch : b) ch = static_cast<char>(rng());
        break;
      case 1: {  // a fitting length field, then JSON-ish noise and random data
        std::string header(below(200), ' ');
        for (char& ch : header) ch = alphabet[below(alphabet.size())];
        std::string data(below(64), '\0');
        for (char& ch : data) ch = static_cast<char>(rng());
        b = length_field(header.size()) + header + data;
        break;
      }
      case 2: {  // a valid file with a few random bytes overwritten
        b = valid;
        for (uint64_t k = 0, m = 1 + below(5); k < m; ++k) b[below(b.size())] = static_cast<char>(rng());
        break;
      }
      default: {  // a valid file with a random slice of the header cut out (length field kept)
        b = valid;
        const size_t at = 8 + below(b.size() - 8), len = below(40);
        b.erase(at, len);
        break;
      }
    }
    write_file(path, b);
    if (!loads_or_io_error(path, fmt::format("fuzz file {}", i))) ++errors;
  }
  EXPECT_GT(errors, 150);  // nearly all garbage must be refused
}

// ---------------------------------------------------------------------------------------------
// module checkpoints (nn/serialize.h)

// Deep copies of a module's state, to prove it unchanged.
Named snapshot(const nn::Module& m) {
  Named out;
  for (const auto& [n, t] : m.state_dict()) out.emplace_back(n, t.detach().clone());
  return out;
}

std::vector<std::string> names_of(const Named& named) {
  std::vector<std::string> out;
  for (const auto& [n, t] : named) out.push_back(n);
  return out;
}

void expect_same_state(const nn::Module& m, const Named& expected) {
  const Named now = m.state_dict();
  ASSERT_EQ(now.size(), expected.size());
  for (size_t i = 0; i < now.size(); ++i) {
    EXPECT_EQ(now[i].first, expected[i].first);
    EXPECT_EQ(now[i].second.dtype(), expected[i].second.dtype()) << now[i].first;
    EXPECT_EQ(bytes_of(now[i].second), bytes_of(expected[i].second)) << now[i].first;
  }
}

TEST(Serialize, ModuleRoundTripKeepsHandlesAndMetadata) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/mlp.safetensors";
  auto a = nn::models::mlp({.in_features = 6, .hidden = {5, 4}, .num_classes = 3});
  auto b = nn::models::mlp({.in_features = 6, .hidden = {5, 4}, .num_classes = 3});
  ASSERT_NE(bytes_of(a->state_dict()[0].second), bytes_of(b->state_dict()[0].second));  // different init
  nn::save_state_dict(*a, path, {{"step", "100"}});

  const Tensor w_handle = b->state_dict()[0].second;
  const std::map<std::string, std::string> meta = nn::load_state_dict_file(*b, path);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"step", "100"}}));
  expect_same_state(*b, snapshot(*a));
  EXPECT_TRUE(b->state_dict()[0].second.is_same(w_handle));  // copied in place, not rebound
  const Tensor x = td::rand({2, 6});
  EXPECT_EQ((*a)(x).to_vector(), (*b)(x).to_vector());
}

TEST(Serialize, Bf16FileIntoF32Model) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/bf16.safetensors";
  auto a = nn::models::mlp({.in_features = 6, .hidden = {5}, .num_classes = 3});
  a->to(td::kBFloat16);
  nn::save_state_dict(*a, path);
  EXPECT_EQ(td::load_safetensors(path).at("1.weight").dtype(), td::kBFloat16);

  auto b = nn::models::mlp({.in_features = 6, .hidden = {5}, .num_classes = 3});
  nn::load_state_dict_file(*b, path);
  for (const auto& [name, t] : b->state_dict()) {
    SCOPED_TRACE(name);
    EXPECT_EQ(t.dtype(), td::kFloat32);
    const Tensor expected = td::load_safetensors(path).at(name).to(td::kFloat32);  // bf16 -> f32 is exact
    EXPECT_EQ(t.to_vector(), expected.to_vector());
  }
}

TEST(Serialize, DifferentModelIsRefusedBeforeAnythingChanges) {
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/small.safetensors";
  auto a = nn::models::mlp({.in_features = 6, .hidden = {5}, .num_classes = 3});
  nn::save_state_dict(*a, path);

  // Another hidden size: the first mismatching tensor and both shapes are named, with the file.
  auto wide = nn::models::mlp({.in_features = 6, .hidden = {7}, .num_classes = 3});
  const Named before = snapshot(*wide);
  try {
    nn::load_state_dict_file(*wide, path);
    ADD_FAILURE() << "expected ValueError";
  } catch (const td::ValueError& e) {
    const std::string what = e.what();
    for (const char* part : {"\"1.weight\"", "[5, 6]", "[7, 6]"})
      EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
    EXPECT_NE(what.find(path), std::string::npos) << what;
  }
  expect_same_state(*wide, before);

  // Another depth: missing keys under strict; strict=false copies the common ones.
  auto deep = nn::models::mlp({.in_features = 6, .hidden = {5, 3}, .num_classes = 3});
  const Named deep_before = snapshot(*deep);
  try {
    nn::load_state_dict_file(*deep, path);
    ADD_FAILURE() << "expected ValueError";
  } catch (const td::ValueError& e) {
    // The file's "3.weight" is [3, 5]; the deeper model's "3.weight" is [3, 5] too, but its
    // "5.weight" / "5.bias" are missing from the file.
    EXPECT_NE(std::string(e.what()).find("missing keys: \"5.weight\", \"5.bias\""), std::string::npos) << e.what();
  }
  expect_same_state(*deep, deep_before);
  nn::load_state_dict_file(*deep, path, /*strict=*/false);
  EXPECT_EQ(bytes_of(deep->state_dict()[0].second), bytes_of(a->state_dict()[0].second));
  EXPECT_EQ(bytes_of(deep->state_dict().back().second), bytes_of(deep_before.back().second));  // not in the file

  // A corrupt file: IOError, model unchanged.
  std::string bytes = read_file(path);
  bytes.pop_back();
  write_file(path, bytes);
  const Named a_before = snapshot(*a);
  EXPECT_THROW(nn::load_state_dict_file(*a, path), td::IOError);
  expect_same_state(*a, a_before);
}

// An embedding and an output layer sharing one weight (tied), or two separate weights of the
// same names and shapes (untied).
struct TiedModel : nn::Module {
  explicit TiedModel(bool tied) : Module("TiedModel") {
    emb = register_module("emb", std::make_shared<nn::Embedding>(5, 4));
    head = register_module("head", std::make_shared<nn::Module>("Head"));
    head_weight = head->register_parameter("weight", tied ? emb->weight : td::randn({5, 4}));
  }
  std::shared_ptr<nn::Embedding> emb;
  std::shared_ptr<nn::Module> head;
  Tensor head_weight;
};

TEST(Serialize, TiedWeightLoadsFromEitherOfItsNames) {
  // Python's safetensors.torch.save_model stores a shared tensor once, under one name, with
  // metadata {"other name": "kept name"} (save_file refuses shared tensors); Tandem stores it
  // under every name. Both must load strictly into a tied model.
  td::testing::TempDir dir;
  TiedModel a(true);
  ASSERT_TRUE(a.head_weight.is_same(a.emb->weight));
  EXPECT_EQ(names_of(a.state_dict()), (std::vector<std::string>{"emb.weight", "head.weight"}));
  const Tensor w = td::randn({5, 4});
  const std::string both = dir.path() + "/both.safetensors";
  nn::save_state_dict(a, both);
  const std::string emb_only = dir.path() + "/emb_only.safetensors";
  td::save_safetensors(emb_only, {{"emb.weight", w}}, {{"head.weight", "emb.weight"}});
  const std::string head_only = dir.path() + "/head_only.safetensors";
  td::save_safetensors(head_only, {{"head.weight", w}});

  TiedModel b(true);
  nn::load_state_dict_file(b, both);
  EXPECT_EQ(bytes_of(b.emb->weight), bytes_of(a.emb->weight));
  for (const std::string& path : {emb_only, head_only}) {
    SCOPED_TRACE(path);
    TiedModel c(true);
    const Tensor handle = c.emb->weight;
    nn::IncompatibleKeys keys{{"stale"}, {"stale"}};
    nn::load_state_dict_file(c, path, /*strict=*/true, &keys);
    EXPECT_TRUE(keys.missing_keys.empty() && keys.unexpected_keys.empty());
    EXPECT_EQ(bytes_of(c.emb->weight), bytes_of(w));
    EXPECT_TRUE(c.emb->weight.is_same(handle) && c.head_weight.is_same(handle));  // still one tensor
  }

  // An untied model needs both names: the one-name file is refused under strict (model unchanged)
  // and loads its one tensor otherwise, reporting the other as missing.
  TiedModel u(false);
  const Named before = snapshot(u);
  try {
    nn::load_state_dict_file(u, emb_only);
    ADD_FAILURE() << "expected ValueError";
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("missing keys: \"head.weight\""), std::string::npos) << e.what();
  }
  expect_same_state(u, before);
  nn::IncompatibleKeys keys;
  nn::load_state_dict_file(u, emb_only, /*strict=*/false, &keys);
  EXPECT_EQ(keys.missing_keys, std::vector<std::string>{"head.weight"});
  EXPECT_TRUE(keys.unexpected_keys.empty());
  EXPECT_EQ(bytes_of(u.emb->weight), bytes_of(w));
  EXPECT_EQ(bytes_of(u.head_weight), bytes_of(before[1].second));
}

TEST(Serialize, NonStrictLoadReportsMissingAndUnexpectedKeys) {
  // PyTorch's load_state_dict(strict=False) returns the keys it did not match; a checkpoint whose
  // names all differ (say, saved with a "module." prefix) then shows up as such, not as a silent
  // no-op.
  td::testing::TempDir dir;
  auto shallow = nn::models::mlp({.in_features = 6, .hidden = {5}, .num_classes = 3});
  auto deep = nn::models::mlp({.in_features = 6, .hidden = {5, 3}, .num_classes = 3});
  const std::string shallow_path = dir.path() + "/shallow.safetensors", deep_path = dir.path() + "/deep.safetensors";
  nn::save_state_dict(*shallow, shallow_path);
  nn::save_state_dict(*deep, deep_path);

  nn::IncompatibleKeys keys;
  nn::load_state_dict_file(*deep, shallow_path, /*strict=*/false, &keys);
  EXPECT_EQ(keys.missing_keys, (std::vector<std::string>{"5.weight", "5.bias"}));
  EXPECT_TRUE(keys.unexpected_keys.empty());
  nn::load_state_dict_file(*shallow, deep_path, /*strict=*/false, &keys);
  EXPECT_TRUE(keys.missing_keys.empty());
  EXPECT_EQ(keys.unexpected_keys, (std::vector<std::string>{"5.weight", "5.bias"}));
  nn::load_state_dict_file(*shallow, shallow_path, /*strict=*/true, &keys);
  EXPECT_TRUE(keys.missing_keys.empty() && keys.unexpected_keys.empty());

  // Module::load_state_dict directly: every name prefixed, nothing matches, all of it reported.
  nn::StateDict prefixed;
  for (const auto& [name, t] : shallow->state_dict()) prefixed.emplace_back("module." + name, td::zeros(t.shape()));
  const Named before = snapshot(*shallow);
  const nn::IncompatibleKeys none = shallow->load_state_dict(prefixed, /*strict=*/false);
  EXPECT_EQ(none.missing_keys, (std::vector<std::string>{"1.weight", "1.bias", "3.weight", "3.bias"}));
  EXPECT_EQ(none.unexpected_keys, names_of(prefixed));
  expect_same_state(*shallow, before);

  // An undefined tensor in a hand-made state dict: ValueError naming it, nothing copied.
  nn::StateDict with_hole = shallow->state_dict();
  for (auto& [name, t] : with_hole) t = td::zeros(t.shape());
  with_hole.back().second = Tensor();
  try {
    shallow->load_state_dict(with_hole);
    ADD_FAILURE() << "expected ValueError";
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("\"3.bias\" is an undefined tensor"), std::string::npos) << e.what();
  }
  expect_same_state(*shallow, before);
}

}  // namespace
