// Tests of the rendezvous stores: one typed suite for the Store contract over HashStore and
// TCPStore, then TCPStore's robustness (tokens, concurrency, garbage, disconnects, refused
// connects). Every wait has a short timeout so that a bug fails the test instead of hanging it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/dist/file_store.h"
#include "tandem/dist/store.h"
#include "tandem/dist/tcp_store.h"
#include "util/test_util.h"

namespace tandem::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

TCPStoreOptions master_options(std::chrono::milliseconds timeout = 5s, std::string token = "") {
  return {.is_master = true, .timeout = timeout, .token = std::move(token)};
}
TCPStoreOptions client_options(std::chrono::milliseconds timeout = 5s, std::string token = "") {
  return {.is_master = false, .timeout = timeout, .token = std::move(token)};
}

// ---- the Store contract, for every store ----

template <typename S>
std::shared_ptr<Store> make_store();
template <>
std::shared_ptr<Store> make_store<HashStore>() { return std::make_shared<HashStore>(5s); }
template <>
std::shared_ptr<Store> make_store<TCPStore>() { return std::make_shared<TCPStore>("127.0.0.1", 0, master_options()); }

template <>
std::shared_ptr<Store> make_store<FileStore>() {
  static std::atomic<int> n{0};
  const std::string path = "/tmp/tandem_store_contract_" + std::to_string(getpid()) + "_" + std::to_string(n++);
  std::remove(path.c_str());
  return std::shared_ptr<Store>(new FileStore(path, 5s), [path](Store* s) {
    delete s;
    std::remove(path.c_str());
  });
}

template <typename S>
class StoreContract : public ::testing::Test {
 protected:
  std::shared_ptr<Store> store_ = make_store<S>();
};
// (FileStore too: the contract says a store may be called from several threads at once, which its
// flock alone did not give the threads of one process.)
using StoreTypes = ::testing::Types<HashStore, TCPStore, FileStore>;
TYPED_TEST_SUITE(StoreContract, StoreTypes);

TYPED_TEST(StoreContract, SetGetOverwriteAndBinaryValues) {
  Store& s = *this->store_;
  s.set("a", "1");
  EXPECT_EQ(to_string(s.get("a")), "1");
  s.set("a", "two");
  EXPECT_EQ(to_string(s.get("a")), "two");
  const Bytes binary = {0, 255, 0, 7, 0};
  s.set("bin", binary);
  EXPECT_EQ(s.get("bin"), binary);
  s.set("empty", Bytes{});
  EXPECT_TRUE(s.get("empty").empty());
  Bytes big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31 + 7);
  s.set("big", big);
  EXPECT_EQ(s.get("big"), big);
}

TYPED_TEST(StoreContract, AddKeepsADecimalCounter) {
  Store& s = *this->store_;
  EXPECT_EQ(s.add("c", 5), 5);
  EXPECT_EQ(s.add("c", -7), -2);
  EXPECT_EQ(s.add("c", 0), -2);
  EXPECT_EQ(to_string(s.get("c")), "-2");  // c10d stores counters as decimal text
  s.set("d", "40");
  EXPECT_EQ(s.add("d", 2), 42);
  s.set("text", "not a number");
  EXPECT_THROW(s.add("text", 1), ValueError);
  s.set("max", std::to_string(INT64_MAX));
  EXPECT_THROW(s.add("max", 1), ValueError);
  EXPECT_EQ(s.add("c", 3), 1);  // the store still works after a refused add
}

TYPED_TEST(StoreContract, CompareSetFollowsC10d) {
  Store& s = *this->store_;
  // Missing key, non-empty expected: nothing is set and `expected` comes back.
  EXPECT_EQ(to_string(s.compare_set("k", to_bytes("x"), to_bytes("y"))), "x");
  EXPECT_FALSE(s.check({"k"}));
  // Missing key, empty expected: the key is created.
  EXPECT_EQ(to_string(s.compare_set("k", {}, to_bytes("first"))), "first");
  EXPECT_EQ(to_string(s.get("k")), "first");
  // Matching expected: swapped.
  EXPECT_EQ(to_string(s.compare_set("k", to_bytes("first"), to_bytes("second"))), "second");
  // Mismatch: the current value comes back, unchanged.
  EXPECT_EQ(to_string(s.compare_set("k", to_bytes("first"), to_bytes("third"))), "second");
  EXPECT_EQ(to_string(s.get("k")), "second");
}

TYPED_TEST(StoreContract, WaitAndCheck) {
  Store& s = *this->store_;
  EXPECT_FALSE(s.check({"x"}));
  EXPECT_TRUE(s.check({}));
  EXPECT_THROW(s.wait({"x"}, 50ms), Timeout);
  s.set("x", "1");
  s.wait({"x"}, 50ms);
  EXPECT_TRUE(s.check({"x"}));
  EXPECT_FALSE(s.check({"x", "y"}));
  std::jthread setter([&] {
    std::this_thread::sleep_for(30ms);
    s.set("y", "2");
  });
  s.wait({"x", "y"}, 3s);  // returns once y appears
  setter.join();
  EXPECT_TRUE(s.check({"x", "y"}));
  try {
    s.wait({"x", "missing-one"}, 50ms);
    FAIL() << "wait on a missing key returned";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("missing-one"), std::string::npos) << e.what();
  }
}

TYPED_TEST(StoreContract, DeleteKeyAndNumKeys) {
  Store& s = *this->store_;
  EXPECT_EQ(s.num_keys(), 0);
  s.set("a", "1");
  s.add("b", 1);
  EXPECT_EQ(s.num_keys(), 2);
  EXPECT_TRUE(s.delete_key("a"));
  EXPECT_FALSE(s.delete_key("a"));
  EXPECT_FALSE(s.check({"a"}));
  EXPECT_EQ(s.num_keys(), 1);
}

TYPED_TEST(StoreContract, GetBlocksUntilAnotherThreadSets) {
  Store& s = *this->store_;
  const auto start = Clock::now();
  std::jthread setter([&] {
    std::this_thread::sleep_for(100ms);
    s.set("late", "here");
  });
  EXPECT_EQ(to_string(s.get("late")), "here");
  EXPECT_GE(elapsed_ms(start), 90);
  setter.join();
}

TYPED_TEST(StoreContract, GetOnAMissingKeyTimesOutNamingTheKey) {
  Store& s = *this->store_;
  s.set_timeout(200ms);
  EXPECT_EQ(s.timeout(), 200ms);
  const auto start = Clock::now();
  try {
    s.get("never-set");
    FAIL() << "get on a missing key returned";
  } catch (const Timeout& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("never-set"), std::string::npos) << what;
    EXPECT_NE(what.find("200 ms"), std::string::npos) << what;
  }
  const int64_t ms = elapsed_ms(start);
  EXPECT_GE(ms, 190);
  EXPECT_LT(ms, 400);  // within 2x the timeout
  // The store works afterwards (TCPStore reconnects after dropping the timed-out exchange).
  s.set("never-set", "now");
  EXPECT_EQ(to_string(s.get("never-set")), "now");
  EXPECT_THROW(s.set_timeout(0ms), ValueError);
}

// ---- PrefixStore ----

// Threads of one process share the FileStore's descriptor, so flock() did not exclude them: adds
// were lost (2354 of 4000) and a replay read a half-written record as corrupt.
TEST(FileStore, ThreadsOfOneProcessDoNotLoseUpdates) {
  std::shared_ptr<Store> store = make_store<FileStore>();
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        store->add("c", 1);
        store->set("k" + std::to_string(t) + "_" + std::to_string(i), "v");
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(store->add("c", 0), 600);
  EXPECT_EQ(store->num_keys(), 601);
}

// A timeout beyond any deadline the clock can hold timed out at once ("after 9223372036854775807
// ms"); there is no "wait forever", so it is refused, naming the limit.
TEST(StoreTimeouts, TimeoutsBeyondAYearAreRefusedNotExpiredAtOnce) {
  HashStore store(5s);
  EXPECT_THROW(store.set_timeout(std::chrono::milliseconds::max()), ValueError);
  EXPECT_THROW(store.wait({"k"}, std::chrono::milliseconds::max()), ValueError);
  try {
    HashStore bad(std::chrono::hours(24 * 400));
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("at most 31536000000 ms (365 days)"), std::string::npos) << e.what();
  }
  store.set_timeout(std::chrono::hours(24 * 365));  // the limit itself is fine
  store.set("k", "v");
  store.wait({"k"}, std::chrono::hours(24 * 365));
}

TEST(PrefixStore, KeysOfDifferentPrefixesDoNotCollide) {
  auto base = std::make_shared<HashStore>(2s);
  PrefixStore a("a", base), b("b", base);
  a.set("k", "from a");
  EXPECT_FALSE(b.check({"k"}));
  EXPECT_EQ(to_string(base->get("a/k")), "from a");
  b.set("k", "from b");
  EXPECT_EQ(to_string(a.get("k")), "from a");
  EXPECT_EQ(to_string(b.get("k")), "from b");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 5), 5);
  EXPECT_EQ(to_string(base->get("b/n")), "5");
  EXPECT_EQ(to_string(a.compare_set("k", to_bytes("from a"), to_bytes("swapped"))), "swapped");
  EXPECT_EQ(to_string(b.get("k")), "from b");
  EXPECT_TRUE(a.delete_key("k"));
  EXPECT_TRUE(b.check({"k"}));
  EXPECT_EQ(a.num_keys(), base->num_keys());  // c10d: counts the store underneath
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", base));
  nested.set("x", "1");
  EXPECT_TRUE(base->check({"outer/inner/x"}));
  a.set_timeout(50ms);
  EXPECT_EQ(base->timeout(), 50ms);
  EXPECT_THROW(a.get("absent"), Timeout);
  EXPECT_THROW(a.wait({"absent"}, 30ms), Timeout);
  EXPECT_THROW(PrefixStore("p", nullptr), ValueError);
}

TEST(PrefixStore, WorksOverTCPStore) {
  auto master = std::make_shared<TCPStore>("127.0.0.1", 0, master_options());
  PrefixStore group0("pg0", master);
  auto client = std::make_shared<TCPStore>("127.0.0.1", master->port(), client_options());
  PrefixStore group0_client("pg0", client), group1_client("pg1", client);
  group0.set("addr", "10.0.0.1");
  EXPECT_EQ(to_string(group0_client.get("addr")), "10.0.0.1");
  EXPECT_FALSE(group1_client.check({"addr"}));
}

// ---- TCPStore ----

TEST(TCPStore, MasterOnPortZeroBindsAFreePort) {
  TCPStore master("127.0.0.1", 0, master_options());
  EXPECT_TRUE(master.is_master());
  EXPECT_GT(master.port(), 0);
  TCPStore client("localhost", master.port(), client_options());  // may resolve to ::1 first
  client.set("k", "v");
  EXPECT_EQ(to_string(master.get("k")), "v");
  EXPECT_FALSE(client.is_master());
}

// A port another process (here: another master) already listens on: the error says what to do.
TEST(TCPStore, AMasterOnAPortInUseSaysToPickAnother) {
  TCPStore first("127.0.0.1", 0, master_options());
  try {
    TCPStore second("127.0.0.1", first.port(), master_options());
    FAIL() << "a second master listened on port " << first.port();
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("cannot listen on port {}: Address already in use; another process holds that "
                                    "port",
                                    first.port())),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("set MASTER_PORT (tandem run: --master-port) to a free port"), std::string::npos) << what;
  }
}

TEST(TCPStore, ConcurrentAddsFromManyClientsSumExactly) {
  TCPStore master("127.0.0.1", 0, master_options());
  constexpr int kThreads = 6, kAdds = 300;
  auto shared = std::make_shared<TCPStore>("127.0.0.1", master.port(), client_options());
  std::vector<std::jthread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Even threads own a connection; odd ones share one (calls are serialized on it).
      std::unique_ptr<TCPStore> own;
      if (t % 2 == 0) own = std::make_unique<TCPStore>("127.0.0.1", master.port(), client_options());
      Store& s = own ? *own : *shared;
      for (int i = 0; i < kAdds; ++i) s.add("counter", t + 1);
    });
  }
  for (auto& th : threads) th.join();
  int64_t expected = 0;
  for (int t = 0; t < kThreads; ++t) expected += int64_t(t + 1) * kAdds;
  EXPECT_EQ(master.add("counter", 0), expected);
}

TEST(TCPStore, TokenIsRequiredWhenConfigured) {
  TCPStore master("127.0.0.1", 0, master_options(5s, "s3cret"));
  for (const std::string bad : {"wrong", ""}) {
    try {
      TCPStore client("127.0.0.1", master.port(), client_options(2s, bad));
      FAIL() << "a client with token \"" << bad << "\" was accepted";
    } catch (const Timeout& e) {
      FAIL() << "refusal surfaced as a timeout: " << e.what();
    } catch (const CommError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rejected our token"), std::string::npos) << what;
      EXPECT_NE(what.find("TANDEM_STORE_TOKEN"), std::string::npos) << what;
      EXPECT_NE(what.find(fmt::format("127.0.0.1:{}", master.port())), std::string::npos) << what;
    }
  }
  TCPStore good("127.0.0.1", master.port(), client_options(2s, "s3cret"));
  good.set("k", "v");
  EXPECT_EQ(to_string(master.get("k")), "v");

  // Without options.token both sides read TANDEM_STORE_TOKEN.
  ::setenv("TANDEM_STORE_TOKEN", "from-env", 1);
  TCPStore env_master("127.0.0.1", 0, {.is_master = true, .timeout = 5s});
  TCPStore env_client("127.0.0.1", env_master.port(), {.timeout = 2s});
  ::unsetenv("TANDEM_STORE_TOKEN");
  env_client.set("k", "v");
  EXPECT_EQ(to_string(env_master.get("k")), "v");
  EXPECT_THROW(TCPStore("127.0.0.1", env_master.port(), client_options(2s, "")), CommError);
}

// A raw TCP connection for sending bytes the client library never would.
class RawSocket {
 public:
  explicit RawSocket(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  }
  ~RawSocket() { close(fd_); }
  void send_bytes(const Bytes& b) {
    // The server may close on us mid-send; that is the point, so errors are ignored.
    [[maybe_unused]] ssize_t n = ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL);
  }
  // Reads until `n` bytes arrived, EOF, or `timeout`; returns what arrived.
  Bytes read_some(size_t n, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    Bytes out;
    uint8_t buf[4096];
    while (out.size() < n && Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      ssize_t got = recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (got <= 0) break;
      out.insert(out.end(), buf, buf + got);
    }
    return out;
  }
  // Reads until EOF or error within `timeout`; true when the server closed the connection.
  bool closed_by_server(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    uint8_t buf[4096];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
};

Bytes frame(const Bytes& body) {
  Bytes out(8 + body.size());
  const uint64_t n = body.size();
  std::memcpy(out.data(), &n, 8);
  std::copy(body.begin(), body.end(), out.begin() + 8);
  return out;
}
void put_u64(Bytes& b, uint64_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + 8);
}
void put_str(Bytes& b, const std::string& s) {
  put_u64(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}
Bytes hello(const std::string& token, uint32_t magic = 0x54445331) {
  Bytes body = {1};
  const auto* p = reinterpret_cast<const uint8_t*>(&magic);
  body.insert(body.end(), p, p + 4);
  put_str(body, token);
  return frame(body);
}

TEST(TCPStore, GarbageAndMalformedFramesLeaveTheServerServingOthers) {
  TCPStore master("127.0.0.1", 0, master_options(5s, "tok"));
  TCPStore bystander("127.0.0.1", master.port(), client_options(5s, "tok"));
  std::mt19937_64 rng(20261202);
  int closed_checks = 0;
  for (int i = 0; i < 100; ++i) {
    RawSocket raw(master.port());
    Bytes payload;
    bool expect_close = true;  // the server must hang up on its own
    switch (i % 8) {
      case 0: {  // random bytes without a hello
        payload.resize(1 + rng() % 3000);
        for (auto& b : payload) b = static_cast<uint8_t>(rng());
        expect_close = false;  // may happen to look like a partial frame
        break;
      }
      case 1: {  // a frame claiming 2^40 bytes, or 100 MiB before any hello
        put_u64(payload, (rng() % 2) ? uint64_t(1) << 40 : uint64_t(100) << 20);
        break;
      }
      case 2: {  // hello, then a truncated set frame, then gone
        payload = hello("tok");
        Bytes body = {2};
        put_str(body, "key");
        put_u64(body, 100);
        Bytes f = frame(body);
        f.resize(f.size() - 3 - rng() % 5);
        payload.insert(payload.end(), f.begin(), f.end());
        expect_close = false;
        break;
      }
      case 3: {  // hello, then a set whose key claims 2^40 bytes inside a small frame
        payload = hello("tok");
        Bytes body = {2};
        put_u64(body, uint64_t(1) << 40);
        body.push_back('x');
        Bytes f = frame(body);
        payload.insert(payload.end(), f.begin(), f.end());
        break;
      }
      case 4: {  // hello, then a frame with an unknown op and random contents
        payload = hello("tok");
        Bytes body(1 + rng() % 64);
        for (auto& b : body) b = static_cast<uint8_t>(rng());
        body[0] = static_cast<uint8_t>(100 + rng() % 100);
        Bytes f = frame(body);
        payload.insert(payload.end(), f.begin(), f.end());
        break;
      }
      case 5: {  // a hello with the wrong magic, or the wrong token
        payload = (rng() % 2) ? hello("tok", 0xdeadbeef) : hello("nope");
        break;
      }
      case 6: {  // hello, then a wait claiming more keys than allowed
        payload = hello("tok");
        Bytes body = {6};
        put_u64(body, 1'000'000);
        Bytes f = frame(body);
        payload.insert(payload.end(), f.begin(), f.end());
        break;
      }
      case 7: {  // hello, then a valid get with trailing junk, or a zero-length frame
        payload = hello("tok");
        Bytes body = {3};
        put_str(body, "key");
        body.push_back(0xab);
        Bytes f = (rng() % 2) ? frame(body) : frame({});
        payload.insert(payload.end(), f.begin(), f.end());
        break;
      }
    }
    raw.send_bytes(payload);
    if (expect_close) {
      EXPECT_TRUE(raw.closed_by_server(2s)) << "case " << i << " was not closed by the server";
      ++closed_checks;
    }
    if (i % 10 == 0) {
      bystander.set(fmt::format("k{}", i), "ok");
      EXPECT_EQ(to_string(master.get(fmt::format("k{}", i))), "ok");
    }
  }
  EXPECT_GT(closed_checks, 50);
  // A fresh, well-behaved client still gets served.
  TCPStore after("127.0.0.1", master.port(), client_options(2s, "tok"));
  EXPECT_EQ(after.add("n", 3), 3);
  EXPECT_EQ(to_string(after.get("k90")), "ok");
}

TEST(TCPStore, PipelinedFramesAreAnsweredInOrder) {
  TCPStore master("127.0.0.1", 0, master_options());
  RawSocket raw(master.port());
  // hello, set a=1, set b=22, get b, parked get c, sent as one write.
  Bytes payload = hello("");
  for (auto [key, value] : {std::pair{"a", "1"}, std::pair{"b", "22"}}) {
    Bytes body = {2};
    put_str(body, key);
    put_str(body, value);
    Bytes f = frame(body);
    payload.insert(payload.end(), f.begin(), f.end());
  }
  for (const char* key : {"b", "c"}) {
    Bytes body = {3};
    put_str(body, key);
    Bytes f = frame(body);
    payload.insert(payload.end(), f.begin(), f.end());
  }
  raw.send_bytes(payload);
  EXPECT_EQ(to_string(master.get("a")), "1");
  EXPECT_EQ(to_string(master.get("b")), "22");
  // Replies: three OKs (9 bytes each), then get b = OK + u64 2 + "22" (19 bytes); get c is parked.
  EXPECT_EQ(raw.read_some(3 * 9 + 19, 2s).size(), 3u * 9 + 19);
  master.set("c", "333");
  const Bytes c_reply = raw.read_some(8 + 1 + 8 + 3, 2s);
  ASSERT_EQ(c_reply.size(), 20u);
  EXPECT_EQ(std::string(c_reply.begin() + 17, c_reply.end()), "333");
}

TEST(TCPStore, AWaitingClientFailsFastWhenTheMasterGoesAway) {
  auto master = std::make_unique<TCPStore>("127.0.0.1", 0, master_options());
  TCPStore client("127.0.0.1", master->port(), client_options(5s));
  std::jthread killer([&] {
    std::this_thread::sleep_for(100ms);
    master.reset();  // stops the server with the get parked
  });
  const auto start = Clock::now();
  try {
    client.get("never");
    FAIL() << "get returned";
  } catch (const Timeout& e) {
    FAIL() << "a dead server surfaced as a timeout: " << e.what();
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("get(\"never\")"), std::string::npos) << what;
    EXPECT_NE(what.find("closed the connection"), std::string::npos) << what;
    // ...and says what that usually means and how to avoid it (rank 0 hosting the store exited).
    EXPECT_NE(what.find("store's server is gone"), std::string::npos) << what;
    EXPECT_NE(what.find("barrier"), std::string::npos) << what;
    EXPECT_NE(what.find("tandem run"), std::string::npos) << what;
  }
  EXPECT_LT(elapsed_ms(start), 2000);
}

TEST(TCPStore, ClientThatDisconnectsWhileWaitingDoesNotDisturbTheServer) {
  TCPStore master("127.0.0.1", 0, master_options());
  {
    RawSocket raw(master.port());
    Bytes payload = hello("");
    Bytes body = {3};
    put_str(body, "later");
    Bytes f = frame(body);
    payload.insert(payload.end(), f.begin(), f.end());
    raw.send_bytes(payload);
    std::this_thread::sleep_for(50ms);
  }  // gone while its get is parked
  TCPStore client("127.0.0.1", master.port(), client_options(150ms));
  EXPECT_THROW(client.wait({"later", "other"}, 100ms), Timeout);  // drops its connection
  EXPECT_THROW(client.get("later"), Timeout);
  master.set("later", "now");  // wakes nobody: the waiters are gone
  master.set("other", "too");
  client.wait({"later", "other"}, 1s);  // reconnected
  EXPECT_EQ(to_string(client.get("later")), "now");
  EXPECT_EQ(master.num_keys(), 2);
}

TEST(TCPStore, TimeoutNamesKeyHostPortAndTimeout) {
  TCPStore master("127.0.0.1", 0, master_options(150ms));
  try {
    master.get("rank7/addr");
    FAIL() << "get returned";
  } catch (const Timeout& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank7/addr"), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("127.0.0.1:{}", master.port())), std::string::npos) << what;
    EXPECT_NE(what.find("150 ms"), std::string::npos) << what;
    EXPECT_EQ(what.find("server is gone"), std::string::npos) << "a live server is not gone: " << what;
  }
}

using testing::unused_port;

TEST(TCPStore, ConnectingToAClosedPortFailsWithinTheTimeout) {
  const uint16_t port = unused_port();
  const auto start = Clock::now();
  try {
    TCPStore client("127.0.0.1", port, client_options(300ms));
    FAIL() << "connected to a closed port";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << what;
    EXPECT_NE(what.find("refused"), std::string::npos) << what;
  }
  const int64_t ms = elapsed_ms(start);
  EXPECT_GE(ms, 280);  // it kept retrying until the timeout
  EXPECT_LT(ms, 600);
}

TEST(TCPStore, ClientRetriesUntilTheMasterStarts) {
  const uint16_t port = unused_port();
  std::unique_ptr<TCPStore> client;
  std::jthread joiner([&] { client = std::make_unique<TCPStore>("127.0.0.1", port, client_options(5s)); });
  std::this_thread::sleep_for(150ms);
  TCPStore master("127.0.0.1", port, master_options());
  joiner.join();
  ASSERT_NE(client, nullptr);
  client->set("k", "v");
  EXPECT_EQ(to_string(master.get("k")), "v");
}

TEST(TCPStore, MasterWaitsForWorldSizeWorkers) {
  const uint16_t port = unused_port();
  std::vector<std::jthread> workers;
  for (int r = 1; r < 3; ++r) {
    workers.emplace_back([port] {
      TCPStore w("127.0.0.1", port, {.world_size = 3, .timeout = 5s, .token = ""});
      w.wait({"done"}, 5s);
    });
  }
  TCPStore master("127.0.0.1", port, {.is_master = true, .world_size = 3, .timeout = 5s, .token = ""});
  EXPECT_EQ(master.add("init/", 0), 3);
  master.set("done", "1");
  for (auto& w : workers) w.join();

  // Nobody else comes: the master's constructor times out naming the count.
  try {
    TCPStore lonely("127.0.0.1", 0, {.is_master = true, .world_size = 2, .timeout = 200ms, .token = ""});
    FAIL() << "a master of 2 started alone";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("1 of 2"), std::string::npos) << e.what();
  }
}

TEST(TCPStore, OversizedArgumentsAreRefusedOnTheClient) {
  TCPStore master("127.0.0.1", 0, master_options());
  EXPECT_THROW(master.set(std::string(kStoreMaxKeyBytes + 1, 'k'), "v"), ValueError);
  EXPECT_THROW(master.set("k", Bytes(kStoreMaxValueBytes + 1)), ValueError);
  EXPECT_THROW(master.check(std::vector<std::string>(kStoreMaxWaitKeys + 1, "k")), ValueError);
  master.set("k", "v");  // still fine
  EXPECT_EQ(to_string(master.get("k")), "v");
}

}  // namespace
}  // namespace tandem::dist
