// Store base, HashStore and PrefixStore. HashStore's invariant: cv_ is notified after every
// change to map_, so a waiter re-checks its keys whenever one may have appeared.
#include "tandem/dist/store.h"

#include <charconv>
#include <limits>

namespace tandem::dist {

Bytes to_bytes(std::string_view text) { return Bytes(text.begin(), text.end()); }
std::string to_string(const Bytes& bytes) { return std::string(bytes.begin(), bytes.end()); }

namespace detail {

int64_t parse_counter(const std::string& key, const Bytes& value) {
  const char* begin = reinterpret_cast<const char*>(value.data());
  const char* end = begin + value.size();
  int64_t out = 0;
  auto [ptr, ec] = std::from_chars(begin, end, out);
  TANDEM_CHECK(!value.empty() && ec == std::errc() && ptr == end, ValueError,
               "store: add(\"{}\"): the key holds {} bytes that are not a decimal int64 counter", key,
               value.size());
  return out;
}

int64_t checked_add(const std::string& key, int64_t current, int64_t delta) {
  int64_t out = 0;
  TANDEM_CHECK(!__builtin_add_overflow(current, delta, &out), ValueError,
               "store: add(\"{}\", {}): counter {} would overflow int64", key, delta, current);
  return out;
}

std::string quote_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 4;
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += "\"" + keys[i] + "\"";
  }
  if (keys.size() > kShown) out += fmt::format(" and {} more", keys.size() - kShown);
  return out;
}

void check_timeout(std::chrono::milliseconds timeout, const char* what) {
  TANDEM_CHECK(timeout.count() > 0 && timeout <= kMaxTimeout, ValueError,
               "{}: timeout must be positive and at most {} ms (365 days), got {} ms; there is no \"wait forever\" "
               "(every blocking wait has a deadline): give a finite timeout",
               what, kMaxTimeout.count(), timeout.count());
}

}  // namespace detail

// ---- Store ----

Store::Store(std::chrono::milliseconds timeout) : timeout_ms_(0) { Store::set_timeout(timeout); }

void Store::set_timeout(std::chrono::milliseconds timeout) {
  detail::check_timeout(timeout, "store");
  timeout_ms_.store(timeout.count());
}

std::chrono::milliseconds Store::timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }

// ---- HashStore ----

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard lock(mu_);
    map_[key] = value;
  }
  cv_.notify_all();
}

Bytes HashStore::get(const std::string& key) {
  const auto limit = timeout();
  std::unique_lock lock(mu_);
  const bool found = cv_.wait_for(lock, limit, [&] { return map_.count(key) != 0; });
  if (!found) {
    throw Timeout(fmt::format("store: get(\"{}\") timed out after {} ms waiting for the key (HashStore)", key,
                              limit.count()));
  }
  return map_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard lock(mu_);
    auto it = map_.find(key);
    const int64_t current = it == map_.end() ? 0 : detail::parse_counter(key, it->second);
    value = detail::checked_add(key, current, delta);
    map_[key] = to_bytes(std::to_string(value));
  }
  cv_.notify_all();
  return value;
}

Bytes HashStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::unique_lock lock(mu_);
  auto it = map_.find(key);
  if ((it == map_.end() && expected.empty()) || (it != map_.end() && it->second == expected)) {
    map_[key] = desired;
    lock.unlock();
    cv_.notify_all();
    return desired;
  }
  return it == map_.end() ? expected : it->second;
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  detail::check_timeout(timeout, "store: wait");
  std::unique_lock lock(mu_);
  auto all_present = [&] {
    for (const auto& key : keys)
      if (map_.count(key) == 0) return false;
    return true;
  };
  if (cv_.wait_for(lock, timeout, all_present)) return;
  std::vector<std::string> missing;
  for (const auto& key : keys)
    if (map_.count(key) == 0) missing.push_back(key);
  throw Timeout(fmt::format("store: wait() timed out after {} ms; missing keys: {} (HashStore)", timeout.count(),
                            detail::quote_keys(missing)));
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(mu_);
  for (const auto& key : keys)
    if (map_.count(key) == 0) return false;
  return true;
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard lock(mu_);
  return map_.erase(key) != 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard lock(mu_);
  return static_cast<int64_t>(map_.size());
}

// ---- PrefixStore ----

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : prefix_(std::move(prefix)), store_(std::move(store)) {
  TANDEM_CHECK(store_ != nullptr, ValueError, "PrefixStore(\"{}\"): the underlying store is null", prefix_);
}

std::vector<std::string> PrefixStore::join(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(join(key));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(join(key), value); }
Bytes PrefixStore::get(const std::string& key) { return store_->get(join(key)); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return store_->add(join(key), delta); }
Bytes PrefixStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return store_->compare_set(join(key), expected, desired);
}
void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  store_->wait(join(keys), timeout);
}
bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(join(keys)); }
bool PrefixStore::delete_key(const std::string& key) { return store_->delete_key(join(key)); }
int64_t PrefixStore::num_keys() { return store_->num_keys(); }
void PrefixStore::set_timeout(std::chrono::milliseconds timeout) { store_->set_timeout(timeout); }
std::chrono::milliseconds PrefixStore::timeout() const { return store_->timeout(); }

}  // namespace tandem::dist
