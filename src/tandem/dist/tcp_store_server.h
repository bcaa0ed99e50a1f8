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
  // Serves on `listen_fd`, a non-blocking socket already listening on `port` (dist::spawn binds it
  // before forking, so no other process can take the port in between); closed by the destructor.
  TCPStoreServer(int listen_fd, uint16_t port, std::string token);
  // A non-blocking, close-on-exec socket listening on `port` (0: a free one) on all interfaces;
  // `*bound` gets the port. Throws CommError when the port cannot be bound.
  static int listen_on(uint16_t port, uint16_t* bound);
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
