// FileStore: a Store in one file on a filesystem every rank sees (init_method "file:///path"),
// after c10d's FileStore. The file is an append-only log of set/delete records; every call takes
// an flock() on it (and a mutex, for this object's threads), replays the log and appends. Blocking calls poll with growing sleeps (1..20 ms)
// up to their timeout. Meant for rendezvous (a few keys), not for traffic.
#pragma once

#include <mutex>
#include <string>

#include "tandem/dist/store.h"

namespace tandem::dist {

class FileStore final : public Store {
 public:
  // Creates the file if missing. Throws IOError naming the path when it cannot be opened.
  explicit FileStore(std::string path, std::chrono::milliseconds timeout = kDefaultTimeout);
  ~FileStore() override;

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

  const std::string& path() const { return path_; }

 private:
  class Locked;  // the file locked, its log replayed into a map
  std::string path_;
  int fd_ = -1;
  // flock() excludes other open file descriptions only; this one's threads share fd_, so they
  // take this mutex first (c10d's FileStore locks a mutex too).
  std::mutex mu_;
};

}  // namespace tandem::dist
