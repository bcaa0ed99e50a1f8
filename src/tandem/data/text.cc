#include "tandem/data/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "tandem/core/rng.h"

namespace tandem::data {

int64_t window_start(uint64_t seed, int64_t i, int64_t length, int64_t window) {
  const auto r4 = philox4x32(static_cast<uint64_t>(i), 0, seed);
  const uint64_t r = (uint64_t{r4[0]} << 32) | r4[1];
  const auto count = static_cast<uint64_t>(length - window + 1);  // possible starts
  return static_cast<int64_t>((static_cast<unsigned __int128>(r) * count) >> 64);
}

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t k = 0; k < v.size(); ++k) s += (k ? ", " : "") + v[k];
  return s;
}

// {input = w[0, context), target = w[1, context + 1)} for the window w starting at `start`.
template <class Get>
Example make_window(int64_t context, int64_t start, Get get) {
  Tensor input = empty({context}, kInt64);
  Tensor target = empty({context}, kInt64);
  auto* x = input.data_ptr<int64_t>();
  auto* y = target.data_ptr<int64_t>();
  for (int64_t t = 0; t < context; ++t) {
    x[t] = get(start + t);
    y[t] = get(start + t + 1);
  }
  return {input, target};
}

void read_append(const std::string& path, std::vector<uint8_t>& out) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), IOError, "TextBytes: {}: cannot open: {}", path, std::strerror(errno));
  out.insert(out.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  TANDEM_CHECK(!in.bad(), IOError, "TextBytes: {}: read error", path);
}

}  // namespace

// ---- TextBytes ----

TextBytes::TextBytes(std::vector<std::string> paths, int64_t context, uint64_t seed, int64_t samples_per_epoch)
    : context_(context), seed_(seed) {
  namespace fs = std::filesystem;
  TANDEM_CHECK(context >= 1, ValueError, "TextBytes: context must be >= 1, got {}", context);
  TANDEM_CHECK(samples_per_epoch >= 0, ValueError, "TextBytes: samples_per_epoch must be >= 0, got {}",
               samples_per_epoch);
  TANDEM_CHECK(!paths.empty(), ValueError, "TextBytes: expected at least one file or directory, got none");
  for (const std::string& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> in_dir;
      fs::directory_iterator it(p, ec);
      TANDEM_CHECK(!ec, IOError, "TextBytes: {}: cannot list the directory: {}", p, ec.message());
      for (; it != fs::directory_iterator(); it.increment(ec)) {
        // Its regular files (through symlinks); a dangling link or another entry is skipped.
        std::error_code entry_ec;
        if (fs::is_regular_file(it->path(), entry_ec)) in_dir.push_back(it->path().string());
      }
      TANDEM_CHECK(!ec, IOError, "TextBytes: {}: cannot list the directory: {}", p, ec.message());
      std::sort(in_dir.begin(), in_dir.end());
      files_.insert(files_.end(), in_dir.begin(), in_dir.end());
    } else {
      TANDEM_CHECK(fs::is_regular_file(p, ec), IOError, "TextBytes: {}: no such file or directory", p);
      files_.push_back(p);
    }
  }
  auto bytes = std::make_shared<std::vector<uint8_t>>();
  for (const std::string& f : files_) read_append(f, *bytes);
  // size > context, not size >= context + 1: that sum overflows for context = INT64_MAX.
  TANDEM_CHECK(static_cast<int64_t>(bytes->size()) > context, IOError,
               "TextBytes: the corpus {} holds {} bytes ({} files), shorter than context + 1 = {} bytes", join(paths),
               bytes->size(), files_.size(), static_cast<uint64_t>(context) + 1);
  bytes_ = std::move(bytes);
  samples_ = samples_per_epoch > 0 ? samples_per_epoch : (corpus_size() - 1) / context;
}

Example TextBytes::get(int64_t i) const {
  check_index(i, "TextBytes");
  const int64_t start = window_start(seed_, i, corpus_size(), context_ + 1);
  const uint8_t* b = bytes_->data();
  return make_window(context_, start, [b](int64_t t) { return static_cast<int64_t>(b[t]); });
}

// ---- TokenFile ----

struct TokenFile::Mapping {
  void* addr = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (addr != MAP_FAILED) munmap(addr, bytes);
  }
};

TokenFile::TokenFile(const std::string& path, int64_t context, uint64_t seed, int64_t samples_per_epoch)
    : path_(path), context_(context), seed_(seed) {
  TANDEM_CHECK(context >= 1, ValueError, "TokenFile: context must be >= 1, got {}", context);
  TANDEM_CHECK(samples_per_epoch >= 0, ValueError, "TokenFile: samples_per_epoch must be >= 0, got {}",
               samples_per_epoch);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, IOError, "TokenFile: {}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IOError(fmt::format("TokenFile: {}: cannot stat: {}", path, std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IOError(fmt::format("TokenFile: {}: not a regular file", path));
  }
  const auto size = static_cast<int64_t>(st.st_size);
  if (size % 2 != 0) {
    ::close(fd);
    throw IOError(fmt::format("TokenFile: {}: size {} bytes is odd; expected uint16 tokens (2 bytes each)", path, size));
  }
  auto map = std::make_shared<Mapping>();
  if (size > 0) {
    map->addr = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    map->bytes = static_cast<size_t>(size);
  }
  const int map_errno = errno;
  ::close(fd);
  TANDEM_CHECK(size == 0 || map->addr != MAP_FAILED, IOError, "TokenFile: {}: cannot map {} bytes: {}", path, size,
               std::strerror(map_errno));
  const auto* data = static_cast<const unsigned char*>(size > 0 ? map->addr : nullptr);
  // An llm.c file announces itself by its magic. Once announced it must be a whole uint16 llm.c
  // file: read as raw tokens instead, its header would become 512 bogus tokens and a truncated
  // file would train silently (raw GPT-2 tokens are < 50257, so no raw file starts with either
  // magic, whose low halves are 55240 and 55713).
  if (size >= 4) {
    int32_t h[3] = {0, 0, 0};
    std::memcpy(h, data, static_cast<size_t>(std::min<int64_t>(size, sizeof(h))));
    if constexpr (std::endian::native == std::endian::big) {
      for (int32_t& v : h) v = static_cast<int32_t>(__builtin_bswap32(static_cast<uint32_t>(v)));
    }
    if (h[0] == kLlmcMagic || h[0] == kLlmcLlama3Magic) {
      TANDEM_CHECK(size >= kLlmcHeaderBytes, IOError,
                   "TokenFile: {}: starts with llm.c's magic {} but holds {} bytes, less than its {}-byte header "
                   "(truncated?)",
                   path, h[0], size, kLlmcHeaderBytes);
      TANDEM_CHECK(h[0] == kLlmcMagic, IOError,
                   "TokenFile: {}: an llm.c LLaMA-3 file (magic {}, version {}) holds uint32 tokens; TokenFile reads "
                   "uint16 tokens (llm.c's GPT-2 files, magic {}, or nanoGPT's headerless .bin)",
                   path, h[0], h[1], kLlmcMagic);
      TANDEM_CHECK(h[1] == 1, IOError, "TokenFile: {}: llm.c header version {}, expected 1 (uint16 tokens)", path,
                   h[1]);
      const int64_t expected = int64_t{h[2]} * 2 + kLlmcHeaderBytes;
      TANDEM_CHECK(h[2] >= 0 && expected == size, IOError,
                   "TokenFile: {}: the llm.c header announces {} tokens ({} bytes with the header) but the file holds "
                   "{} bytes (truncated or appended to?)",
                   path, h[2], expected, size);
      header_ = true;
    }
  }
  tokens_ = data ? data + (header_ ? kLlmcHeaderBytes : 0) : nullptr;
  num_tokens_ = (size - (header_ ? kLlmcHeaderBytes : 0)) / 2;
  TANDEM_CHECK(num_tokens_ > context, IOError,  // not >= context + 1: that overflows for INT64_MAX
               "TokenFile: {}: holds {} tokens ({} bytes), fewer than context + 1 = {}", path, num_tokens_, size,
               static_cast<uint64_t>(context) + 1);
  map_ = std::move(map);
  samples_ = samples_per_epoch > 0 ? samples_per_epoch : (num_tokens_ - 1) / context;
}

uint16_t TokenFile::token(int64_t t) const {
  const unsigned char* p = tokens_ + 2 * t;
  return static_cast<uint16_t>(p[0] | (p[1] << 8));  // little-endian on any host
}

Example TokenFile::get(int64_t i) const {
  check_index(i, "TokenFile");
  const int64_t start = window_start(seed_, i, num_tokens_, context_ + 1);
  return make_window(context_, start, [this](int64_t t) { return static_cast<int64_t>(token(t)); });
}

}  // namespace tandem::data
