// safetensors reading and writing (format in safetensors.h). The reader parses the header with a
// SAX handler that accepts only the shape of a safetensors header, so hostile JSON never builds a
// large document, then checks every offset before it allocates or reads a single tensor.
#include "tandem/core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <set>

#include <nlohmann/json.hpp>

#include "tandem/autograd/grad_mode.h"

namespace tandem {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

// ---- dtypes ----

struct DTypeSpelling {
  DType dtype;
  std::string_view name;
};
constexpr std::array<DTypeSpelling, 8> kSpellings{{{DType::f32, "F32"},
                                                   {DType::f64, "F64"},
                                                   {DType::f16, "F16"},
                                                   {DType::bf16, "BF16"},
                                                   {DType::i64, "I64"},
                                                   {DType::i32, "I32"},
                                                   {DType::u8, "U8"},
                                                   {DType::b8, "BOOL"}}};
constexpr const char* kSupportedList = "F32, F64, F16, BF16, I64, I32, U8, BOOL";
// safetensors dtypes that Tandem has no tensor type for: recognised, so the error can say so.
constexpr std::array<std::string_view, 13> kForeignDTypes{"I8",      "I16",     "U16",     "U32",     "U64",
                                                          "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4",      "F6_E2M3",
                                                          "F6_E3M2", "C64",     "F8_E4M3FNUZ"};

// ---- file descriptors ----

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting close's error (a deferred write error on some filesystems).
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

std::string os_error() { return std::strerror(errno); }

// ---- header parsing ----

// One tensor entry of the header, as written (validated afterwards).
struct Entry {
  std::string name;
  std::string dtype;
  Shape shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// A SAX handler for nlohmann::json that accepts exactly the structure of a safetensors header:
//   depth 1: the top-level object, keys are tensor names and "__metadata__";
//   depth 2: a tensor entry's object (or __metadata__'s object of strings);
//   depth 3: the "shape" / "data_offsets" arrays of non-negative integers.
// Unknown fields inside a tensor entry are skipped (as Python's reader ignores them). The first
// problem is recorded in `error` and stops the parse (a handler method returning false).
class HeaderSax {
 public:
  using json = nlohmann::json;

  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  std::string error;

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(json::number_integer_t) { return scalar("a negative integer"); }
  bool number_unsigned(json::number_unsigned_t v) {
    if (skip_ == 0 && depth_ == 3) return array_element(v);
    return scalar("an integer");
  }
  bool number_float(json::number_float_t, const std::string&) { return scalar("a non-integer number"); }
  bool binary(json::binary_t&) { return scalar("binary data"); }  // never produced by text JSON

  bool string(std::string& s) {
    if (skip_ > 0) return true;
    if (depth_ == 2 && in_metadata_) {
      metadata.emplace(meta_key_, std::move(s));
      return true;
    }
    if (depth_ == 2 && field_ == Field::dtype) {
      entries.back().dtype = std::move(s);
      return true;
    }
    return scalar("a string");
  }

  bool start_object(std::size_t) { return open("an object", true); }
  bool start_array(std::size_t) { return open("an array", false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    if (skip_ > 0) return true;
    if (depth_ == 1) {
      if (!names_.insert(k).second) return fail(fmt::format("the name \"{}\" appears twice", k));
      top_key_ = std::move(k);
      return true;
    }
    // depth 2
    if (in_metadata_) {
      if (metadata.count(k)) return fail(fmt::format("\"__metadata__\" has the key \"{}\" twice", k));
      meta_key_ = std::move(k);
      return true;
    }
    Entry& e = entries.back();
    bool* seen = nullptr;
    if (k == "dtype") field_ = Field::dtype, seen = &e.has_dtype;
    else if (k == "shape") field_ = Field::shape, seen = &e.has_shape;
    else if (k == "data_offsets") field_ = Field::offsets, seen = &e.has_offsets;
    else field_ = Field::other;
    if (seen != nullptr) {
      if (*seen) return fail(fmt::format("tensor \"{}\": \"{}\" is given twice", e.name, k));
      *seen = true;
    }
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    // ex.what() reads "[json.exception.parse_error.101] parse error at line 1, column 9: ...".
    std::string what = ex.what();
    if (const size_t p = what.find("] "); what.starts_with("[json.exception") && p != std::string::npos)
      what = what.substr(p + 2);
    return fail(fmt::format("header is not valid JSON (at byte {} of the header): {}", position, what));
  }

 private:
  enum class Field { dtype, shape, offsets, other };

  bool fail(std::string message) {
    if (error.empty()) error = std::move(message);
    return false;
  }

  // What a value in the current position must be, for error messages.
  std::string expected_here() const {
    if (depth_ == 0) return "the header must be a JSON object";
    if (depth_ == 1) {
      if (top_key_ == "__metadata__") return "\"__metadata__\" must be an object of strings";
      return fmt::format("tensor \"{}\" must be an object with \"dtype\", \"shape\" and \"data_offsets\"", top_key_);
    }
    if (in_metadata_) return fmt::format("\"__metadata__\" value of \"{}\" must be a string", meta_key_);
    const std::string& name = entries.back().name;
    switch (field_) {
      case Field::dtype: return fmt::format("tensor \"{}\": \"dtype\" must be a string", name);
      case Field::shape: return fmt::format("tensor \"{}\": \"shape\" must be a list of non-negative integers", name);
      case Field::offsets:
        return fmt::format("tensor \"{}\": \"data_offsets\" must be a list of two non-negative integers", name);
      case Field::other: break;
    }
    return "unexpected value";
  }

  // A null, boolean, number or string where no special case above took it.
  bool scalar(const char* got) {
    if (skip_ > 0) return true;
    if (depth_ == 1 && top_key_ == "__metadata__" && std::string_view(got) == "null") return true;  // no metadata
    if (depth_ == 2 && !in_metadata_ && field_ == Field::other) return true;  // an ignored field
    return fail(fmt::format("{}, got {}", expected_here(), got));
  }

  bool array_element(uint64_t v) {
    Entry& e = entries.back();
    if (field_ == Field::shape) {
      if (v > static_cast<uint64_t>(INT64_MAX)) return fail(fmt::format("tensor \"{}\": shape entry {} is too large", e.name, v));
      e.shape.push_back(static_cast<int64_t>(v));
    } else {
      if (e.offsets.size() == 2) return fail(fmt::format("{}, got more than two", expected_here()));
      e.offsets.push_back(v);
    }
    return true;
  }

  bool open(const char* got, bool object) {
    if (skip_ > 0) {
      ++skip_;
      return true;
    }
    switch (depth_) {
      case 0:
        if (!object) return fail(fmt::format("{}, got {}", expected_here(), got));
        break;
      case 1:
        if (!object) return fail(fmt::format("{}, got {}", expected_here(), got));
        in_metadata_ = top_key_ == "__metadata__";
        if (!in_metadata_) {
          entries.emplace_back();
          entries.back().name = top_key_;
        }
        break;
      case 2:
        if (!in_metadata_ && field_ == Field::other) {  // an ignored field: skip its value whole
          skip_ = 1;
          return true;
        }
        if (in_metadata_ || field_ == Field::dtype || object) return fail(fmt::format("{}, got {}", expected_here(), got));
        break;
      default:
        return fail(fmt::format("{}, got {}", expected_here(), got));
    }
    ++depth_;
    return true;
  }

  bool close() {
    if (skip_ > 0) {
      --skip_;
      return true;
    }
    if (depth_ == 3 && field_ == Field::offsets && entries.back().offsets.size() != 2)
      return fail(fmt::format("{}, got {}", expected_here(), entries.back().offsets.size()));
    if (depth_ == 2 && !in_metadata_) {
      const Entry& e = entries.back();
      for (auto [has, what] : {std::pair{e.has_dtype, "dtype"}, {e.has_shape, "shape"}, {e.has_offsets, "data_offsets"}})
        if (!has) return fail(fmt::format("tensor \"{}\" has no \"{}\"", e.name, what));
    }
    if (depth_ == 2) in_metadata_ = false;
    --depth_;
    return true;
  }

  int depth_ = 0;  // open containers, not counting skipped ones
  int skip_ = 0;   // > 0: inside an ignored field's value; counts its open containers
  bool in_metadata_ = false;
  Field field_ = Field::other;
  std::string top_key_, meta_key_;
  std::set<std::string> names_;
};

// Reads exactly n bytes at `offset`; false at end of file.
bool pread_all(int fd, void* dst, size_t n, uint64_t offset) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= static_cast<size_t>(got), offset += static_cast<uint64_t>(got);
  }
  return true;
}

void write_all(int fd, const void* src, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) throw IOError(fmt::format("save_safetensors: writing {} failed: {}", path, os_error()));
    p += put, n -= static_cast<size_t>(put);
  }
}

// Throws ValueError when `s` is not valid UTF-8 (JSON strings must be).
void check_utf8(const std::string& s, const std::string& what) {
  try {
    (void)nlohmann::json(s).dump();
  } catch (const nlohmann::json::type_error&) {
    throw ValueError(fmt::format("save_safetensors: {} is not valid UTF-8", what));
  }
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  for (const auto& s : kSpellings)
    if (s.dtype == dtype) return s.name;
  throw DTypeError("safetensors_dtype_name: unknown dtype");
}

std::optional<DType> safetensors_dtype_from_name(std::string_view name) {
  for (const auto& s : kSpellings)
    if (s.name == name) return s.dtype;
  return std::nullopt;
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw ValueError(fmt::format("SafetensorsFile: no tensor named \"{}\" (the file has {} tensors)", name, tensors.size()));
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const auto& p) { return p.first == name; });
}

// ---------------------------------------------------------------------------------------------
// save

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Works as follows: validate every argument, take contiguous copies where needed, order the
  // tensors by element size (largest first) so each starts aligned, build the header, then write
  // length + header + data to a temporary file that is fsync'ed and renamed over `path`.

  // ---- validate (nothing is written when an argument is wrong) ----
  std::set<std::string> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    check_utf8(name, fmt::format("the name of tensor {}", i));
    TANDEM_CHECK(name != "__metadata__", ValueError,
                 "save_safetensors: \"__metadata__\" is reserved for the metadata and cannot name a tensor ({})", path);
    TANDEM_CHECK(seen.insert(name).second, ValueError, "save_safetensors: the name \"{}\" appears twice ({})", name,
                 path);
    TANDEM_CHECK(t.defined(), ValueError, "save_safetensors: tensor \"{}\" is undefined ({})", name, path);
    TANDEM_CHECK(t.device().type == DeviceType::cpu, ValueError,
                 "save_safetensors: tensor \"{}\" is not on the CPU; copy it to the CPU first ({})", name, path);
  }
  for (const auto& [k, v] : metadata) {
    check_utf8(k, "a metadata key");
    check_utf8(v, fmt::format("the metadata value of \"{}\"", k));
  }

  // ---- contiguous data, stored largest element size first ----
  std::vector<Tensor> data(tensors.size());
  {
    NoGradGuard no_grad;
    for (size_t i = 0; i < tensors.size(); ++i) data[i] = tensors[i].second.detach().contiguous();
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return data[a].element_size() > data[b].element_size(); });

  // ---- header: {"__metadata__": {...}, name: {dtype, shape, data_offsets}, ...}, space-padded ----
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const uint64_t nbytes = data[i].nbytes();
    header[tensors[i].first] = {{"dtype", std::string(safetensors_dtype_name(data[i].dtype()))},
                                {"shape", data[i].shape()},
                                {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::array<unsigned char, 8> length{};
  for (size_t b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * b));

  // ---- write the temporary, make it durable, rename it over `path` ----
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw IOError(fmt::format("save_safetensors: cannot create {}: {}", tmp, os_error()));
  try {
    write_all(fd.get(), length.data(), length.size(), tmp);
    write_all(fd.get(), text.data(), text.size(), tmp);
    for (size_t i : order)
      if (data[i].nbytes() > 0) write_all(fd.get(), data[i].data_ptr(), data[i].nbytes(), tmp);
    if (::fsync(fd.get()) != 0) throw IOError(fmt::format("save_safetensors: fsync of {} failed: {}", tmp, os_error()));
    if (fd.close() != 0) throw IOError(fmt::format("save_safetensors: closing {} failed: {}", tmp, os_error()));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw IOError(fmt::format("save_safetensors: cannot rename {} to {}: {}", tmp, path, os_error()));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable; best effort (some filesystems refuse to fsync a directory).
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  Fd dfd(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() >= 0) (void)::fsync(dfd.get());
}

// ---------------------------------------------------------------------------------------------
// load

SafetensorsFile load_safetensors(const std::string& path) {
  // Works as follows: check the 8-byte length against the file size and the cap, parse the header
  // into entries with the SAX handler, check each entry (dtype, shape x element size = extent,
  // inside the data) and that the entries tile the data exactly, and only then allocate each
  // tensor and read its bytes.
  auto fail = [&](const std::string& problem) { return IOError(fmt::format("load_safetensors: {}: {}", path, problem)); };

  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw fail(fmt::format("cannot open: {}", os_error()));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw fail(fmt::format("cannot stat: {}", os_error()));
  if (!S_ISREG(st.st_mode)) throw fail("not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  // ---- header length ----
  if (file_size < 8) throw fail(fmt::format("file is {} bytes, shorter than the 8-byte header length", file_size));
  std::array<unsigned char, 8> length{};
  if (!pread_all(fd.get(), length.data(), 8, 0)) throw fail("cannot read the header length");
  uint64_t header_size = 0;
  for (size_t b = 0; b < 8; ++b) header_size |= static_cast<uint64_t>(length[b]) << (8 * b);
  if (header_size > kSafetensorsMaxHeaderBytes)
    throw fail(fmt::format("header length {} is over the {}-byte limit (corrupt length field?)", header_size,
                           kSafetensorsMaxHeaderBytes));
  if (header_size > file_size - 8)
    throw fail(fmt::format("header length {} runs past the end of the file ({} bytes, {} after the length field)",
                           header_size, file_size, file_size - 8));
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;

  // ---- header JSON ----
  std::string text(header_size, '\0');
  if (!pread_all(fd.get(), text.data(), text.size(), 8)) throw fail("cannot read the header");
  // nlohmann's lexer takes a NUL byte for the end of input and would ignore what follows it.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    throw fail(fmt::format("header is not valid JSON: NUL byte at byte {} of the header", nul));
  HeaderSax sax;
  if (!nlohmann::json::sax_parse(text, &sax) || !sax.error.empty())
    throw fail(sax.error.empty() ? std::string("header is not valid JSON") : sax.error);

  // ---- each entry on its own ----
  struct Span {
    uint64_t begin, end;
  };
  std::vector<DType> dtypes;
  std::vector<Span> spans;
  for (const Entry& e : sax.entries) {
    const std::optional<DType> dtype = safetensors_dtype_from_name(e.dtype);
    if (!dtype) {
      if (std::find(kForeignDTypes.begin(), kForeignDTypes.end(), e.dtype) != kForeignDTypes.end())
        throw fail(fmt::format("tensor \"{}\": dtype \"{}\" has no Tandem equivalent (supported: {})", e.name, e.dtype,
                               kSupportedList));
      throw fail(fmt::format("tensor \"{}\": unknown dtype \"{}\" (expected one of {})", e.name, e.dtype, kSupportedList));
    }
    uint64_t numel = 1, nbytes = 0;
    for (int64_t s : e.shape)
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel))
        throw fail(fmt::format("tensor \"{}\": shape {} has too many elements", e.name, shape_str(e.shape)));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(element_size(*dtype)), &nbytes))
      throw fail(fmt::format("tensor \"{}\": shape {} has too many elements", e.name, shape_str(e.shape)));
    // A tensor's contiguous strides multiply its extents, a 0 counted as 1: an empty tensor of
    // shape [0, 2^62, 2^62] has no bytes, but its strides would overflow int64.
    int64_t stride_span = 1;
    for (int64_t s : e.shape)
      if (__builtin_mul_overflow(stride_span, std::max<int64_t>(s, 1), &stride_span))
        throw fail(fmt::format("tensor \"{}\": shape {} is too large: its strides overflow int64", e.name,
                               shape_str(e.shape)));
    const uint64_t begin = e.offsets[0], end = e.offsets[1];
    if (end < begin) throw fail(fmt::format("tensor \"{}\": data_offsets [{}, {}] end before they begin", e.name, begin, end));
    if (end > data_size)
      throw fail(fmt::format("tensor \"{}\": data_offsets [{}, {}] run past the end of the data ({} bytes after the header)",
                             e.name, begin, end, data_size));
    if (end - begin != nbytes)
      throw fail(fmt::format("tensor \"{}\": data_offsets [{}, {}] span {} bytes, but shape {} of {} needs {} ({} x {})",
                             e.name, begin, end, end - begin, shape_str(e.shape), e.dtype, nbytes, numel,
                             element_size(*dtype)));
    dtypes.push_back(*dtype);
    spans.push_back({begin, end});
  }

  // ---- together the entries tile [0, data_size) exactly ----
  std::vector<size_t> by_offset(spans.size());
  std::iota(by_offset.begin(), by_offset.end(), size_t{0});
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) {
    return std::pair{spans[a].begin, spans[a].end} < std::pair{spans[b].begin, spans[b].end};
  });
  uint64_t covered = 0;  // data bytes [0, covered) belong to the tensors seen so far
  size_t last = 0;       // the tensor that ends at `covered`
  for (size_t i : by_offset) {
    const Span& s = spans[i];
    if (s.begin < covered)
      throw fail(fmt::format("tensors \"{}\" (data_offsets [{}, {}]) and \"{}\" (data_offsets [{}, {}]) overlap",
                             sax.entries[last].name, spans[last].begin, spans[last].end, sax.entries[i].name, s.begin,
                             s.end));
    if (s.begin > covered)
      throw fail(fmt::format("gap in the data: bytes [{}, {}) before tensor \"{}\" belong to no tensor", covered, s.begin,
                             sax.entries[i].name));
    covered = s.end;
    last = i;
  }
  if (covered != data_size)
    throw fail(fmt::format("{} trailing bytes after the last tensor's data (bytes [{}, {}) belong to no tensor)",
                           data_size - covered, covered, data_size));

  // ---- read ----
  SafetensorsFile out;
  out.metadata = std::move(sax.metadata);
  out.tensors.reserve(sax.entries.size());
  for (size_t i = 0; i < sax.entries.size(); ++i) {
    Entry& e = sax.entries[i];
    Tensor t = empty(e.shape, dtypes[i]);
    const size_t nbytes = spans[i].end - spans[i].begin;
    if (nbytes > 0 && !pread_all(fd.get(), t.data_ptr(), nbytes, data_start + spans[i].begin))
      throw fail(fmt::format("tensor \"{}\": cannot read its {} bytes (file truncated while reading?)", e.name, nbytes));
    if (dtypes[i] == DType::b8) {
      // Any byte but 0 and 1 is not a C++ bool; reading it would be undefined behaviour.
      const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
      for (size_t j = 0; j < nbytes; ++j)
        if (bytes[j] > 1)
          throw fail(fmt::format("tensor \"{}\": BOOL element {} is the byte {}, expected 0 or 1", e.name, j,
                               static_cast<int>(bytes[j])));
    }
    out.tensors.emplace_back(std::move(e.name), std::move(t));
  }
  return out;
}

}  // namespace tandem
