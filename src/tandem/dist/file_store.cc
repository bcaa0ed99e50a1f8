// FileStore: an flock()-guarded append-only log of records
//   [u8 kind: 1 set, 2 delete][u32 key length][key][u32 value length][value]  (little endian).
#include "tandem/dist/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;

void put_u32(Bytes& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace

class FileStore::Locked {
 public:
  Locked(std::mutex& mu, int fd, const std::string& path) : guard_(mu), fd_(fd), path_(path) {
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) throw IOError(fmt::format("FileStore {}: flock failed: {}", path_, std::strerror(errno)));
    }
    replay();
  }
  ~Locked() { flock(fd_, LOCK_UN); }

  std::map<std::string, Bytes> map;

  void append(uint8_t kind, const std::string& key, const Bytes& value) {
    Bytes rec;
    rec.push_back(kind);
    put_u32(rec, static_cast<uint32_t>(key.size()));
    rec.insert(rec.end(), key.begin(), key.end());
    put_u32(rec, static_cast<uint32_t>(value.size()));
    rec.insert(rec.end(), value.begin(), value.end());
    const off_t end = lseek(fd_, 0, SEEK_END);
    size_t done = 0;
    while (done < rec.size()) {
      const ssize_t n = pwrite(fd_, rec.data() + done, rec.size() - done, end + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw IOError(fmt::format("FileStore {}: write failed: {}", path_, std::strerror(errno)));
      done += static_cast<size_t>(n);
    }
    if (kind == 1) map[key] = value;
    else map.erase(key);
  }

 private:
  void replay() {
    Bytes data;
    const off_t size = lseek(fd_, 0, SEEK_END);
    data.resize(static_cast<size_t>(size));
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = pread(fd_, data.data() + done, data.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    size_t i = 0;
    auto u32 = [&](uint32_t& v) {
      if (i + 4 > done) return false;
      v = 0;
      for (int k = 0; k < 4; ++k) v |= static_cast<uint32_t>(data[i + k]) << (8 * k);
      i += 4;
      return true;
    };
    while (i < done) {
      const uint8_t kind = data[i++];
      uint32_t klen = 0, vlen = 0;
      TANDEM_CHECK((kind == 1 || kind == 2) && u32(klen) && i + klen <= done, IOError,
                   "FileStore {}: corrupt record at byte {} (is another program writing this file?)", path_, i);
      std::string key(reinterpret_cast<const char*>(data.data() + i), klen);
      i += klen;
      TANDEM_CHECK(u32(vlen) && i + vlen <= done, IOError, "FileStore {}: truncated record at byte {}", path_, i);
      if (kind == 1) map[key] = Bytes(data.begin() + static_cast<ptrdiff_t>(i), data.begin() + static_cast<ptrdiff_t>(i + vlen));
      else map.erase(key);
      i += vlen;
    }
  }

  std::lock_guard<std::mutex> guard_;  // first: held before the flock, released after it
  int fd_;
  const std::string& path_;
};

FileStore::FileStore(std::string path, std::chrono::milliseconds timeout) : Store(timeout), path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  TANDEM_CHECK(fd_ >= 0, IOError, "FileStore: cannot open {}: {} (the directory must exist and be writable)",
               path_, std::strerror(errno));
}

FileStore::~FileStore() {
  if (fd_ >= 0) ::close(fd_);
}

void FileStore::set(const std::string& key, const Bytes& value) {
  Locked l(mu_, fd_, path_);
  l.append(1, key, value);
}

Bytes FileStore::get(const std::string& key) {
  wait({key}, timeout());
  Locked l(mu_, fd_, path_);
  auto it = l.map.find(key);
  TANDEM_CHECK(it != l.map.end(), CommError, "FileStore {}: key '{}' was deleted while get() waited", path_, key);
  return it->second;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  Locked l(mu_, fd_, path_);
  int64_t current = 0;
  if (auto it = l.map.find(key); it != l.map.end()) current = detail::parse_counter(key, it->second);
  const int64_t v = detail::checked_add(key, current, delta);
  l.append(1, key, to_bytes(std::to_string(v)));
  return v;
}

Bytes FileStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Locked l(mu_, fd_, path_);
  auto it = l.map.find(key);
  if (it == l.map.end()) {
    if (expected.empty()) {
      l.append(1, key, desired);
      return desired;
    }
    return expected;
  }
  if (it->second == expected) {
    l.append(1, key, desired);
    return desired;
  }
  return it->second;
}

void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  detail::check_timeout(timeout, "FileStore: wait");
  const auto deadline = Clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  for (;;) {
    std::vector<std::string> missing;
    {
      Locked l(mu_, fd_, path_);
      for (const auto& k : keys) {
        if (!l.map.count(k)) missing.push_back(k);
      }
    }
    if (missing.empty()) return;
    if (Clock::now() >= deadline) {
      throw Timeout(fmt::format("FileStore {}: waited {} ms for key(s) {}", path_, timeout.count(),
                                detail::quote_keys(missing)));
    }
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        sleep, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()) + std::chrono::milliseconds(1)));
    sleep = std::min(sleep * 2, std::chrono::milliseconds(20));
  }
}

bool FileStore::check(const std::vector<std::string>& keys) {
  Locked l(mu_, fd_, path_);
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return l.map.count(k) > 0; });
}

bool FileStore::delete_key(const std::string& key) {
  Locked l(mu_, fd_, path_);
  if (!l.map.count(key)) return false;
  l.append(2, key, {});
  return true;
}

int64_t FileStore::num_keys() {
  Locked l(mu_, fd_, path_);
  return static_cast<int64_t>(l.map.size());
}

}  // namespace tandem::dist
