// TCPStore: the c10d rendezvous store over TCP. The master process runs a single-threaded,
// poll()-based server holding the map; every process (the master too) talks to it through a
// client connection. Invariant: the server never blocks on one peer and never trusts a length
// it has not bounded; a bad peer loses its own connection and nothing else.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tandem/dist/store.h"

namespace tandem::dist {

struct TCPStoreOptions {
  bool is_master = false;                          // run the server in this process
  std::optional<int64_t> world_size;               // processes that will join (for wait_for_workers)
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;  // connect, get, wait, worker join
  bool wait_for_workers = true;                    // master: block in the constructor until world_size joined
  // Shared secret of the job. nullopt: $TANDEM_STORE_TOKEN if set, else none. The server refuses a
  // connection whose first frame does not carry it; clients send theirs.
  std::optional<std::string> token;
};

// Protocol limits; a frame past any of them closes its connection.
inline constexpr int64_t kStoreMaxKeyBytes = 4 << 10;      // also the token
inline constexpr int64_t kStoreMaxValueBytes = 64 << 20;
inline constexpr int64_t kStoreMaxWaitKeys = 4096;

class TCPStoreServer;  // tcp_store_server.h

// Thread safety: any number of threads may call one TCPStore at once; each call in flight uses its
// own connection (idle ones are pooled), so a get blocked in one thread does not stop a set in
// another. A connection that timed out or broke is dropped; the next call opens a new one, retrying
// within its timeout.
//
// Throws: CommError when the server cannot be reached within the timeout (naming host:port and
// the errno text), refuses our token, or closes the connection; Timeout when get/wait/connect run
// out of time (naming the key, host:port and the timeout); ValueError for oversized keys/values.
class TCPStore final : public Store {
 public:
  // port 0 on the master binds a free port; port() tells which.
  TCPStore(std::string host, uint16_t port, TCPStoreOptions options = {});
  ~TCPStore() override;  // stops the server (if master) and closes sockets; noexcept

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

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }
  bool is_master() const { return server_ != nullptr; }

 private:
  struct Reply;
  // Sends one request and reads its reply, reconnecting first if needed; `what` names the call
  // for errors, e.g. get("rank0").
  Reply roundtrip(const std::string& what, const Bytes& request, std::chrono::milliseconds timeout);
  // Opens and authenticates a connection, retrying refused connects until the deadline.
  int connect(std::chrono::steady_clock::time_point deadline);
  void release(int fd);  // back to the idle pool
  void close_idle() noexcept;
  void wait_for_workers();
  std::string peer() const;

  std::string host_;
  uint16_t port_;
  TCPStoreOptions options_;
  std::string token_;
  std::unique_ptr<TCPStoreServer> server_;
  std::mutex mu_;               // guards idle_fds_
  std::vector<int> idle_fds_;   // connected, authenticated, no request in flight
};

}  // namespace tandem::dist
