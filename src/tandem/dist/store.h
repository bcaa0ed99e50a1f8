// Key-value stores for rendezvous, after PyTorch c10d's Store: processes meet on a store to
// agree on ranks and exchange addresses. Invariant: every blocking call (get, wait) returns or
// throws Timeout within the store's timeout; nothing here waits forever.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tandem/dist/error.h"

namespace tandem::dist {

using Bytes = std::vector<uint8_t>;

// Bytes <-> text helpers for callers that store strings.
Bytes to_bytes(std::string_view text);
std::string to_string(const Bytes& bytes);

// The store interface (c10d names and semantics).
//
// Thread safety: every implementation here may be called from several threads at once.
// Timeouts: get() and the one-argument wait() use the store's timeout (default 30 min,
// set_timeout changes it); they throw Timeout naming the key(s) and the timeout.
class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{30 * 60 * 1000};

  explicit Store(std::chrono::milliseconds timeout = kDefaultTimeout);
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Sets `key` to `value`, replacing any previous value; wakes waiters on the key.
  virtual void set(const std::string& key, const Bytes& value) = 0;
  void set(const std::string& key, std::string_view value) { set(key, to_bytes(value)); }

  // The value of `key`; blocks until the key exists, throws Timeout after timeout().
  virtual Bytes get(const std::string& key) = 0;

  // Adds `delta` to the counter at `key` (a missing key counts as 0) and returns the new value.
  // The counter is stored as decimal text, so get() of it reads e.g. "42". Throws ValueError
  // when the key holds something that is not a decimal int64, or on overflow.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Atomic compare-and-set (c10d semantics): if the key is missing and `expected` is empty, or
  // the key holds `expected`, sets it to `desired` and returns `desired`. Otherwise returns the
  // current value, or `expected` when the key is missing.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;

  // Blocks until every key exists; throws Timeout naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  // Whether every key exists right now; never blocks on keys.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // Removes `key`; returns whether it existed.
  virtual bool delete_key(const std::string& key) = 0;

  // The number of keys in the store (for a PrefixStore: in the store underneath, as in c10d).
  virtual int64_t num_keys() = 0;

  // The timeout of get() and wait(keys); must be positive and at most 365 days (there is no
  // "wait forever").
  virtual void set_timeout(std::chrono::milliseconds timeout);
  virtual std::chrono::milliseconds timeout() const;

 private:
  std::atomic<int64_t> timeout_ms_;
};

// In-process store for tests and for ranks that are threads: a map under one mutex, waiters on
// a condition variable with deadlines.
class HashStore final : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = kDefaultTimeout) : Store(timeout) {}

  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;  // notified whenever a key is created or changed
  std::unordered_map<std::string, Bytes> map_;
};

// A view of another store in which every key is "prefix/key": groups and rendezvous rounds
// share one TCPStore without their keys colliding. The timeout is the inner store's.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  void set(const std::string& key, const Bytes& value) override;
  using Store::set;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  void set_timeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override;

  const std::shared_ptr<Store>& underlying_store() const { return store_; }

 private:
  std::string join(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> join(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

namespace detail {
// Parses a decimal int64 counter value for add(); throws ValueError naming `key` otherwise.
int64_t parse_counter(const std::string& key, const Bytes& value);
// current + delta, throwing ValueError naming `key` on overflow.
int64_t checked_add(const std::string& key, int64_t current, int64_t delta);
// "a", "b", ... (at most a few, then "and N more") for error messages.
std::string quote_keys(const std::vector<std::string>& keys);
// The longest timeout accepted anywhere (365 days): a deadline now + timeout must not overflow
// (milliseconds::max() is not "forever": it timed out at once).
inline constexpr std::chrono::milliseconds kMaxTimeout{int64_t{365} * 24 * 3600 * 1000};
// Throws ValueError naming `what` unless 0 < timeout <= kMaxTimeout.
void check_timeout(std::chrono::milliseconds timeout, const char* what);
}  // namespace detail

}  // namespace tandem::dist
