// The TCPStore server (internal to tcp_store*.cc): one thread, one poll() loop over non-blocking
// sockets, holding the map. Invariant: the loop never blocks on a peer; a blocked get/wait is a
// parked request answered when its keys appear, and a bad peer loses only its own connection.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

namespace tandem::dist {

class TCPStoreServer {
 public:
  // Binds `port` (0: a free one) on all interfaces and starts serving; throws CommError when the
  // port cannot be bound. An empty token accepts every client.
  TCPStoreServer(uint16_t port, std::string token);
  ~TCPStoreServer();  // wakes and joins the thread, closes every socket; noexcept
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  uint16_t port() const { return port_; }

 private:
  struct Loop;
  void run() noexcept;

  std::string token_;
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: the destructor writes to stop the loop
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem::dist
