// Tests of process-group setup: the launch environment (torchrun, OpenMPI, Slurm), missing-variable
// messages, init_process_group through env:// and file:// in real processes (dist::spawn), a rank
// that never starts, and a rank killed with SIGKILL in the middle of a loop of all_reduce.
// Children report failures by throwing; spawn rethrows them here with the rank.
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "collective_sweep.h"
#include "tandem/dist/backends.h"
#include "tandem/dist/process_group.h"
#include "util/test_util.h"
#include "tandem/dist/spawn.h"

namespace tandem::dist {
std::string slurm_first_host(const std::string& nodelist);  // init.cc
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Clears every launch variable for one test and restores them afterwards.
class EnvGuard {
 public:
  EnvGuard() {
    for (const char* k : kVars) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      unsetenv(k);
    }
  }
  ~EnvGuard() {
    for (const char* k : kVars) unsetenv(k);
    for (auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  void set(const char* k, const char* v) { setenv(k, v, 1); }

 private:
  static constexpr const char* kVars[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
      "SLURM_STEP_NODELIST"};
  std::map<std::string, std::string> saved_;
};

TEST(LaunchEnv, Torchrun) {
  EnvGuard g;
  g.set("RANK", "3");
  g.set("WORLD_SIZE", "8");
  g.set("LOCAL_RANK", "1");
  g.set("LOCAL_WORLD_SIZE", "2");
  g.set("MASTER_ADDR", "10.0.0.7");
  g.set("MASTER_PORT", "29500");
  g.set("OMPI_COMM_WORLD_RANK", "5");  // torchrun's variables win
  const LaunchEnv e = read_launch_env();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, OpenMpi) {
  EnvGuard g;
  g.set("OMPI_COMM_WORLD_RANK", "2");
  g.set("OMPI_COMM_WORLD_SIZE", "4");
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  const LaunchEnv e = read_launch_env();
  EXPECT_EQ(e.source, "openmpi");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_TRUE(e.master_addr.empty());
  EXPECT_EQ(e.master_port, -1);
}

TEST(LaunchEnv, SlurmWithCompressedNodeList) {
  EnvGuard g;
  g.set("SLURM_PROCID", "5");
  g.set("SLURM_NTASKS", "8");
  g.set("SLURM_LOCALID", "1");
  g.set("SLURM_JOB_NODELIST", "node[07-10,12],login1");
  g.set("MASTER_PORT", "1234");
  const LaunchEnv e = read_launch_env();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node07");
  EXPECT_EQ(e.master_port, 1234);
  // An srun step on part of the allocation: its task 0 runs on the step's first node.
  g.set("SLURM_STEP_NODELIST", "node[09-10]");
  EXPECT_EQ(read_launch_env().master_addr, "node09");
  EXPECT_EQ(slurm_first_host("a,b"), "a");
  EXPECT_EQ(slurm_first_host("gpu-[3-5]"), "gpu-3");
  EXPECT_EQ(slurm_first_host("rack[1-2]-n[01-04]"), "rack1-n01");
  EXPECT_EQ(slurm_first_host("single"), "single");
  EXPECT_THROW(slurm_first_host("node[01-04"), ValueError);
}

TEST(LaunchEnv, MalformedValuesAreNamed) {
  EnvGuard g;
  g.set("RANK", "two");
  g.set("WORLD_SIZE", "4");
  try {
    read_launch_env();
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='two'"), std::string::npos) << e.what();
  }
  g.set("RANK", "4");
  EXPECT_THROW(read_launch_env(), ValueError);  // rank >= world size
  g.set("RANK", "0");
  g.set("MASTER_PORT", "70000");
  EXPECT_THROW(read_launch_env(), ValueError);
}

std::string init_error(const InitOptions& o) {
  try {
    init_process_group(o);
    destroy_process_group();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "no error";
}

TEST(InitProcessGroup, MissingVariablesAreNamedWithTheFix) {
  EnvGuard g;
  InitOptions o;
  o.timeout = 2s;
  std::string m = init_error(o);
  EXPECT_NE(m.find("RANK is not set"), std::string::npos) << m;
  EXPECT_NE(m.find("tandem run"), std::string::npos) << m;
  g.set("RANK", "0");
  m = init_error(o);
  EXPECT_NE(m.find("WORLD_SIZE is not set"), std::string::npos) << m;
  g.set("WORLD_SIZE", "1");
  m = init_error(o);
  EXPECT_NE(m.find("MASTER_ADDR is not set: run under `tandem run`"), std::string::npos) << m;
  g.set("MASTER_ADDR", "127.0.0.1");
  m = init_error(o);
  EXPECT_NE(m.find("MASTER_PORT is not set"), std::string::npos) << m;
  o.init_method = "udp://x";
  m = init_error(o);
  EXPECT_NE(m.find("udp://x"), std::string::npos) << m;
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(get_rank(), ValueError);
}

// init_method's query gives rank and world_size, as PyTorch's rendezvous reads it (a tcp:// URL
// with them said "RANK is not set"; a file:// one made a file named "x?rank=0&world_size=1").
TEST(InitProcessGroup, TheUrlsQueryGivesRankAndWorldSize) {
  EnvGuard g;
  InitOptions o;
  o.timeout = 10s;
  o.init_method = fmt::format("tcp://127.0.0.1:{}/?rank=0&world_size=1", tandem::testing::unused_port());
  {
    auto pg = init_process_group(o);
    EXPECT_EQ(get_rank(), 0);
    EXPECT_EQ(get_world_size(), 1);
    destroy_process_group();
  }
  const std::string path = fmt::format("/tmp/tandem_url_query_{}", static_cast<long>(getpid()));
  std::remove(path.c_str());
  o.init_method = "file://" + path + "?world_size=1&rank=0";
  {
    auto pg = init_process_group(o);
    destroy_process_group();
  }
  EXPECT_TRUE(std::filesystem::exists(path));
  std::remove(path.c_str());
  // Given twice, or an unknown parameter: errors naming them.
  o.init_method = "file://" + path + "?rank=0&world_size=1";
  o.rank = 0;
  std::string m = init_error(o);
  EXPECT_NE(m.find("gives rank=0 and InitOptions::rank is 0; give it once"), std::string::npos) << m;
  o.rank = -1;
  o.init_method = "file://" + path + "?rank=0&wrold_size=1";
  m = init_error(o);
  EXPECT_NE(m.find("unknown query parameter \"wrold_size\""), std::string::npos) << m;
  o.init_method = "tcp://127.0.0.1:http?rank=0&world_size=1";
  m = init_error(o);
  EXPECT_NE(m.find("port 'http' is not a TCP port"), std::string::npos) << m;
  std::remove(path.c_str());
  EXPECT_FALSE(is_initialized());
}

// destroy_process_group forgets the groups; one still held keeps the store (and its port) alive,
// and a re-init on that port says so instead of blaming "another process".
TEST(InitProcessGroup, ReinitWhileAGroupOfTheDestroyedOneIsHeldSaysWhy) {
  EnvGuard g;
  InitOptions o;
  o.timeout = 10s;
  o.init_method = fmt::format("tcp://127.0.0.1:{}?rank=0&world_size=1", tandem::testing::unused_port());
  auto held = init_process_group(o);
  destroy_process_group();
  try {
    init_process_group(o);
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("still alive in this process"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(is_initialized());
  held.reset();
  auto again = init_process_group(o);  // the port is free once the last reference went
  EXPECT_TRUE(is_initialized());
  destroy_process_group();
}

TEST(InitProcessGroup, BackendsByName) {
  EXPECT_TRUE(backend_available("shm"));
  EXPECT_FALSE(backend_available("carrier-pigeon"));
  auto store = std::make_shared<HashStore>(2s);
  EXPECT_THROW(make_process_group("carrier-pigeon", store, 0, 1), ValueError);
}

TEST(InitProcessGroup, WorldOfOneWithAStore) {
  InitOptions o;
  o.store = std::make_shared<HashStore>(5s);
  o.rank = 0;
  o.world_size = 1;
  auto pg = init_process_group(o);
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(get_rank(), 0);
  EXPECT_EQ(get_world_size(), 1);
  EXPECT_THROW(init_process_group(o), ValueError);  // twice
  barrier();
  auto sub = new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
}

// A store that already holds this rank's rendezvous key: reused by this very process (a second
// group over the same store), or written by something that is not this version's rendezvous. An
// unknown backend fails before the rendezvous.
TEST(InitProcessGroup, AStoreUsedBeforeAndAnUnknownBackendAreNamed) {
  InitOptions o;
  o.store = std::make_shared<HashStore>(5s);
  o.rank = 0;
  o.world_size = 1;
  init_process_group(o);
  destroy_process_group();
  std::string m = init_error(o);
  EXPECT_NE(m.find("this process already joined this store as rank 0 (an earlier init_process_group over the same "
                   "store); give every init_process_group a store of its own"),
            std::string::npos)
      << m;
  o.store = std::make_shared<HashStore>(5s);
  o.store->set("default_pg/init/rank/0", "12345");
  m = init_error(o);
  EXPECT_NE(m.find("already holds rank 0's key, written by something else than this version's rendezvous "
                   "(\"12345\")"),
            std::string::npos)
      << m;
  o.store = std::make_shared<HashStore>(5s);
  o.backend = "SHM";
  m = init_error(o);
  EXPECT_NE(m.find("unknown process-group backend 'SHM': expected shm, mpi, gloo or nccl"), std::string::npos) << m;
  EXPECT_FALSE(o.store->check({"default_pg/init/rank/0"}));  // it never reached the rendezvous
}

// ---- real processes ----

SpawnOptions spawn_options(std::chrono::milliseconds timeout = 60s) {
  SpawnOptions s;
  s.timeout = timeout;
  s.env["TANDEM_NUM_THREADS"] = "1";
  s.env["OMP_NUM_THREADS"] = "1";
  return s;
}

void check_sum_on_default_group(int64_t count) {
  auto pg = default_group();
  auto mem = pg->allocate(static_cast<size_t>(count) * 4);
  auto* x = static_cast<float*>(mem.get());
  for (int64_t i = 0; i < count; ++i) x[i] = static_cast<float>(pg->rank() + i % 7);
  pg->all_reduce(Buffer{x, count, DType::f32, kCPU})->wait();
  const int n = pg->size();
  for (int64_t i = 0; i < count; ++i) {
    const float want = static_cast<float>(n * (n - 1) / 2 + n * (i % 7));
    require(x[i] == want, fmt::format("rank {} element {}: {} != {}", pg->rank(), i, x[i], want));
  }
}

TEST(Spawn, EnvInitAllReduceAcrossProcessesAndSubgroups) {
  spawn(3, [](int rank) {
    InitOptions o;
    o.timeout = 20s;
    init_process_group(o);
    require(get_rank() == rank && get_world_size() == 3, "rank/world size from the environment");
    check_sum_on_default_group(1000);
    check_sum_on_default_group(300001);
    auto sub = new_group({0, 2});
    require((rank == 1) == (sub == nullptr), "membership of new_group");
    if (sub) {
      int32_t v = rank;
      sub->all_reduce(Buffer{&v, 1, DType::i32, kCPU})->wait();
      require(v == 2, fmt::format("subgroup sum {}", v));
    }
    barrier();
    destroy_process_group();
  }, spawn_options());
}

// Without a master_port, spawn binds the store's port before forking and hands the listening
// socket to rank 0, whose env:// store serves on it. Before, spawn picked a free port and closed
// it, and any process could take it before rank 0 bound it again (a store on another job's port,
// or rank 0 failing to bind). Here rank 1 tries to bind MASTER_PORT while rank 0 has not built its
// store yet (it waits 300 ms first): the port must be taken already. Then the group works, and
// rank 0's store took the socket (the variable is cleared, so a later store binds its own).
TEST(Spawn, TheStorePortIsHeldFromBeforeTheForkUntilRankZeroServesIt) {
  spawn(2, [](int rank) {
    const char* port_env = std::getenv("MASTER_PORT");
    require(port_env != nullptr, "MASTER_PORT is set");
    const int port = std::atoi(port_env);
    require((std::getenv("TANDEM_STORE_LISTEN_FD") != nullptr) == (rank == 0),
            "only rank 0 is handed the store's socket");
    if (rank == 1) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      require(fd >= 0, "socket()");
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(port));
      const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      const int err = errno;
      close(fd);
      require(rc != 0, fmt::format("another process could bind MASTER_PORT {} before rank 0's store was built", port));
      require(err == EADDRINUSE, fmt::format("binding MASTER_PORT failed with {}, expected EADDRINUSE", std::strerror(err)));
    } else {
      std::this_thread::sleep_for(300ms);
    }
    InitOptions o;
    o.timeout = 20s;
    init_process_group(o);
    require(std::getenv("TANDEM_STORE_LISTEN_FD") == nullptr, "rank 0's store took the socket");
    check_sum_on_default_group(1000);
    destroy_process_group();
  }, spawn_options());
}

// Rank 0 hosts the store (as when the ranks are started without `tandem run`, e.g. by mpirun or
// srun) and leaves as soon as init_process_group returns, without a collective: the others must
// not lose the store while still building the group. This failed in round 0 ("the server closed
// the connection" in the last store wait of the shm group's construction) before the store's host
// waited for every rank to have built the group. Four ranks on two cores make a late rank likely.
TEST(Spawn, RankZeroLeavingRightAfterInitDoesNotBreakTheOthersShmConstruction) {
  for (int round = 0; round < 30; ++round) {
    SCOPED_TRACE(round);
    spawn(4, [](int) {
      InitOptions o;
      o.timeout = 20s;
      init_process_group(o);
    }, spawn_options());
  }
}

// The same over gloo (whose construction ends in store reads of the peers' addresses: failed in
// round 0 before init_process_group held the store's host until every rank had built the group),
// and for a subgroup rank 0 is not a member of (rank 0 returned from new_group at once and left
// while the members were building it: failed in round 0 too).
TEST(Spawn, RankZeroLeavingRightAfterInitOrANewGroupDoesNotBreakTheOthers) {
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(round);
    if (backend_available("gloo")) {
      spawn(4, [](int) {
        InitOptions o;
        o.backend = "gloo";
        o.timeout = 20s;
        init_process_group(o);
      }, spawn_options());
    }
    spawn(4, [](int rank) {
      InitOptions o;
      o.timeout = 20s;
      init_process_group(o);
      auto sub = new_group({1, 2, 3});
      require((rank == 0) == (sub == nullptr), "membership of new_group");
    }, spawn_options());
  }
}

// A rank that skips new_group (it must call it, member or not): the store's host, which waits for
// every rank to have built the group, stops naming it and the rule: at the timeout while the rank
// lives on, within a 250 ms slice of its wait once the rank has exited (the host knows every
// rank's pid and host from the rendezvous), instead of waiting for a dead rank until the timeout.
TEST(Spawn, ARankSkippingNewGroupIsNamedByTheStoresHost) {
  for (bool exits : {false, true}) {
    SCOPED_TRACE(exits ? "the rank exits" : "the rank lives on");
    spawn(3, [exits](int rank) {
      InitOptions o;
      o.timeout = 20s;
      init_process_group(o);
      if (rank == 2) {  // breaks the rule
        if (!exits) std::this_thread::sleep_for(3s);
        return;
      }
      const auto t0 = Clock::now();
      try {
        auto sub = new_group({0, 1}, exits ? 20000ms : 1500ms);
        require(rank == 1 && sub != nullptr, fmt::format("rank {}: new_group returned", rank));
      } catch (const CommError& e) {
        const std::string m = e.what();
        const char* want = exits ? "new_group: rank 2 (process " : "rank(s) 2 of 3 did not finish building the group";
        require(rank == 0 && m.find(want) != std::string::npos &&
                    (!exits || m.find(") exited before finishing building the group") != std::string::npos) &&
                    m.find("every rank of the default group must call new_group") != std::string::npos,
                fmt::format("rank {}: unexpected message: {}", rank, m));
        require(!exits || Clock::now() - t0 < 5s, "the host took longer than 5 s to name the rank that exited");
        return;
      }
    }, spawn_options());
  }
}

// In a spawned rank: init_process_group(o) must throw ValueError within 5 s (well inside o's
// timeout of 20 s) with every string of `wants` in its message.
void require_init_error(int rank, const InitOptions& o, const std::vector<std::string>& wants) {
  const auto t0 = Clock::now();
  try {
    init_process_group(o);
  } catch (const ValueError& e) {
    const std::string m = e.what();
    for (const std::string& w : wants) {
      require(m.find(w) != std::string::npos, fmt::format("rank {}: '{}' not in the message: {}", rank, w, m));
    }
    require(Clock::now() - t0 < 5s, fmt::format("rank {}: took longer than 5 s", rank));
    return;
  }
  require(false, fmt::format("rank {}: init_process_group returned", rank));
}

// A rank started with another world size than the others (a typo in one rank's WORLD_SIZE):
// before, the side with the larger size waited for ranks that never came and the other side timed
// out in the shm group's construction, blaming a rank that had joined. Now both stop at the
// rendezvous with the two sizes, well within the timeout, whichever side rank 0 is on.
TEST(Spawn, RanksWithDifferentWorldSizesStopAtTheRendezvousNamingBoth) {
  for (int odd : {0, 1}) {
    SCOPED_TRACE(odd);
    spawn(2, [odd](int rank) {
      InitOptions o;
      o.timeout = 20s;
      o.world_size = rank == odd ? 3 : 2;
      require_init_error(rank, o,
                         {fmt::format("the ranks disagree on the world size: rank {} was started with {}, rank {} with {}",
                                      rank, o.world_size, 1 - rank, 5 - o.world_size),
                          "start every rank with the same WORLD_SIZE"});
    }, spawn_options());
  }
}

// Ranks that ask for different backends stop at the rendezvous naming both, where before each
// waited the whole timeout inside its own backend's construction for keys the other never set.
TEST(Spawn, RanksWithDifferentBackendsStopAtTheRendezvousNamingBoth) {
  if (!backend_available("gloo")) GTEST_SKIP() << "built without gloo";
  spawn(2, [](int rank) {
    InitOptions o;
    o.timeout = 20s;
    o.backend = rank == 0 ? "shm" : "gloo";
    require_init_error(rank, o,
                       {rank == 0 ? "the ranks disagree on the backend: rank 0 asked for \"shm\", rank 1 for \"gloo\""
                                  : "the ranks disagree on the backend: rank 1 asked for \"gloo\", rank 0 for \"shm\"",
                        "pass the same backend on every rank"});
  }, spawn_options());
}

// A rank that never calls init_process_group is named by every rank's rendezvous timeout, and
// only it: the ranks waiting for rank 0 (a rank reads rank 0's announcement before its own) are
// not counted as missing. file:// keeps the store up without rank 0.
TEST(Spawn, TheRendezvousTimeoutNamesOnlyTheRankThatNeverCame) {
  for (int absent : {0, 2}) {
    SCOPED_TRACE(absent);
    const std::string path = fmt::format("/tmp/tandem_absent_{}_{}", static_cast<long>(getpid()),
                                         Clock::now().time_since_epoch().count());
    spawn(3, [&](int rank) {
      if (rank == absent) return;
      InitOptions o;
      o.init_method = "file://" + path;
      o.timeout = 1500ms;
      try {
        init_process_group(o);
        require(false, fmt::format("rank {}: init_process_group returned", rank));
      } catch (const Timeout& e) {
        const std::string m = e.what();
        require(m.find(fmt::format("rank(s) {} of 3 did not join the rendezvous within 1500 ms (rank {} waited)",
                                   absent, rank)) != std::string::npos,
                fmt::format("rank {}: unexpected message: {}", rank, m));
      }
    }, spawn_options());
    std::remove(path.c_str());
  }
}

// Two processes started with the same RANK: one of them is told so at the rendezvous, the other
// and rank 0 go on as a group of two. Before, the stray failed in the shm group's construction
// with a misleading error about hosts and /dev/shm.
TEST(Spawn, ARankStartedTwiceIsToldSoAndTheOthersGoOn) {
  const std::string told = fmt::format("/tmp/tandem_twice_{}_{}", static_cast<long>(getpid()),
                                       Clock::now().time_since_epoch().count());
  spawn(3, [&](int process) {
    InitOptions o;
    o.timeout = 20s;
    o.world_size = 2;
    o.rank = std::min(process, 1);  // processes 1 and 2 both claim rank 1
    try {
      init_process_group(o);
    } catch (const ValueError& e) {
      const std::string m = e.what();
      require(process != 0 && m.find("rank 1 was started twice: process ") != std::string::npos &&
                  m.find("already joined as rank 1; start each rank once, with its own RANK from 0 to 1") !=
                      std::string::npos,
              fmt::format("process {}: unexpected message: {}", process, m));
      std::ofstream(told, std::ios::app) << process << "\n";
      return;
    }
    check_sum_on_default_group(1000);
    // Rank 0 hosts the store: stay until the stray has been told (it may start late on a busy
    // machine, when a finished job would leave it no store to connect to).
    const auto deadline = Clock::now() + 20s;
    while (!std::filesystem::exists(told) && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
    destroy_process_group();
  }, spawn_options());
  std::ifstream in(told);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 1) << "processes told they were started twice";
  std::remove(told.c_str());
}

// A file:// store used a second time (PyTorch, too, requires a new, empty file for every init):
// the keys it kept from the first group, whose processes and shared memory are gone, would send
// the ranks into the backend's construction with dead peers' names. Now each rank stops at the
// rendezvous saying the store was used before (same process) or left by a run that has exited.
TEST(Spawn, AFileStoreUsedAgainIsNamedAtTheRendezvous) {
  const std::string path = fmt::format("/tmp/tandem_file_reinit_{}_{}", static_cast<long>(getpid()),
                                       Clock::now().time_since_epoch().count());
  auto init = [&] {
    InitOptions o;
    o.init_method = "file://" + path;
    o.timeout = 20s;
    init_process_group(o);
  };
  spawn(2, [&](int rank) {
    init();
    check_sum_on_default_group(4099);
    destroy_process_group();
    try {
      init();
      require(false, fmt::format("rank {}: init over the used file returned", rank));
    } catch (const ValueError& e) {
      const std::string m = e.what();
      require(m.find("this process already joined this store as rank") != std::string::npos &&
                  m.find("a new, empty file for file://") != std::string::npos,
              fmt::format("rank {}: unexpected message: {}", rank, m));
    }
  }, spawn_options());
  // Other processes over the file the first ones left.
  spawn(2, [&](int rank) {
    try {
      init();
      require(false, fmt::format("rank {}: init over the left file returned", rank));
    } catch (const ValueError& e) {
      const std::string m = e.what();
      require(m.find(fmt::format("the store already holds rank {}'s key from process ", rank)) != std::string::npos &&
                  m.find("which has exited: the store was left by an earlier run") != std::string::npos,
              fmt::format("rank {}: unexpected message: {}", rank, m));
    }
  }, spawn_options());
  std::remove(path.c_str());
}

// The backend-agnostic sweep (tests/dist/collective_sweep.h, written for the mpi backend) over
// shm ranks that are real processes: a second, independent reference implementation.
TEST(Spawn, SharedCollectiveSweepOnShmProcesses) {
  for (int n : {2, 4}) {
    spawn(n, [](int) {
      InitOptions o;
      o.timeout = 30s;
      init_process_group(o);
      testing::run_collective_sweep(*default_group());
      destroy_process_group();
    }, spawn_options(120s));
  }
}

TEST(Spawn, FileInitMethod) {
  const std::string path = fmt::format("/tmp/tandem_file_init_{}_{}", static_cast<long>(getpid()), Clock::now().time_since_epoch().count());
  spawn(2, [&](int rank) {
    InitOptions o;
    o.init_method = "file://" + path;
    o.timeout = 20s;
    init_process_group(o);
    check_sum_on_default_group(4099);
    destroy_process_group();
  }, spawn_options());
  std::remove(path.c_str());
}

TEST(Spawn, ChildExceptionIsRethrownWithItsRank) {
  try {
    spawn(2, [](int rank) {
      if (rank == 1) throw ValueError("bad thing on rank one");
    }, spawn_options());
    FAIL() << "no error";
  } catch (const SpawnError& e) {
    EXPECT_EQ(e.result().rank, 1);
    EXPECT_NE(std::string(e.what()).find("ValueError: bad thing on rank one"), std::string::npos) << e.what();
  }
}

TEST(Spawn, TimeoutKillsAndNamesTheRanks) {
  try {
    spawn(2, [](int rank) {
      if (rank == 0) sleep(30);
    }, spawn_options(500ms));
    FAIL() << "no error";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 0 of 2"), std::string::npos) << e.what();
  }
}

TEST(Spawn, RankThatNeverStartsIsNamedAtRendezvous) {
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(3, [](int rank) {
    if (rank == 2) return;  // never joins
    InitOptions o;
    o.timeout = 1500ms;
    try {
      init_process_group(o);
    } catch (const CommError& e) {
      // Rank 0 (the store's host) times out; rank 1 either times out too or, when rank 0 gave up
      // first, loses the store: both must name the missing rank.
      const std::string m = e.what();
      require(m.find("rank(s) 2 of 3 did not join") != std::string::npos ||
                  (rank == 1 && m.find("rank(s) 2 of 3 had not joined") != std::string::npos),
              "unexpected message: " + m);
      return;
    }
    throw std::runtime_error("init_process_group succeeded without rank 2");
  }, opts);
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
}

// Runs all_reduce on `b` in a loop; rank 1 kills itself at iteration `kill_at`. On every other
// rank the loop must end in a CommError naming rank 1 as dead (and, if asked, the collective)
// within 2x `timeout`; finishing the loop without an error fails.
void all_reduce_until_rank1_dies(ProcessGroup& pg, Buffer b, int rank, int kill_at,
                                 std::chrono::milliseconds timeout, bool names_collective) {
  for (int it = 0; it < kill_at + 100000; ++it) {
    if (rank == 1 && it == kill_at) raise(SIGKILL);
    const auto t0 = Clock::now();
    try {
      pg.all_reduce(b)->wait();
    } catch (const CommError& e) {
      const auto waited_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
      const std::string m = e.what();
      require(m.find("rank 1 (pid") != std::string::npos && m.find("died") != std::string::npos,
              "the error does not name the dead rank: " + m);
      if (names_collective) {
        require(m.find("all_reduce #") != std::string::npos, "the error does not name the collective: " + m);
      }
      require(waited_ms < 2 * timeout,
              fmt::format("error after {} ms (limit {} ms)", waited_ms.count(), 2 * timeout.count()));
      std::fprintf(stderr, "rank %d got, after %lld ms: %s\n", rank, static_cast<long long>(waited_ms.count()),
                   m.c_str());
      return;
    }
  }
  throw std::runtime_error("the loop finished without an error");
}

TEST(Spawn, KilledRankBecomesAnErrorNamingItOnEverySurvivor) {
  const auto timeout = 2000ms;
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(3, [&](int rank) {
    InitOptions o;
    o.timeout = timeout;
    init_process_group(o);
    auto pg = default_group();
    const int64_t count = 1 << 18;
    auto mem = pg->allocate(count * 4);
    all_reduce_until_rank1_dies(*pg, Buffer{mem.get(), count, DType::f32, kCPU}, rank, 30, timeout, false);
  }, opts);
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
  EXPECT_TRUE(results[0].ok()) << results[0].describe();
  EXPECT_TRUE(results[2].ok()) << results[2].describe();
}

// A broadcast in which each rank takes itself for the root reads no peer, so nothing compared it:
// every rank kept its own data and the next collective lined up as if nothing happened. Each
// collective now carries a hash of the ones before it, and the next comparison names the
// broadcast that differed.
TEST(Spawn, BroadcastsWithDifferentRootsAreAMismatchAtTheNextCollective) {
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(2, [](int rank) {
    InitOptions o;
    o.timeout = 10s;
    init_process_group(o);
    auto pg = default_group();
    std::vector<float> x(1000, static_cast<float>(rank));
    pg->broadcast(Buffer{x.data(), 1000, DType::f32, kCPU}, rank)->wait();
    try {
      pg->barrier()->wait();
    } catch (const CommError& e) {
      const std::string m = e.what();
      // (Either rank may be the one that notices; the other relays its words.)
      require(m.find("collective mismatch before #1") != std::string::npos &&
                  m.find("called broadcast #0 (f32, 1000, root 0)") != std::string::npos &&
                  m.find("called broadcast #0 (f32, 1000, root 1)") != std::string::npos,
              "the error does not name the broadcasts: " + m);
      std::_Exit(0);
    }
    throw std::runtime_error("the barrier after broadcasts with different roots passed");
  }, opts);
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
}

// A rank that fails while the shm group is built (here a malformed TANDEM_SHM_HEAP_BYTES) used to
// leave the others waiting for its keys until their timeout (30 minutes by default), to be told
// only "rank(s) 1 did not create their shared-memory segments". It now publishes why, and the
// others stop at once with its reason (rank 0, which hosts the store, stays until they have read
// it).
TEST(Spawn, ARankThatFailsToSetUpTheShmGroupStopsTheOthersAtOnceSayingWhy) {
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(3, [](int rank) {
    if (rank == 1) setenv("TANDEM_SHM_HEAP_BYTES", "4G", 1);
    InitOptions o;
    o.timeout = 30s;
    const auto t0 = Clock::now();
    try {
      init_process_group(o);
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (rank == 1) {
        require(m.find("TANDEM_SHM_HEAP_BYTES='4G' is not a byte count") != std::string::npos, m);
      } else {
        require(m.find("rank 1 failed to set up the group") != std::string::npos &&
                    m.find("TANDEM_SHM_HEAP_BYTES='4G'") != std::string::npos,
                "the error does not give rank 1's reason: " + m);
        require(Clock::now() - t0 < 10s, "rank 1's failure took more than 10 s to stop rank " + std::to_string(rank));
      }
      std::_Exit(0);
    }
    throw std::runtime_error("init_process_group succeeded");
  }, opts);
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
}

// The shm backend's tuning variables choose the all_reduce protocol; ranks whose environments
// differ used to run different algorithms on one buffer (a push rank kept its own input in the
// slice a pull rank never wrote; readers with another chunk size copied chunks not reduced yet).
// Rank 0's choices now hold for the group.
TEST(Spawn, ShmTuningVariablesThatDifferAcrossRanksFollowRankZero) {
  spawn(3, [](int rank) {
    setenv("TANDEM_SHM_ALLREDUCE", rank == 1 ? "pull" : "push", 1);
    setenv("TANDEM_SHM_CHUNK_BYTES", rank == 2 ? "8192" : "262144", 1);
    setenv("TANDEM_SHM_SMALL_BYTES", rank == 0 ? "1024" : "16384", 1);
    InitOptions o;
    o.timeout = 10s;
    init_process_group(o);
    for (const int64_t count : {int64_t{1000}, int64_t{3000}, int64_t{300001}}) check_sum_on_default_group(count);
    auto pg = default_group();
    std::vector<float> x(1 << 19);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 5);
    pg->all_reduce(Buffer{x.data(), static_cast<int64_t>(x.size()), DType::f32, kCPU})->wait();
    for (size_t i = 0; i < x.size(); ++i) {
      require(x[i] == 6.0f * static_cast<float>(i % 5), fmt::format("rank {} element {}: {}", rank, i, x[i]));
    }
    destroy_process_group();
  }, spawn_options());
}

// A rank that finished its part of a collective may leave before the others finish theirs: here
// rank 1's gather input goes through a slot (small), so it returns at once, destroys the group and
// exits, while rank 0 (the root) still waits for rank 2. Rank 0 used to fail the gather with
// "rank 1 left the group"; now only a rank that still owes the collective something dooms it.
TEST(Spawn, ARankThatFinishedACollectiveMayLeaveBeforeTheOthersFinishIt) {
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(3, [](int rank) {
    InitOptions o;
    o.timeout = 10s;
    init_process_group(o);
    auto pg = default_group();
    std::vector<float> in(16, static_cast<float>(rank + 1)), out(48, 0.0f);
    if (rank == 2) std::this_thread::sleep_for(400ms);
    pg->gather(Buffer{out.data(), 48, DType::f32, kCPU}, Buffer{in.data(), 16, DType::f32, kCPU}, 0)->wait();
    if (rank == 0) {
      for (int i = 0; i < 48; ++i) {
        require(out[static_cast<size_t>(i)] == static_cast<float>(i / 16 + 1), fmt::format("gathered[{}] = {}", i, out[static_cast<size_t>(i)]));
      }
    }
    pg.reset();
    destroy_process_group();
  }, opts);
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
}

// /dev/shm smaller than what the shm backend needs (Docker's default is 64 MiB): the group's
// memory is a sparse segment, and a page tmpfs has no room for used to be SIGBUS at its first
// touch, killing the rank without a word. Now the heap backs pages as it grows (fallocate): a
// buffer that does not fit is an error naming /dev/shm's free space and the fix, and what fits
// still works. The test runs in a child with a mount namespace of its own and a 16 MiB tmpfs on
// /dev/shm (it needs the right to unshare one: root or user namespaces; else it is skipped).
TEST(Spawn, ASmallDevShmIsAnErrorThatSaysSoNotABusError) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0) std::_Exit(77);
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=16m") != 0) {
      std::_Exit(77);
    }
    auto opts = spawn_options();
    opts.stop_others_on_failure = false;
    auto results = spawn_results(2, [](int) {
      InitOptions o;
      o.timeout = 5s;
      init_process_group(o);
      check_sum_on_default_group(1 << 18);  // 1 MiB in the heap: fits
      auto pg = default_group();
      const int64_t count = 3 << 20;  // 12 MiB: fits once (one rank's allocate()); the other
      auto mem = pg->allocate(count * 4);  // falls back to ordinary memory, its scratch does not fit
      require(mem != nullptr, "allocate returned null");
      std::memset(mem.get(), 0, count * 4);
      pg->all_reduce(Buffer{mem.get(), count, DType::f32, kCPU})->wait();
      throw std::runtime_error("a 12 MiB all_reduce fitted into a 16 MiB /dev/shm next to another rank's");
    }, opts);
    int status = 0;
    for (const auto& r : results) {
      if (r.signal != 0 || r.ok()) {
        std::fprintf(stderr, "%s\n", r.describe().c_str());
        status = 1;
      }
    }
    const std::string m = results[0].error + results[1].error;
    if (m.find("no room in shared memory") == std::string::npos || m.find("/dev/shm has") == std::string::npos ||
        m.find("--shm-size") == std::string::npos) {
      std::fprintf(stderr, "no rank named /dev/shm's size and the fix: %s | %s\n", results[0].describe().c_str(),
                   results[1].describe().c_str());
      status = 1;
    }
    std::_Exit(status);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the test's child was killed by signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot unshare a mount namespace here (needs root or user namespaces)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's report above";
}

// Over gloo (TCP): rank 1 is SIGKILLed from a thread at a random moment inside 8 MiB all_reduces,
// so the survivors may be writing to its socket (or to each other's, mid-ring) when it dies. Each
// must get an error naming rank 1 (gloo itself only says "Connection reset by peer
// [127.0.0.1]:port"; the group looks its peers' pids up on this host), not the SIGPIPE of a write
// to a closed socket, whose default action kills the process (measured without the group's
// SIGPIPE mask: 3 of 30 such runs lost a survivor to it; hence 24 rounds here).
TEST(Spawn, KilledRankOverGlooIsAnErrorNamingItNotASigpipe) {
  if (!backend_available("gloo")) GTEST_SKIP() << "built without gloo (libgloo-dev)";
  const auto timeout = 2000ms;
  for (int round = 0; round < 24; ++round) {
    SCOPED_TRACE(round);
    auto opts = spawn_options();
    opts.stop_others_on_failure = false;
    auto results = spawn_results(3, [&](int rank) {
      InitOptions o;
      o.backend = "gloo";
      o.timeout = timeout;
      init_process_group(o);
      auto pg = default_group();
      std::vector<float> data(1 << 21, 1.0f);
      if (rank == 1) {
        std::thread([delay = 10 + 3 * round] {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay));
          raise(SIGKILL);
        }).detach();
      }
      for (;;) {
        const auto t0 = Clock::now();
        try {
          pg->all_reduce(Buffer{data.data(), static_cast<int64_t>(data.size()), DType::f32, kCPU})->wait();
        } catch (const CommError& e) {
          const std::string m = e.what();
          require(m.find("rank 1 (pid") != std::string::npos && m.find("died") != std::string::npos,
                  "the error does not name the dead rank: " + m);
          require(Clock::now() - t0 < 2 * timeout, "the error came after more than twice the timeout");
          // Stay a moment: a survivor that left at once would be a second dead peer in the
          // other survivor's diagnosis. Then skip the destructors that would talk to the group.
          std::this_thread::sleep_for(300ms);
          std::_Exit(0);
        }
      }
    }, opts);
    EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
    EXPECT_TRUE(results[0].ok()) << results[0].describe();
    EXPECT_TRUE(results[2].ok()) << results[2].describe();
  }
}

// The latency path: 4 KiB all_reduce on allocate()d buffers (2 ranks: in place, run on the
// caller's thread). A killed rank is still an error naming it on the survivor within 2x the timeout.
TEST(Spawn, KilledRankDuringSmallAllReducesIsAnErrorNamingIt) {
  const auto timeout = 1000ms;
  auto opts = spawn_options();
  opts.stop_others_on_failure = false;
  auto results = spawn_results(2, [&](int rank) {
    InitOptions o;
    o.timeout = timeout;
    init_process_group(o);
    auto pg = default_group();
    auto mem = pg->allocate(4096);
    all_reduce_until_rank1_dies(*pg, Buffer{mem.get(), 1024, DType::f32, kCPU}, rank, 2000, timeout, true);
  }, opts);
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
  EXPECT_TRUE(results[0].ok()) << results[0].describe();
}

// ---- Work ----

class DescribedWork final : public Work {
 public:
  mutable int calls = 0;

 protected:
  std::string describe() const override {
    ++calls;
    return "test_op #7 (f32, 3)";
  }
};

TEST(Work, CompletedWorkWaitsWithoutBlockingAndReportsSuccess) {
  auto w = Work::completed("done op");
  EXPECT_TRUE(w->is_completed());
  EXPECT_TRUE(w->is_success());
  EXPECT_EQ(w->exception(), nullptr);
  w->wait(0ms);  // already complete: no timeout even with a zero limit
  EXPECT_EQ(w->description(), "done op");
}

TEST(Work, FailedWorkRethrowsItsErrorOnEveryWait) {
  auto w = Work::failed(std::make_exception_ptr(CommError("boom")));
  EXPECT_TRUE(w->is_completed());
  EXPECT_FALSE(w->is_success());
  EXPECT_NE(w->exception(), nullptr);
  EXPECT_THROW(w->wait(), CommError);
  EXPECT_THROW(w->wait(1ms), CommError);
}

TEST(Work, DescriptionIsBuiltLazilyOnceAndNamesTheOpOnTimeout) {
  DescribedWork w;
  EXPECT_EQ(w.calls, 0);
  EXPECT_FALSE(w.is_completed());
  EXPECT_EQ(w.exception(), nullptr);
  try {
    w.wait(20ms);
    ADD_FAILURE() << "wait on an unfinished Work returned";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("test_op #7 (f32, 3): Work::wait timed out after 20 ms"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(w.description(), "test_op #7 (f32, 3)");
  EXPECT_EQ(w.calls, 1);
}

TEST(Work, FinishOnAnotherThreadWakesTheWaiterAndOnlyTheFirstFinishCounts) {
  auto w = std::make_shared<Work>("op");
  std::thread t([w] {
    std::this_thread::sleep_for(20ms);
    w->finish(std::make_exception_ptr(CommError("first")));
    w->finish();  // ignored
  });
  const auto t0 = Clock::now();
  try {
    w->wait(10s);
    ADD_FAILURE() << "the error of the first finish was lost";
  } catch (const CommError& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_LT(Clock::now() - t0, 5s);
  t.join();
  EXPECT_FALSE(w->is_success());
}

}  // namespace
}  // namespace tandem::dist
