// TCPStore server. Works as follows: poll() watches a wake pipe, the listening socket and every
// connection. Bytes read are appended to the connection's input buffer; complete frames are
// parsed and answered one at a time, in order. A get/wait whose keys are missing parks the
// connection (its later frames stay buffered) and registers it under each missing key; a change
// to a key re-checks the connections parked on it. Replies go to an output buffer flushed as the
// socket allows. Anything malformed, oversized or unauthenticated marks the connection dead with
// a reason (logged) and it is closed at the end of the iteration; nothing else is affected.
#include "tandem/dist/tcp_store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "tandem/dist/error.h"
#include "tandem/dist/tcp_store_protocol.h"

namespace tandem::dist {

namespace {

constexpr size_t kReadChunk = 64 << 10;
constexpr int kReadChunksPerEvent = 16;          // fairness: at most 1 MiB per connection per turn
constexpr size_t kOutHighWater = 4 << 20;        // stop answering a peer that does not read
constexpr size_t kMaxConnections = 16384;

void log_server(const std::string& message) { fmt::print(stderr, "tandem store server: {}\n", message); }

std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char ip[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], ip, sizeof(ip));
    else inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
    port = ntohs(a->sin6_port);
  }
  return fmt::format("{}:{}", ip, port);
}

// Compares without an early exit, so the time taken does not reveal a matching prefix.
bool same_token(const std::string& a, const std::string& b) {
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

int bind_listener(uint16_t port, uint16_t* bound) {
  // Dual-stack IPv6 first (serves IPv4 clients too), plain IPv4 where IPv6 is unavailable.
  int last_errno = 0;
  for (int family : {AF_INET6, AF_INET}) {
    int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) { last_errno = errno; continue; }
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(port);
      len = sizeof(sockaddr_in6);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(port);
      len = sizeof(sockaddr_in);
    }
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, SOMAXCONN) != 0) {
      last_errno = errno;
      close(fd);
      continue;
    }
    len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    *bound = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                      : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    return fd;
  }
  throw CommError(fmt::format(
      "TCPStore server: cannot listen on port {}: {}{}", port, std::strerror(last_errno),
      last_errno == EADDRINUSE ? "; another process holds that port (an earlier run still alive, another job): set "
                                 "MASTER_PORT (tandem run: --master-port) to a free port"
                               : ""));
}

}  // namespace

// ---- the loop's state, touched only by the server thread ----

struct TCPStoreServer::Loop {
  struct Pending {
    bool is_get = false;              // get(key) replies with the value; wait(keys) with OK
    std::vector<std::string> keys;
  };
  struct Conn {
    int fd = -1;
    std::string peer;
    Bytes in;
    size_t in_off = 0;                // bytes of `in` already consumed
    Bytes out;
    size_t out_off = 0;               // bytes of `out` already sent
    bool authed = false;
    bool closing = false;             // close once `out` is flushed (after an auth rejection)
    std::string dead;                 // non-empty: close at the end of the iteration, log if !quiet
    bool quiet = false;
    std::optional<Pending> pending;
  };

  const std::string& token;
  std::unordered_map<std::string, Bytes> map;
  std::map<int, std::unique_ptr<Conn>> conns;
  std::unordered_map<std::string, std::set<int>> waiters;  // key -> fds parked on it (may be stale)
  std::vector<int> runnable;                                // fds whose buffered frames may proceed

  explicit Loop(const std::string& t) : token(t) {}

  static void kill(Conn& c, std::string reason, bool quiet = false) {
    if (c.dead.empty()) {
      c.dead = std::move(reason);
      c.quiet = quiet;
    }
  }

  void flush(Conn& c) {
    while (c.out_off < c.out.size() && c.dead.empty()) {
      ssize_t n = send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        kill(c, fmt::format("send failed: {}", std::strerror(errno)), true);
      }
    }
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
      if (c.closing) kill(c, "closed after refusing it", true);
    }
  }

  void reply(Conn& c, Bytes frame) {
    if (c.out.empty()) c.out = std::move(frame);
    else c.out.insert(c.out.end(), frame.begin(), frame.end());
    flush(c);
  }
  static Bytes ok() { return wire::Writer().u8(uint8_t(wire::Status::kOk)).finish(); }

  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!map.count(k)) return false;
    return true;
  }

  // Answers a parked request if its keys are all present now; else (re)parks it on the missing ones.
  void try_complete(Conn& c) {
    if (!c.pending || !c.dead.empty()) return;
    Pending& p = *c.pending;
    if (!all_present(p.keys)) {
      for (const auto& k : p.keys)
        if (!map.count(k)) waiters[k].insert(c.fd);
      return;
    }
    if (p.is_get) reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).bytes(map.at(p.keys[0])).finish());
    else reply(c, ok());
    unpark(c);
    runnable.push_back(c.fd);
  }

  void unpark(Conn& c) {
    if (!c.pending) return;
    for (const auto& k : c.pending->keys) {
      auto it = waiters.find(k);
      if (it == waiters.end()) continue;
      it->second.erase(c.fd);
      if (it->second.empty()) waiters.erase(it);
    }
    c.pending.reset();
  }

  void changed(const std::string& key) {
    auto it = waiters.find(key);
    if (it == waiters.end()) return;
    std::set<int> fds = std::move(it->second);
    waiters.erase(it);
    for (int fd : fds) {
      auto c = conns.find(fd);
      if (c != conns.end()) try_complete(*c->second);
    }
  }

  std::optional<std::vector<std::string>> read_keys(wire::Reader& r) {
    auto n = r.u64();
    if (!n || *n > uint64_t(kStoreMaxWaitKeys)) return std::nullopt;
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < *n; ++i) {
      auto k = r.str(kStoreMaxKeyBytes);
      if (!k) return std::nullopt;
      keys.push_back(std::move(*k));
    }
    return keys;
  }

  // Handles one complete request body.
  void handle(Conn& c, const uint8_t* body, size_t size) {
    using wire::Op;
    wire::Reader r(body, size);
    auto op = r.u8();
    auto malformed = [&](const char* what) { kill(c, fmt::format("malformed {} request ({} bytes)", what, size)); };
    if (!c.authed) {
      if (!op || Op(*op) != Op::kHello) return kill(c, fmt::format("first frame is not a hello (op {})", op ? *op : -1));
      auto magic = r.u32();
      auto tok = r.str(kStoreMaxKeyBytes);
      if (!magic || *magic != wire::kMagic || !tok || !r.done()) return malformed("hello");
      if (!token.empty() && !same_token(*tok, token)) {
        log_server(fmt::format("refusing {}: {} token", c.peer, tok->empty() ? "missing" : "wrong"));
        c.closing = true;
        reply(c, wire::Writer().u8(uint8_t(wire::Status::kAuthRejected)).str("token rejected").finish());
        return;
      }
      c.authed = true;
      return reply(c, ok());
    }
    switch (op ? Op(*op) : Op(0)) {
      case Op::kSet: {
        auto key = r.str(kStoreMaxKeyBytes);
        auto value = key ? r.bytes(kStoreMaxValueBytes) : std::nullopt;
        if (!value || !r.done()) return malformed("set");
        map[*key] = std::move(*value);
        reply(c, ok());
        return changed(*key);
      }
      case Op::kGet: {
        auto key = r.str(kStoreMaxKeyBytes);
        if (!key || !r.done()) return malformed("get");
        c.pending = Pending{true, {std::move(*key)}};
        return try_complete(c);
      }
      case Op::kAdd: {
        auto key = r.str(kStoreMaxKeyBytes);
        auto delta = key ? r.i64() : std::nullopt;
        if (!delta || !r.done()) return malformed("add");
        int64_t value = 0;
        try {
          auto it = map.find(*key);
          value = detail::checked_add(*key, it == map.end() ? 0 : detail::parse_counter(*key, it->second), *delta);
        } catch (const Error& e) {
          return reply(c, wire::Writer().u8(uint8_t(wire::Status::kError)).str(e.what()).finish());
        }
        map[*key] = to_bytes(std::to_string(value));
        reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).i64(value).finish());
        return changed(*key);
      }
      case Op::kCompareSet: {
        auto key = r.str(kStoreMaxKeyBytes);
        auto expected = key ? r.bytes(kStoreMaxValueBytes) : std::nullopt;
        auto desired = expected ? r.bytes(kStoreMaxValueBytes) : std::nullopt;
        if (!desired || !r.done()) return malformed("compare_set");
        auto it = map.find(*key);
        if ((it == map.end() && expected->empty()) || (it != map.end() && it->second == *expected)) {
          map[*key] = *desired;
          reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).bytes(*desired).finish());
          return changed(*key);
        }
        const Bytes& current = it == map.end() ? *expected : it->second;
        return reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).bytes(current).finish());
      }
      case Op::kWait: {
        auto keys = read_keys(r);
        if (!keys || !r.done()) return malformed("wait");
        c.pending = Pending{false, std::move(*keys)};
        return try_complete(c);
      }
      case Op::kCheck: {
        auto keys = read_keys(r);
        if (!keys || !r.done()) return malformed("check");
        return reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).u8(all_present(*keys)).finish());
      }
      case Op::kDelete: {
        auto key = r.str(kStoreMaxKeyBytes);
        if (!key || !r.done()) return malformed("delete_key");
        return reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).u8(map.erase(*key) != 0).finish());
      }
      case Op::kNumKeys: {
        if (!r.done()) return malformed("num_keys");
        return reply(c, wire::Writer().u8(uint8_t(wire::Status::kOk)).i64(int64_t(map.size())).finish());
      }
      default:
        return kill(c, fmt::format("unknown op {}", op ? int(*op) : -1));
    }
  }

  // Parses and answers buffered frames until one parks, the peer stops reading, or data runs out.
  void process(Conn& c) {
    while (c.dead.empty() && !c.closing && !c.pending && c.out.size() < kOutHighWater) {
      const size_t avail = c.in.size() - c.in_off;
      if (avail < 8) break;
      uint64_t len = 0;
      std::memcpy(&len, c.in.data() + c.in_off, 8);
      // Before the hello is accepted only a hello may come, so a stranger can make us buffer ~4 KiB.
      const uint64_t max_len = c.authed ? wire::kMaxFrameBytes : wire::kMaxHelloBytes;
      if (len == 0 || len > max_len) {
        return kill(c, fmt::format("frame length {} outside [1, {}]{}", len, max_len, c.authed ? "" : " before hello"));
      }
      if (avail - 8 < len) break;
      handle(c, c.in.data() + c.in_off + 8, static_cast<size_t>(len));
      c.in_off += 8 + static_cast<size_t>(len);
    }
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > (1 << 20) && c.in_off * 2 > c.in.size()) {
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_off));
      c.in_off = 0;
    }
    // A parked or non-reading peer may buffer at most one more maximal frame.
    if (c.in.size() - c.in_off > 8 + wire::kMaxFrameBytes) kill(c, "sent more than a frame while its request waits");
  }

  void read_from(Conn& c) {
    uint8_t buf[kReadChunk];
    for (int i = 0; i < kReadChunksPerEvent && c.dead.empty(); ++i) {
      ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.insert(c.in.end(), buf, buf + n);
        if (static_cast<size_t>(n) < sizeof(buf)) break;
      } else if (n == 0) {
        // An abrupt disconnect is normal (a client timed out or exited); it only matters mid-frame.
        const bool mid_frame = c.in.size() > c.in_off;
        return kill(c, mid_frame ? "disconnected in the middle of a frame" : "disconnected", !mid_frame);
      } else if (errno == EINTR) {
        continue;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        break;
      } else {
        return kill(c, fmt::format("recv failed: {}", std::strerror(errno)), true);
      }
    }
  }

  void sweep() {
    for (auto it = conns.begin(); it != conns.end();) {
      Conn& c = *it->second;
      if (c.dead.empty()) { ++it; continue; }
      if (!c.quiet) log_server(fmt::format("closing connection from {}: {}", c.peer, c.dead));
      unpark(c);
      close(c.fd);
      it = conns.erase(it);
    }
  }
};

// ---- TCPStoreServer ----

int TCPStoreServer::listen_on(uint16_t port, uint16_t* bound) { return bind_listener(port, bound); }

TCPStoreServer::TCPStoreServer(uint16_t port, std::string token) : TCPStoreServer(-1, port, std::move(token)) {}

TCPStoreServer::TCPStoreServer(int listen_fd, uint16_t port, std::string token) : token_(std::move(token)) {
  if (listen_fd >= 0) {
    listen_fd_ = listen_fd;
    port_ = port;
  } else {
    listen_fd_ = bind_listener(port, &port_);
  }
  if (pipe2(wake_fds_, O_NONBLOCK | O_CLOEXEC) != 0) {
    const int err = errno;
    close(listen_fd_);
    throw CommError(fmt::format("TCPStore server: cannot create its wake pipe: {}", std::strerror(err)));
  }
  thread_ = std::thread([this] { run(); });
}

TCPStoreServer::~TCPStoreServer() {
  stop_.store(true);
  const char byte = 1;
  [[maybe_unused]] ssize_t n = write(wake_fds_[1], &byte, 1);
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fds_[0]);
  close(wake_fds_[1]);
}

void TCPStoreServer::run() noexcept {
  Loop loop(token_);
  std::vector<pollfd> fds;
  auto listen_paused_until = std::chrono::steady_clock::time_point{};
  try {
    while (!stop_.load()) {
      const auto now = std::chrono::steady_clock::now();
      const bool listening = now >= listen_paused_until;
      fds.clear();
      fds.push_back({wake_fds_[0], POLLIN, 0});
      fds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});
      for (auto& [fd, c] : loop.conns) {
        short events = c->closing ? 0 : POLLIN;
        if (!c->out.empty()) events |= POLLOUT;
        fds.push_back({fd, events, 0});
      }
      int timeout_ms = listening ? -1 : 100;
      if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
        if (errno == EINTR) continue;
        log_server(fmt::format("poll failed: {}; stopping", std::strerror(errno)));
        break;
      }
      if (fds[0].revents) {
        char drain[64];
        while (read(wake_fds_[0], drain, sizeof(drain)) > 0) {}
        if (stop_.load()) break;
      }
      if (fds[1].revents & POLLIN) {
        while (true) {
          int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
              log_server(fmt::format("accept failed: {}; pausing new connections", std::strerror(errno)));
              listen_paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
            }
            break;  // EAGAIN, or a connection that died before we took it
          }
          if (loop.conns.size() >= kMaxConnections) {
            log_server(fmt::format("refusing {}: {} connections already open", peer_name(fd), kMaxConnections));
            close(fd);
            continue;
          }
          int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          auto c = std::make_unique<Loop::Conn>();
          c->fd = fd;
          c->peer = peer_name(fd);
          loop.conns.emplace(fd, std::move(c));
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        auto it = loop.conns.find(fds[i].fd);
        if (it == loop.conns.end()) continue;
        Loop::Conn& c = *it->second;
        if (fds[i].revents & POLLOUT) loop.flush(c);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          if (c.closing) Loop::kill(c, "closed after refusing it", true);
          else loop.read_from(c);
        }
        loop.process(c);
      }
      // Connections unparked by changes above may have frames waiting.
      while (!loop.runnable.empty()) {
        int fd = loop.runnable.back();
        loop.runnable.pop_back();
        auto it = loop.conns.find(fd);
        if (it != loop.conns.end()) loop.process(*it->second);
      }
      loop.sweep();
    }
  } catch (const std::exception& e) {
    // Only allocation failure can get here; the clients then see their connections close.
    log_server(fmt::format("stopping after an internal error: {}", e.what()));
  }
  for (auto& [fd, c] : loop.conns) close(fd);
}

}  // namespace tandem::dist
