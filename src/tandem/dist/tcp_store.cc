// TCPStore client. Every call borrows a connection from a pool of idle ones (opening a new one
// when none is idle, so a blocked get never holds up another thread's set), sends one request
// frame and reads one reply frame; every socket wait is a poll() against the call's deadline.
// Invariant: a connection that failed mid-exchange is closed, never returned to the pool (a late
// reply must never be read as the answer to the next request).
#include "tandem/dist/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tandem/dist/tcp_store_protocol.h"
#include "tandem/dist/tcp_store_server.h"

namespace tandem::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The key under which joining processes are counted when world_size is given (c10d's name).
constexpr const char* kInitKey = "init/";
// Largest reply body: one maximal value plus the status and length fields.
constexpr uint64_t kMaxReplyBytes = kStoreMaxValueBytes + 64;
// Appended to a request's error when the server closed or reset the connection under it.
constexpr const char* kServerGoneHint =
    ". The store's server is gone: the process hosting it (rank 0, or the `tandem run` launcher that "
    "started this rank) exited, crashed or gave up; its log says why. If it ended normally, the rank "
    "hosting the store must outlive the others' use of the store (e.g. end every rank with a barrier), or "
    "start the ranks with `tandem run`, whose launcher hosts the store";

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Why an exchange stopped: a timeout, or a broken connection with its cause.
struct IoFailure {
  bool timed_out = false;
  std::string cause;
  bool peer_gone = false;  // the server closed or reset the connection (its process likely exited)
};

// Waits for `events` on fd until the deadline; nullopt when ready.
std::optional<IoFailure> wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    int n = poll(&p, 1, ms);
    if (n > 0) return std::nullopt;  // readiness or an error; the following call reports which
    if (n == 0) return IoFailure{true, "timed out"};
    if (errno != EINTR) return IoFailure{false, fmt::format("poll failed: {}", std::strerror(errno))};
  }
}

std::optional<IoFailure> send_all(int fd, const uint8_t* data, size_t size, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < size) {
    ssize_t n = send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n > 0) { sent += static_cast<size_t>(n); continue; }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (auto f = wait_fd(fd, POLLOUT, deadline)) return f;
      continue;
    }
    const int e = errno;
    return IoFailure{false, fmt::format("send failed: {}", std::strerror(e)), e == EPIPE || e == ECONNRESET};
  }
  return std::nullopt;
}

std::optional<IoFailure> recv_all(int fd, uint8_t* data, size_t size, Clock::time_point deadline) {
  size_t got = 0;
  while (got < size) {
    ssize_t n = recv(fd, data + got, size - got, 0);
    if (n > 0) { got += static_cast<size_t>(n); continue; }
    if (n == 0) return IoFailure{false, "the server closed the connection", true};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (auto f = wait_fd(fd, POLLIN, deadline)) return f;
      continue;
    }
    const int e = errno;
    return IoFailure{false, fmt::format("recv failed: {}", std::strerror(e)), e == ECONNRESET};
  }
  return std::nullopt;
}

// One non-blocking connect attempt to one address; returns the fd or -1 with errno set.
int connect_once(const addrinfo& ai, Clock::time_point deadline) {
  int fd = socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return -1;
  if (connect(fd, ai.ai_addr, ai.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) { int e = errno; close(fd); errno = e; return -1; }
    if (auto f = wait_fd(fd, POLLOUT, deadline)) { close(fd); errno = f->timed_out ? ETIMEDOUT : EIO; return -1; }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) { close(fd); errno = err; return -1; }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void check_key(const char* op, const std::string& key) {
  TANDEM_CHECK(key.size() <= size_t(kStoreMaxKeyBytes), ValueError,
               "TCPStore: {}: key of {} bytes is longer than the limit of {} bytes", op, key.size(), kStoreMaxKeyBytes);
}
void check_value(const char* op, const std::string& key, size_t size) {
  TANDEM_CHECK(size <= size_t(kStoreMaxValueBytes), ValueError,
               "TCPStore: {}(\"{}\"): value of {} bytes is larger than the limit of {} bytes", op, key, size,
               kStoreMaxValueBytes);
}
void check_keys(const char* op, const std::vector<std::string>& keys) {
  TANDEM_CHECK(keys.size() <= size_t(kStoreMaxWaitKeys), ValueError,
               "TCPStore: {}: {} keys are more than the limit of {}", op, keys.size(), kStoreMaxWaitKeys);
  for (const auto& k : keys) check_key(op, k);
}

// The socket dist::spawn bound and left listening on MASTER_PORT for rank 0
// (TANDEM_STORE_LISTEN_FD), when it listens on `port`: taken once (the variable is cleared), so a
// later store in this process binds its own. -1 when there is none (or `port` is 0: a free port
// was asked for, not spawn's).
int take_spawn_listener(uint16_t port) {
  const char* env = std::getenv("TANDEM_STORE_LISTEN_FD");
  if (env == nullptr || port == 0) return -1;
  char* end = nullptr;
  const long fd = std::strtol(env, &end, 10);
  unsetenv("TANDEM_STORE_LISTEN_FD");
  if (end == env || *end != '\0' || fd < 0 || fd > INT32_MAX) return -1;
  int listening = 0;
  socklen_t len = sizeof(listening);
  if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) return -1;
  sockaddr_storage addr{};
  len = sizeof(addr);
  if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  uint16_t bound = 0;
  if (addr.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  else if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  else return -1;
  if (bound != port) {
    close(static_cast<int>(fd));  // spawn's listener, but this store is on another port: unused
    return -1;
  }
  return static_cast<int>(fd);
}

}  // namespace

struct TCPStore::Reply {
  wire::Status status;
  Bytes body;  // after the status byte
  wire::Reader reader() const { return wire::Reader(body.data(), body.size()); }
};

TCPStore::TCPStore(std::string host, uint16_t port, TCPStoreOptions options)
    : Store(options.timeout), host_(std::move(host)), port_(port), options_(std::move(options)) {
  if (options_.token) {
    token_ = *options_.token;
  } else if (const char* env = std::getenv("TANDEM_STORE_TOKEN")) {
    token_ = env;
  }
  TANDEM_CHECK(token_.size() <= size_t(kStoreMaxKeyBytes), ValueError,
               "TCPStore: token of {} bytes is longer than the limit of {} bytes", token_.size(), kStoreMaxKeyBytes);
  TANDEM_CHECK(!options_.world_size || *options_.world_size >= 1, ValueError,
               "TCPStore: world_size must be >= 1, got {}", options_.world_size.value_or(0));
  if (options_.is_master) {
    server_ = std::make_unique<TCPStoreServer>(take_spawn_listener(port_), port_, token_);
    port_ = server_->port();
  } else {
    TANDEM_CHECK(port_ != 0, ValueError, "TCPStore: a client needs the master's port, got 0 (host {})", host_);
  }
  try {
    release(connect(Clock::now() + timeout()));  // fail early: unreachable master, wrong token
    if (options_.world_size) wait_for_workers();
  } catch (...) {
    close_idle();  // the destructor does not run for a constructor that throws
    throw;
  }
}

TCPStore::~TCPStore() {
  close_idle();
  server_.reset();
}

std::string TCPStore::peer() const { return fmt::format("{}:{}", host_, port_); }

void TCPStore::close_idle() noexcept {
  std::lock_guard lock(mu_);
  for (int fd : idle_fds_) close(fd);
  idle_fds_.clear();
}

void TCPStore::release(int fd) {
  std::lock_guard lock(mu_);
  idle_fds_.push_back(fd);
}

int TCPStore::connect(Clock::time_point deadline) {
  int fd = -1;
  // Retries refused and unreachable connects until the deadline: the master may start later.
  const auto start = Clock::now();
  const std::string port_text = std::to_string(port_);
  std::string cause = "no attempt finished";
  auto backoff = milliseconds(10);
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    int rc = getaddrinfo(host_.c_str(), port_text.c_str(), &hints, &list);
    if (rc != 0) {
      cause = fmt::format("cannot resolve host: {}", gai_strerror(rc));
    } else {
      for (addrinfo* ai = list; ai != nullptr && fd < 0; ai = ai->ai_next) {
        fd = connect_once(*ai, deadline);
        if (fd < 0) cause = std::strerror(errno);
      }
      freeaddrinfo(list);
    }
    if (fd >= 0) break;
    if (Clock::now() >= deadline) {
      auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
      throw CommError(fmt::format("TCPStore: cannot connect to {} (tried for {} ms, timeout {} ms): {}", peer(),
                                  waited, timeout().count(), cause));
    }
    std::this_thread::sleep_for(std::min(backoff, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()) +
                                                      milliseconds(1)));
    backoff = std::min(backoff * 2, milliseconds(500));
  }

  // Hello: the first frame carries the token; the server answers OK or refuses and closes.
  Bytes hello = wire::Writer().u8(uint8_t(wire::Op::kHello)).u32(wire::kMagic).str(token_).finish();
  uint8_t header[8] = {};
  std::optional<IoFailure> f = send_all(fd, hello.data(), hello.size(), deadline);
  if (!f) f = recv_all(fd, header, 8, deadline);
  uint64_t len = 0;
  std::memcpy(&len, header, 8);
  Bytes body;
  if (!f) {
    if (len == 0 || len > kMaxReplyBytes) f = IoFailure{false, fmt::format("malformed hello reply of {} bytes", len)};
    else {
      body.resize(len);
      f = recv_all(fd, body.data(), body.size(), deadline);
    }
  }
  if (f) {
    close(fd);
    if (f->timed_out) {
      throw Timeout(fmt::format("TCPStore: hello to {} timed out after {} ms", peer(), timeout().count()));
    }
    throw CommError(fmt::format("TCPStore: hello to {} failed: {}", peer(), f->cause));
  }
  if (wire::Status(body[0]) == wire::Status::kAuthRejected) {
    close(fd);
    throw CommError(fmt::format(
        "TCPStore: the server at {} rejected our token ({}); every process of the job must use the same "
        "TANDEM_STORE_TOKEN (set by the launcher) or TCPStoreOptions::token",
        peer(), token_.empty() ? "we sent none" : "ours differs"));
  }
  if (wire::Status(body[0]) != wire::Status::kOk) {
    close(fd);
    throw CommError(fmt::format("TCPStore: the server at {} answered hello with status {}", peer(), int(body[0])));
  }
  return fd;
}

TCPStore::Reply TCPStore::roundtrip(const std::string& what, const Bytes& request, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int fd = -1;
  {
    std::lock_guard lock(mu_);
    if (!idle_fds_.empty()) {
      fd = idle_fds_.back();
      idle_fds_.pop_back();
    }
  }
  if (fd < 0) fd = connect(deadline);
  uint8_t header[8] = {};
  std::optional<IoFailure> f = send_all(fd, request.data(), request.size(), deadline);
  if (!f) f = recv_all(fd, header, 8, deadline);
  Reply reply{wire::Status::kOk, {}};
  if (!f) {
    uint64_t len = 0;
    std::memcpy(&len, header, 8);
    if (len == 0 || len > kMaxReplyBytes) {
      f = IoFailure{false, fmt::format("malformed reply of {} bytes", len)};
    } else {
      Bytes body(len);
      f = recv_all(fd, body.data(), body.size(), deadline);
      reply.status = wire::Status(body[0]);
      reply.body.assign(body.begin() + 1, body.end());
    }
  }
  if (f) {
    close(fd);  // a late reply must not answer the next request
    if (f->timed_out) {
      throw Timeout(fmt::format("TCPStore: {} on {} timed out after {} ms", what, peer(), timeout.count()));
    }
    throw CommError(fmt::format("TCPStore: {} on {} failed: {}{}", what, peer(), f->cause,
                                f->peer_gone ? kServerGoneHint : ""));
  }
  if (reply.status == wire::Status::kError) {
    release(fd);  // the exchange completed; the connection is in step
    auto message = reply.reader().str(kMaxReplyBytes);
    throw ValueError(message.value_or(fmt::format("TCPStore: {} failed on the server", what)));
  }
  if (reply.status != wire::Status::kOk) {
    close(fd);
    throw CommError(fmt::format("TCPStore: {} on {}: unexpected reply status {}", what, peer(), int(reply.status)));
  }
  release(fd);
  return reply;
}

namespace {
// Throws CommError naming the call when a reply does not have the expected shape.
template <typename T>
T expect(std::optional<T> v, bool done, const std::string& what, const std::string& peer) {
  if (!v || !done) throw CommError(fmt::format("TCPStore: {} on {}: malformed reply", what, peer));
  return std::move(*v);
}
std::string describe(const char* op, const std::string& key) { return fmt::format("{}(\"{}\")", op, key); }
}  // namespace

void TCPStore::set(const std::string& key, const Bytes& value) {
  check_key("set", key);
  check_value("set", key, value.size());
  roundtrip(describe("set", key), wire::Writer().u8(uint8_t(wire::Op::kSet)).str(key).bytes(value).finish(), timeout());
}

Bytes TCPStore::get(const std::string& key) {
  check_key("get", key);
  const std::string what = describe("get", key);
  Reply reply = roundtrip(what, wire::Writer().u8(uint8_t(wire::Op::kGet)).str(key).finish(), timeout());
  auto r = reply.reader();
  auto value = r.bytes(kStoreMaxValueBytes);
  return expect(std::move(value), r.done(), what, peer());
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  check_key("add", key);
  const std::string what = describe("add", key);
  Reply reply = roundtrip(what, wire::Writer().u8(uint8_t(wire::Op::kAdd)).str(key).i64(delta).finish(), timeout());
  auto r = reply.reader();
  auto value = r.i64();
  return expect(value, r.done(), what, peer());
}

Bytes TCPStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  check_key("compare_set", key);
  check_value("compare_set", key, expected.size());
  check_value("compare_set", key, desired.size());
  const std::string what = describe("compare_set", key);
  Reply reply = roundtrip(
      what, wire::Writer().u8(uint8_t(wire::Op::kCompareSet)).str(key).bytes(expected).bytes(desired).finish(),
      timeout());
  auto r = reply.reader();
  auto value = r.bytes(kStoreMaxValueBytes);
  return expect(std::move(value), r.done(), what, peer());
}

namespace {
Bytes keys_request(wire::Op op, const std::vector<std::string>& keys) {
  wire::Writer w;
  w.u8(uint8_t(op)).u64(keys.size());
  for (const auto& k : keys) w.str(k);
  return w.finish();
}
}  // namespace

void TCPStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  detail::check_timeout(timeout, "TCPStore: wait");
  check_keys("wait", keys);
  roundtrip(fmt::format("wait({})", detail::quote_keys(keys)), keys_request(wire::Op::kWait, keys), timeout);
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  check_keys("check", keys);
  const std::string what = fmt::format("check({})", detail::quote_keys(keys));
  Reply reply = roundtrip(what, keys_request(wire::Op::kCheck, keys), timeout());
  auto r = reply.reader();
  auto present = r.u8();
  return expect(present, r.done(), what, peer()) != 0;
}

bool TCPStore::delete_key(const std::string& key) {
  check_key("delete_key", key);
  const std::string what = describe("delete_key", key);
  Reply reply = roundtrip(what, wire::Writer().u8(uint8_t(wire::Op::kDelete)).str(key).finish(), timeout());
  auto r = reply.reader();
  auto existed = r.u8();
  return expect(existed, r.done(), what, peer()) != 0;
}

int64_t TCPStore::num_keys() {
  Reply reply = roundtrip("num_keys()", wire::Writer().u8(uint8_t(wire::Op::kNumKeys)).finish(), timeout());
  auto r = reply.reader();
  auto n = r.i64();
  return expect(n, r.done(), "num_keys()", peer());
}

void TCPStore::wait_for_workers() {
  // Every process counts itself in; the master then waits until all world_size have (c10d).
  add(kInitKey, 1);
  if (!is_master() || !options_.wait_for_workers) return;
  const auto deadline = Clock::now() + timeout();
  while (true) {
    const int64_t joined = add(kInitKey, 0);
    if (joined >= *options_.world_size) return;
    if (Clock::now() >= deadline) {
      throw Timeout(fmt::format("TCPStore: only {} of {} processes joined the store at {} within {} ms", joined,
                                *options_.world_size, peer(), timeout().count()));
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
}

}  // namespace tandem::dist
