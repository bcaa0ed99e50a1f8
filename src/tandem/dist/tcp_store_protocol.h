// Wire format of TCPStore (internal to tcp_store*.cc). A frame is a little-endian u64 body length
// followed by the body. Request body: u8 op, then fields; strings and values are u64 length +
// bytes, counts are u64. Reply body: u8 status, then the op's result or an error message.
// Invariant: every length is checked against its bound before anything is allocated for it.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "tandem/dist/store.h"
#include "tandem/dist/tcp_store.h"

namespace tandem::dist::wire {

inline constexpr uint32_t kMagic = 0x54445331;  // "TDS1", first field of HELLO
enum class Op : uint8_t { kHello = 1, kSet, kGet, kAdd, kCompareSet, kWait, kCheck, kDelete, kNumKeys };
enum class Status : uint8_t { kOk = 0, kError = 1, kAuthRejected = 2 };

// Largest request body: compare_set with two maximal values, or wait with maximal keys.
inline constexpr uint64_t kMaxFrameBytes = 2 * kStoreMaxValueBytes + (1 << 20);
// Largest hello body: op, magic and a maximal token.
inline constexpr uint64_t kMaxHelloBytes = 1 + 4 + 8 + kStoreMaxKeyBytes;
static_assert(kStoreMaxWaitKeys * (kStoreMaxKeyBytes + 8) < (1 << 20) + 2 * kStoreMaxValueBytes);

class Writer {
 public:
  Writer() { out_.resize(8); }  // room for the length prefix
  Writer& u8(uint8_t v) { out_.push_back(v); return *this; }
  Writer& u32(uint32_t v) { return raw(&v, 4); }
  Writer& u64(uint64_t v) { return raw(&v, 8); }
  Writer& i64(int64_t v) { return raw(&v, 8); }
  Writer& bytes(const void* data, size_t n) { u64(n); return raw(data, n); }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& bytes(const Bytes& b) { return bytes(b.data(), b.size()); }
  // The finished frame with its length prefix filled in.
  Bytes finish() {
    uint64_t n = out_.size() - 8;
    std::memcpy(out_.data(), &n, 8);
    return std::move(out_);
  }

 private:
  Writer& raw(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + n);
    return *this;
  }
  Bytes out_;
};

// Reads fields from one frame body; every accessor returns nullopt instead of reading past the
// end or accepting a length over `max`.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  std::optional<uint8_t> u8() { uint8_t v; return raw(&v, 1) ? std::optional(v) : std::nullopt; }
  std::optional<uint32_t> u32() { uint32_t v; return raw(&v, 4) ? std::optional(v) : std::nullopt; }
  std::optional<uint64_t> u64() { uint64_t v; return raw(&v, 8) ? std::optional(v) : std::nullopt; }
  std::optional<int64_t> i64() { int64_t v; return raw(&v, 8) ? std::optional(v) : std::nullopt; }
  std::optional<std::string> str(uint64_t max) {
    auto n = u64();
    if (!n || *n > max || *n > remaining()) return std::nullopt;
    std::string s(reinterpret_cast<const char*>(p_), *n);
    p_ += *n;
    return s;
  }
  std::optional<Bytes> bytes(uint64_t max) {
    auto n = u64();
    if (!n || *n > max || *n > remaining()) return std::nullopt;
    Bytes b(p_, p_ + *n);
    p_ += *n;
    return b;
  }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  bool done() const { return p_ == end_; }

 private:
  bool raw(void* out, size_t n) {
    if (remaining() < n) return false;
    std::memcpy(out, p_, n);
    p_ += n;
    return true;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace tandem::dist::wire
