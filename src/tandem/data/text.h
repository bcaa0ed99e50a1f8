// Language-model datasets: random windows of a token stream. TextBytes reads text files as
// bytes (vocabulary 256); TokenFile maps a uint16 token file as nanoGPT and llm.c write them.
// Invariant: example i is a pure function of (seed, i) — the window start is drawn from a Philox
// stream keyed by seed at counter i — so any worker, thread count or resumed run gets the same one.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"

namespace tandem::data {

// Start of the window of example i: uniform in [0, length - window] from Philox(key seed,
// counter i). Requires length >= window.
int64_t window_start(uint64_t seed, int64_t i, int64_t length, int64_t window);

// The concatenated bytes of text files. Example i is {input, target}: input int64 [context] =
// bytes[s, s + context), target int64 [context] = bytes[s + 1, s + context + 1), for a start s
// drawn from (seed, i). Immutable, thread-safe.
class TextBytes : public Dataset {
 public:
  // Debian's license texts: about 240 KB of English on every Debian machine.
  static constexpr const char* kDefaultCorpus = "/usr/share/common-licenses";

  // `paths`: files and directories, concatenated in the order given; a directory contributes
  // every regular file directly in it (symbolic links to files included), sorted by name.
  // samples_per_epoch: size(); 0 means (corpus_size - 1) / context, the number of disjoint windows.
  // Throws IOError naming the path when a path does not exist or cannot be read, or when the
  // corpus is shorter than context + 1 bytes (naming the paths and the size found); ValueError
  // when context < 1 or samples_per_epoch < 0.
  explicit TextBytes(std::vector<std::string> paths = {kDefaultCorpus}, int64_t context = 256, uint64_t seed = 0,
                     int64_t samples_per_epoch = 0);

  int64_t size() const override { return samples_; }
  Example get(int64_t i) const override;

  int64_t context() const { return context_; }
  uint64_t seed() const { return seed_; }
  int64_t corpus_size() const { return static_cast<int64_t>(bytes_->size()); }
  std::span<const uint8_t> bytes() const { return *bytes_; }
  // The files read, in order.
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::shared_ptr<const std::vector<uint8_t>> bytes_;
  std::vector<std::string> files_;
  int64_t context_;
  uint64_t seed_;
  int64_t samples_;
};

// A flat array of little-endian uint16 tokens: nanoGPT's train.bin (np.uint16, no header) or an
// llm.c .bin (a 1024-byte header of 256 int32: magic 20240520, version 1, token count; then the
// tokens), recognised by its magic. A file starting with an llm.c magic is never read as raw
// tokens: a truncated one, a wrong version or llm.c's LLaMA-3 format (magic 20240801, uint32
// tokens) is an IOError. The file is memory-mapped read-only, not read. Example i as
// in TextBytes: {input int64 [context], target int64 [context] shifted by one}. Immutable,
// thread-safe; copies share the mapping.
class TokenFile : public Dataset {
 public:
  static constexpr int32_t kLlmcMagic = 20240520;        // GPT-2 tokens, uint16, version 1
  static constexpr int32_t kLlmcLlama3Magic = 20240801;  // LLaMA-3 tokens, uint32 (rejected)
  static constexpr int64_t kLlmcHeaderBytes = 1024;

  // samples_per_epoch: size(); 0 means (num_tokens - 1) / context.
  // Throws IOError naming the path when it is missing or cannot be mapped, when its size is odd
  // (naming the size), when its llm.c header does not match its size (naming both) or is not
  // version 1, or when it holds fewer than context + 1 tokens (naming the count);
  // ValueError when context < 1 or samples_per_epoch < 0.
  TokenFile(const std::string& path, int64_t context, uint64_t seed = 0, int64_t samples_per_epoch = 0);

  int64_t size() const override { return samples_; }
  Example get(int64_t i) const override;

  int64_t context() const { return context_; }
  uint64_t seed() const { return seed_; }
  int64_t num_tokens() const { return num_tokens_; }
  // Token t (0 <= t < num_tokens()), unchecked.
  uint16_t token(int64_t t) const;
  bool has_llmc_header() const { return header_; }
  const std::string& path() const { return path_; }

 private:
  struct Mapping;
  std::shared_ptr<const Mapping> map_;
  const unsigned char* tokens_ = nullptr;  // inside map_
  std::string path_;
  int64_t num_tokens_ = 0;
  bool header_ = false;
  int64_t context_;
  uint64_t seed_;
  int64_t samples_;
};

}  // namespace tandem::data
