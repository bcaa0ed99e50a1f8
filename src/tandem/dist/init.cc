// Process-group setup (torch.distributed's module-level functions): the launch environment
// (torchrun, OpenMPI, Slurm), the rendezvous store of init_method (env://, tcp://, file://), the
// default group and its subgroups, and the backend factory by name.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/ranges.h>

#include "tandem/dist/backends.h"
#include "tandem/dist/file_store.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/tcp_store.h"

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;

const char* getenv_nonempty(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

int parse_int_var(const char* name, const char* value, int min_value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  TANDEM_CHECK(errno == 0 && end != value && *end == '\0' && v >= min_value && v <= (1L << 30), ValueError,
               "environment variable {}='{}' is not an integer >= {}", name, value, min_value);
  return static_cast<int>(v);
}

int int_var(const char* name, int min_value) {
  const char* v = getenv_nonempty(name);
  return v == nullptr ? -1 : parse_int_var(name, v, min_value);
}

// init_method without its "?query" (and, for tcp://, without a "/path" after the port), with the
// query's rank and world_size (-1 when absent), as PyTorch's rendezvous() reads them.
struct InitUrl {
  std::string base;
  int rank = -1;
  int world_size = -1;
};

InitUrl parse_init_url(const std::string& m) {
  InitUrl u;
  const size_t q = m.find('?');
  u.base = m.substr(0, q);
  if (u.base.rfind("tcp://", 0) == 0) {
    if (const size_t slash = u.base.find('/', 6); slash != std::string::npos) u.base.resize(slash);
  }
  if (q == std::string::npos) return u;
  const std::string query = m.substr(q + 1);
  size_t pos = 0;
  while (pos <= query.size()) {
    size_t amp = query.find('&', pos);
    if (amp == std::string::npos) amp = query.size();
    const std::string item = query.substr(pos, amp - pos);
    pos = amp + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    const std::string what = fmt::format("{} in init_method '{}'", key, m);
    if (key == "rank") {
      u.rank = parse_int_var(what.c_str(), value.c_str(), 0);
    } else if (key == "world_size") {
      u.world_size = parse_int_var(what.c_str(), value.c_str(), 1);
    } else if (key != "use_libuv") {  // PyTorch's TCPStore option: nothing to choose here
      throw ValueError(fmt::format("init_method '{}': unknown query parameter \"{}\"; the query may give rank and "
                                   "world_size (e.g. ?rank=0&world_size=2)",
                                   m, key));
    }
  }
  return u;
}

}  // namespace

// The first host of a Slurm node list: "node[01-04,07],login1" -> "node01", "a,b" -> "a",
// "gpu-[3-5]" -> "gpu-3". Throws ValueError for an unbalanced bracket.
std::string slurm_first_host(const std::string& nodelist) {
  size_t i = 0;
  std::string host;
  while (i < nodelist.size() && nodelist[i] != ',') {
    if (nodelist[i] == '[') {
      const size_t close = nodelist.find(']', i);
      TANDEM_CHECK(close != std::string::npos, ValueError,
                   "the Slurm node list '{}' has an unclosed '['", nodelist);
      const std::string range = nodelist.substr(i + 1, close - i - 1);
      const size_t end = range.find_first_of(",-");
      host += range.substr(0, end);  // the first number keeps its zero padding
      i = close + 1;
    } else {
      host += nodelist[i++];
    }
  }
  TANDEM_CHECK(!host.empty(), ValueError, "the Slurm node list '{}' names no host", nodelist);
  return host;
}

LaunchEnv read_launch_env() {
  LaunchEnv env;
  if (getenv_nonempty("RANK") != nullptr || getenv_nonempty("WORLD_SIZE") != nullptr) {
    env.source = "torchrun";
    env.rank = int_var("RANK", 0);
    env.world_size = int_var("WORLD_SIZE", 1);
    env.local_rank = int_var("LOCAL_RANK", 0);
    env.local_world_size = int_var("LOCAL_WORLD_SIZE", 1);
  } else if (getenv_nonempty("OMPI_COMM_WORLD_RANK") != nullptr) {
    env.source = "openmpi";
    env.rank = int_var("OMPI_COMM_WORLD_RANK", 0);
    env.world_size = int_var("OMPI_COMM_WORLD_SIZE", 1);
    env.local_rank = int_var("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    env.local_world_size = int_var("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (getenv_nonempty("SLURM_PROCID") != nullptr) {
    env.source = "slurm";
    env.rank = int_var("SLURM_PROCID", 0);
    env.world_size = int_var("SLURM_NTASKS", 1);
    env.local_rank = int_var("SLURM_LOCALID", 0);
    env.local_world_size = int_var("SLURM_NTASKS_PER_NODE", 1);
    // The step's first node runs its task 0 (an srun on part of the allocation does not start on
    // the job's first node), else the job's.
    if (const char* step = getenv_nonempty("SLURM_STEP_NODELIST")) env.master_addr = slurm_first_host(step);
    else if (const char* nodes = getenv_nonempty("SLURM_JOB_NODELIST")) env.master_addr = slurm_first_host(nodes);
    else if (const char* nodes2 = getenv_nonempty("SLURM_NODELIST")) env.master_addr = slurm_first_host(nodes2);
  }
  // MASTER_ADDR/MASTER_PORT win over what a scheduler implies.
  if (const char* addr = getenv_nonempty("MASTER_ADDR")) env.master_addr = addr;
  if (const char* port = getenv_nonempty("MASTER_PORT")) env.master_port = parse_int_var("MASTER_PORT", port, 1);
  TANDEM_CHECK(env.master_port <= 65535, ValueError, "MASTER_PORT={} is not a TCP port (1..65535)", env.master_port);
  if (env.rank >= 0 && env.world_size >= 1) {
    TANDEM_CHECK(env.rank < env.world_size, ValueError,
                 "the {} environment gives rank {} but world size {}: the rank must be < the world size",
                 env.source, env.rank, env.world_size);
  }
  return env;
}

// ---- backends by name ----

std::shared_ptr<ProcessGroup> make_process_group(const std::string& backend, std::shared_ptr<Store> store,
                                                 int rank, int size, ProcessGroupOptions options) {
  TANDEM_CHECK(store != nullptr, ValueError, "make_process_group('{}'): the store is null", backend);
  if (backend == "shm") return make_shm_group(std::move(store), rank, size, options);
  if (backend == "mpi") return make_mpi_group(std::move(store), rank, size, options);
  if (backend == "gloo") return make_gloo_group(std::move(store), rank, size, options);
  if (backend == "nccl") return make_nccl_group(std::move(store), rank, size, options);
  throw ValueError(fmt::format("unknown process-group backend '{}': expected shm, mpi, gloo or nccl", backend));
}

// ---- the default group ----

namespace {

struct Announcement;

struct GroupState {
  std::mutex mu;
  std::shared_ptr<ProcessGroup> default_pg;
  std::shared_ptr<Store> store;  // the job's store (unprefixed)
  std::string backend;
  std::string group_name;
  std::vector<std::weak_ptr<ProcessGroup>> subgroups;
  int64_t next_subgroup = 0;
  std::vector<Announcement> announced;  // the default group's rendezvous, as this rank read it
  // The store of the last destroyed default group: alive while the caller still holds one of its
  // groups (their references keep it; its TCPStore server keeps its port).
  std::weak_ptr<Store> destroyed_store;
  int destroyed_port = -1;  // its TCPStore's port, when it hosts one
};

GroupState& state() {
  static GroupState* s = new GroupState();  // leaked: groups may be destroyed during static teardown
  return *s;
}

// "<prefix>/<rank>" for every rank of a group of `size`.
std::vector<std::string> rank_keys(const std::string& prefix, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(fmt::format("{}/{}", prefix, r));
  return keys;
}

// The ranks whose key (rank_keys order) is not in the store yet.
std::vector<int> missing_ranks(Store& store, const std::vector<std::string>& keys) {
  std::vector<int> missing;
  for (size_t r = 0; r < keys.size(); ++r) {
    if (!store.check({keys[r]})) missing.push_back(static_cast<int>(r));
  }
  return missing;
}

// Waits for every key of `keys` for one slice of at most 250 ms (less when `deadline` is nearer):
// whether they are all there. Waits that check something between slices are loops over it.
bool wait_slice(Store& store, const std::vector<std::string>& keys, Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  try {
    store.wait(keys, std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(250))));
    return true;
  } catch (const Timeout&) {
    return false;
  }
}

// What a rank announces at the rendezvous, as its key's value "<pid> <world size> <backend>
// <nonce> <pid scope> <host>". The nonce tells this call's announcement from an equal one that an
// earlier call of the same process left in the store.
struct Announcement {
  long pid = -1;
  int world_size = -1;
  std::string backend, nonce, scope, host;

  static Announcement mine(int world_size, const std::string& backend) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::random_device rd;
    const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                           static_cast<uint64_t>(Clock::now().time_since_epoch().count());
    // Every field is one word, never empty (parse() reads them by whitespace).
    return {static_cast<long>(getpid()), world_size, backend.empty() ? "-" : backend, fmt::format("{:016x}", nonce),
            pid_scope(), host[0] != '\0' ? host : "-"};
  }
  static Announcement parse(const Bytes& value) {
    std::istringstream in(to_string(value));
    Announcement a;
    in >> a.pid >> a.world_size >> a.backend >> a.nonce >> a.scope >> a.host;
    return in ? a : Announcement{};
  }
  std::string text() const { return fmt::format("{} {} {} {} {} {}", pid, world_size, backend, nonce, scope, host); }
  std::string process() const { return fmt::format("process {} on {}", pid, host); }
  // Whether `other` is a process this one can check by pid.
  bool same_pids(const Announcement& other) const { return other.scope == scope && other.host == host; }
  // Whether this announcer, a process that same_pids() with the caller, has exited.
  bool exited() const { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }
};

// Every rank announces itself (pid, host, and the world size and backend it was started with) and
// waits for the others; a missing rank is named, also when the store itself goes away meanwhile
// (rank 0, its host, gave up first). A rank started with another world size or backend would wait
// for ranks that never come, or leave the others waiting in the backend's construction; so every
// other rank reads rank 0's announcement before making its own, and rank 0 reads each rank's as it
// arrives: both sides of a disagreement stop at once with an error naming both values (the other
// rank has read rank 0's key before rank 0 can see its key and leave with the store).
// Returns the announcements this rank read, by rank: rank 0 has every rank's, another rank only
// rank 0's (the rest default: pid -1).
std::vector<Announcement> rendezvous(Store& store, const std::string& prefix, int rank, int size,
                                     const std::string& backend, std::chrono::milliseconds timeout) {
  const std::vector<std::string> keys = rank_keys(prefix + "/rank", size);
  const Announcement me = Announcement::mine(size, backend);
  const auto deadline = Clock::now() + timeout;
  // Throws when `them` (rank `other`'s announcement) disagrees with this rank's.
  auto compare = [&](int other, const Announcement& them) {
    TANDEM_CHECK(them.world_size == me.world_size, ValueError,
                 "init_process_group: the ranks disagree on the world size: rank {} was started with {}, rank {} "
                 "with {}; start every rank with the same WORLD_SIZE (or InitOptions::world_size)",
                 rank, me.world_size, other, them.world_size);
    TANDEM_CHECK(them.backend == me.backend, ValueError,
                 "init_process_group: the ranks disagree on the backend: rank {} asked for \"{}\", rank {} for "
                 "\"{}\"; pass the same backend on every rank",
                 rank, me.backend, other, them.backend);
  };
  std::vector<Announcement> read(keys.size());
  std::vector<bool> compared(keys.size(), false);  // rank 0: whose announcement it has read
  compared[0] = true;
  std::vector<int> missing;
  // Waits in slices until every key of `wanted` is in the store (rank 0 reading the announcements
  // of the ranks that arrived meanwhile), or throws naming the ranks still missing.
  auto wait_for = [&](const std::vector<std::string>& wanted) {
    for (;;) {
      bool done = false;
      try {
        done = wait_slice(store, wanted, deadline);
        // Before it announces itself, a rank waits for rank 0 alone (the other ranks may be
        // waiting for rank 0 too, unannounced): only rank 0 is missing then.
        missing = done ? std::vector<int>{}
                       : wanted.size() == keys.size() ? missing_ranks(store, keys) : std::vector<int>{0};
        if (rank == 0) {
          for (size_t r = 1; r < keys.size(); ++r) {
            if (compared[r] || std::find(missing.begin(), missing.end(), static_cast<int>(r)) != missing.end()) continue;
            compared[r] = true;
            read[r] = Announcement::parse(store.get(keys[r]));
            compare(static_cast<int>(r), read[r]);
          }
        }
      } catch (const CommError& e) {
        if (missing.empty()) throw;
        throw CommError(fmt::format(
            "init_process_group: rank {} lost the store while rank(s) {} of {} had not joined the rendezvous "
            "(rank 0 hosts the store and gives up at its own timeout): {}",
            rank, fmt::join(missing, ", "), size, e.what()));
      }
      if (done) return;
      if (Clock::now() >= deadline) {
        throw Timeout(fmt::format(
            "init_process_group: rank(s) {} of {} did not join the rendezvous within {} ms (rank {} waited); "
            "check that every rank was started with the same MASTER_ADDR/MASTER_PORT (or init_method) and world size",
            fmt::join(missing, ", "), size, timeout.count(), rank));
      }
    }
  };
  // A rank's key is set once. Finding it set already means a second process started with the same
  // RANK, or a store that an earlier group used (a file:// path used again, or left by a run that
  // crashed): before, one of the two processes trained while the other failed in the backend's
  // construction, or the stale keys sent every rank into that construction with dead peers' names.
  auto announce = [&] {
    const std::string& key = keys[static_cast<size_t>(rank)];
    const Bytes got = store.compare_set(key, {}, to_bytes(me.text()));
    if (to_string(got) == me.text()) return;
    const Announcement them = Announcement::parse(got);
    const char* fresh_store =
        "give every init_process_group a store of its own: a new, empty file for file:// (as in PyTorch), or another "
        "group_name";
    TANDEM_CHECK(them.pid >= 0, ValueError,
                 "init_process_group: the store already holds rank {}'s key, written by something else than this "
                 "version's rendezvous (\"{}\"): the store was used before; {}",
                 rank, to_string(got), fresh_store);
    TANDEM_CHECK(them.pid != me.pid || !them.same_pids(me), ValueError,
                 "init_process_group: this process already joined this store as rank {} (an earlier "
                 "init_process_group over the same store); {}",
                 rank, fresh_store);
    TANDEM_CHECK(!them.same_pids(me) || !them.exited(), ValueError,
                 "init_process_group: the store already holds rank {}'s key from {}, which has exited: the store "
                 "was left by an earlier run; {}",
                 rank, them.process(), fresh_store);
    throw ValueError(fmt::format(
        "init_process_group: rank {} was started twice: {} already joined as rank {}; start each rank once, with its "
        "own RANK from 0 to {} (WORLD_SIZE - 1). (Or this process reached another job's store: give each job on a "
        "machine its own MASTER_PORT.)",
        rank, them.process(), rank, size - 1));
  };
  if (rank != 0) {
    wait_for({keys[0]});
    read[0] = Announcement::parse(store.get(keys[0]));
    announce();  // rank 0 learns of a disagreement from it
    compare(0, read[0]);
  } else {
    announce();
    read[0] = me;
  }
  wait_for(keys);
  return read;
}

// The process hosting a TCPStore (rank 0 without a launcher) must not leave while another rank
// still awaits a reply from it, or that rank fails with "connection reset" in the middle of
// building a group. After its part of building group `prefix`, every rank sets a key (the reply to
// that set is the last one it needs: the server answers a set before waking the waiters of its
// key); the host returns only when every rank has. Ranks of a FileStore skip this. `what` names
// the call in a timeout's message, `rule` (if any) follows it. `ranks` (the host's: every rank's
// rendezvous announcement) lets the host tell a rank that exited on its machine within a 250 ms
// slice, instead of waiting for it until the timeout.
void release_store_host(Store& store, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout,
                        const std::vector<Announcement>& ranks, const char* what, const char* rule = "") {
  auto* tcp = dynamic_cast<TCPStore*>(&store);
  if (tcp == nullptr) return;
  const std::vector<std::string> keys = rank_keys(prefix + "/built", size);
  store.set(keys[static_cast<size_t>(rank)], "1");
  if (!tcp->is_master()) return;
  const auto deadline = Clock::now() + timeout;
  while (!wait_slice(store, keys, deadline)) {
    const std::vector<int> missing = missing_ranks(store, keys);
    std::vector<std::string> exited;
    if (static_cast<size_t>(rank) < ranks.size()) {
      const Announcement& me = ranks[static_cast<size_t>(rank)];  // (pid -1 where the host is not rank 0)
      for (int r : missing) {
        const Announcement* a = static_cast<size_t>(r) < ranks.size() ? &ranks[static_cast<size_t>(r)] : nullptr;
        if (me.pid > 0 && a != nullptr && a->same_pids(me) && a->exited()) {
          exited.push_back(fmt::format("rank {} ({})", r, a->process()));
        }
      }
    }
    if (!exited.empty()) {
      throw CommError(fmt::format("{}: {} exited before finishing building the group (rank {}, which hosts the store, "
                                  "waited for it); its log says why{}",
                                  what, fmt::join(exited, ", "), rank, rule));
    }
    if (Clock::now() >= deadline) {
      throw Timeout(fmt::format("{}: rank(s) {} of {} did not finish building the group within {} ms (rank {}, which "
                                "hosts the store, waited for them){}",
                                what, fmt::join(missing, ", "), size, timeout.count(), rank, rule));
    }
  }
}

// `m`: o.init_method without its query (parse_init_url's base).
std::shared_ptr<Store> store_from_init_method(const InitOptions& o, const std::string& m, int rank, int world_size) {
  auto need = [](bool ok, const char* what) {
    TANDEM_CHECK(ok, ValueError, "{}", what);
  };
  std::string host;
  int port = -1;
  if (m.empty() || m == "env://") {
    const LaunchEnv env = read_launch_env();
    need(!env.master_addr.empty(),
         "MASTER_ADDR is not set: run under `tandem run` or torchrun, or set MASTER_ADDR and MASTER_PORT "
         "(e.g. MASTER_ADDR=127.0.0.1 MASTER_PORT=29500), or pass init_method=\"tcp://host:port\"");
    need(env.master_port > 0,
         "MASTER_PORT is not set: run under `tandem run` or torchrun, or set MASTER_PORT (e.g. 29500) "
         "next to MASTER_ADDR, or pass init_method=\"tcp://host:port\"");
    host = env.master_addr;
    port = env.master_port;
    // Under PyTorch's torchrun (static rendezvous) the agent already serves its own c10d store on
    // MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), in c10d's wire protocol, not ours: rank 0
    // hosts Tandem's store on the next port instead, a rule every rank derives alike.
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent_store != nullptr && std::string(agent_store) == "True") {
      TANDEM_CHECK(port < 65535, ValueError, "MASTER_PORT {} leaves no port after it for Tandem's store under torchrun",
                   port);
      ++port;
    }
  } else if (m.rfind("tcp://", 0) == 0) {
    const std::string hp = m.substr(6);
    const size_t colon = hp.rfind(':');
    TANDEM_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < hp.size(), ValueError,
                 "init_method '{}' must be tcp://host:port", m);
    host = hp.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    const std::string port_text = hp.substr(colon + 1);
    char* end = nullptr;
    errno = 0;
    const long p = std::strtol(port_text.c_str(), &end, 10);
    TANDEM_CHECK(errno == 0 && end != port_text.c_str() && *end == '\0' && p >= 1 && p <= 65535, ValueError,
                 "init_method '{}': port '{}' is not a TCP port (1..65535)", o.init_method, port_text);
    port = static_cast<int>(p);
  } else if (m.rfind("file://", 0) == 0) {
    const std::string path = m.substr(7);
    TANDEM_CHECK(!path.empty() && path[0] == '/', ValueError,
                 "init_method '{}' must be file:///absolute/path", m);
    return std::make_shared<FileStore>(path, o.timeout);
  } else {
    throw ValueError(fmt::format("init_method '{}' is not supported: use env://, tcp://host:port or file:///path", m));
  }
  TCPStoreOptions so;
  // Under `tandem run` the launcher already hosts the store (TANDEM_STORE_HOSTED=1, see
  // tools/run.cc): every rank, rank 0 too, is a client. Otherwise rank 0 hosts it, as in torch.
  const char* hosted = std::getenv("TANDEM_STORE_HOSTED");
  so.is_master = rank == 0 && !(hosted != nullptr && std::string(hosted) == "1");
  so.world_size = world_size;
  so.timeout = o.timeout;
  so.wait_for_workers = false;  // our own rendezvous names the missing ranks
  try {
    auto tcp = std::make_shared<TCPStore>(host, static_cast<uint16_t>(port), so);
    if (!so.is_master && hosted != nullptr && std::string(hosted) == "1") {
      // A launcher's store outlives a restart of the workers (across nodes it must): each attempt
      // keeps its keys apart, under torch's prefix for agent stores.
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      return std::make_shared<PrefixStore>(
          fmt::format("/worker/attempt_{}", attempt != nullptr && *attempt ? attempt : "0"), tcp);
    }
    return tcp;
  } catch (const CommError& e) {
    if (rank == 0) throw;
    throw CommError(fmt::format("{} (rank 0 hosts the store at {}:{}: did rank 0 start, with the same "
                                "MASTER_ADDR/MASTER_PORT?)", e.what(), host, port));
  }
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  GroupState& s = state();
  std::lock_guard lock(s.mu);
  TANDEM_CHECK(s.default_pg == nullptr, ValueError,
               "init_process_group was already called in this process; call destroy_process_group() first");
  int rank = options.rank, world_size = options.world_size;
  // rank and world_size from the URL's query (tcp://host:port?rank=0&world_size=2), as in PyTorch,
  // which refuses them given twice.
  const InitUrl url = parse_init_url(options.init_method);
  TANDEM_CHECK(url.rank < 0 || options.rank < 0, ValueError,
               "init_process_group: init_method '{}' gives rank={} and InitOptions::rank is {}; give it once",
               options.init_method, url.rank, options.rank);
  TANDEM_CHECK(url.world_size < 0 || options.world_size < 0, ValueError,
               "init_process_group: init_method '{}' gives world_size={} and InitOptions::world_size is {}; give it "
               "once",
               options.init_method, url.world_size, options.world_size);
  if (url.rank >= 0) rank = url.rank;
  if (url.world_size >= 0) world_size = url.world_size;
  if (rank < 0 || world_size < 0) {
    const LaunchEnv env = read_launch_env();
    if (rank < 0) rank = env.rank;
    if (world_size < 0) world_size = env.world_size;
  }
  TANDEM_CHECK(rank >= 0, ValueError,
               "RANK is not set: run under `tandem run`, torchrun, mpirun or srun, or set RANK (and WORLD_SIZE), "
               "or pass InitOptions::rank");
  TANDEM_CHECK(world_size >= 1, ValueError,
               "WORLD_SIZE is not set: run under `tandem run`, torchrun, mpirun or srun, or set WORLD_SIZE, "
               "or pass InitOptions::world_size");
  TANDEM_CHECK(rank < world_size, ValueError, "rank {} is not below the world size {}", rank, world_size);
  detail::check_timeout(options.timeout, "init_process_group");
  TANDEM_CHECK(options.backend == "shm" || options.backend == "mpi" || options.backend == "gloo" ||
                   options.backend == "nccl",
               ValueError, "unknown process-group backend '{}': expected shm, mpi, gloo or nccl", options.backend);
  std::shared_ptr<Store> store;
  try {
    store = options.store ? options.store : store_from_init_method(options, url.base, rank, world_size);
  } catch (const CommError& e) {
    // Only when hosting failed on the port the destroyed group's store still holds.
    if (s.destroyed_store.expired() || s.destroyed_port <= 0 ||
        std::string(e.what()).find(fmt::format("port {}", s.destroyed_port)) == std::string::npos)
      throw;
    throw CommError(fmt::format("{} (the store of the default group destroyed earlier is still alive in this process: "
                                "a ProcessGroup, new_group or DDP object made from it is still held; destroy_process_group "
                                "forgets groups, their last reference frees them: drop those before init_process_group "
                                "again)",
                                e.what()));
  }
  const std::string name = options.group_name.empty() ? "default_pg" : options.group_name;
  std::vector<Announcement> announced =
      rendezvous(*store, name + "/init", rank, world_size, options.backend, options.timeout);
  auto pg_store = std::make_shared<PrefixStore>(name, store);
  ProcessGroupOptions pgo;
  pgo.timeout = options.timeout;
  // Registered only once nothing can fail any more: a half-registered default group (no store)
  // would make a later init_process_group say "already called" and new_group use a null store.
  auto pg = make_process_group(options.backend, pg_store, rank, world_size, pgo);
  release_store_host(*store, name, rank, world_size, options.timeout, announced, "init_process_group");
  s.default_pg = std::move(pg);
  s.store = store;
  s.backend = options.backend;
  s.group_name = name;
  s.announced = std::move(announced);
  s.next_subgroup = 0;
  return s.default_pg;
}

bool is_initialized() {
  GroupState& s = state();
  std::lock_guard lock(s.mu);
  return s.default_pg != nullptr;
}

std::shared_ptr<ProcessGroup> default_group() {
  GroupState& s = state();
  std::lock_guard lock(s.mu);
  TANDEM_CHECK(s.default_pg != nullptr, ValueError,
               "no default process group: call dist::init_process_group() first");
  return s.default_pg;
}

int get_rank() { return default_group()->rank(); }
int get_world_size() { return default_group()->size(); }

namespace {
constexpr const char* kNewGroupRule = "; every rank of the default group must call new_group, members or not";
}  // namespace

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, std::chrono::milliseconds timeout) {
  auto pg = default_group();
  GroupState& s = state();
  std::unique_lock lock(s.mu);
  std::vector<int> sorted = ranks;
  if (sorted.empty()) {
    for (int r = 0; r < pg->size(); ++r) sorted.push_back(r);
  }
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    TANDEM_CHECK(sorted[i] >= 0 && sorted[i] < pg->size(), ValueError,
                 "new_group: rank {} is outside the default group of size {}", sorted[i], pg->size());
    TANDEM_CHECK(i == 0 || sorted[i] != sorted[i - 1], ValueError, "new_group: rank {} is listed twice", sorted[i]);
  }
  // Every rank of the default group numbers its subgroups the same way (c10d's rule), so the
  // k-th new_group call names the same store prefix everywhere, members or not.
  const int64_t id = s.next_subgroup++;
  const std::string name = fmt::format("{}/sub{}", s.group_name, id);
  auto store = s.store;
  const std::vector<Announcement> announced = s.announced;
  auto it = std::find(sorted.begin(), sorted.end(), pg->rank());
  if (it == sorted.end()) {
    // Not a member; the store's host still waits here until the members have built the group.
    lock.unlock();
    release_store_host(*store, name, pg->rank(), pg->size(), timeout, announced, "new_group", kNewGroupRule);
    return nullptr;
  }
  const int sub_rank = static_cast<int>(it - sorted.begin());
  const std::string backend = s.backend;
  lock.unlock();
  rendezvous(*store, name + "/init", sub_rank, static_cast<int>(sorted.size()), backend, timeout);
  ProcessGroupOptions pgo;
  pgo.timeout = timeout;
  auto sub = make_process_group(backend, std::make_shared<PrefixStore>(name, store), sub_rank,
                                static_cast<int>(sorted.size()), pgo);
  release_store_host(*store, name, pg->rank(), pg->size(), timeout, announced, "new_group", kNewGroupRule);
  lock.lock();
  s.subgroups.push_back(sub);
  return sub;
}

std::shared_ptr<ProcessGroup> new_subgroups(int group_size, std::chrono::milliseconds timeout) {
  const int world = default_group()->size(), rank = default_group()->rank();
  TANDEM_CHECK(group_size >= 1 && world % group_size == 0, ValueError,
               "new_subgroups: group size {} does not divide the {} ranks into equal groups", group_size, world);
  std::shared_ptr<ProcessGroup> mine;
  for (int first = 0; first < world; first += group_size) {
    std::vector<int> ranks(static_cast<size_t>(group_size));
    std::iota(ranks.begin(), ranks.end(), first);
    std::shared_ptr<ProcessGroup> g = new_group(ranks, timeout);
    if (rank >= first && rank < first + group_size) mine = g;
  }
  return mine;
}

void destroy_process_group() {
  GroupState& s = state();
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<Store> store;
  {
    std::lock_guard lock(s.mu);
    pg = std::move(s.default_pg);
    store = std::move(s.store);
    s.destroyed_store = store;
    const auto tcp = std::dynamic_pointer_cast<TCPStore>(store);
    s.destroyed_port = tcp ? tcp->port() : -1;
    s.subgroups.clear();
    s.announced.clear();
    s.default_pg = nullptr;
  }
  // pg and store go here, outside the lock: the last reference destroys the group.
}

void barrier() { default_group()->barrier()->wait(); }

}  // namespace tandem::dist

namespace tandem::dist {

std::string pid_scope() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return fmt::format("{},{}", boot.empty() ? "-" : boot, n > 0 ? std::string(ns, static_cast<size_t>(n)) : "-");
}

bool backend_available(const std::string& name) {
  if (name == "shm") return true;
#ifdef TANDEM_WITH_MPI
  if (name == "mpi") return true;
#endif
#ifdef TANDEM_WITH_GLOO
  if (name == "gloo") return true;
#endif
#ifdef TANDEM_WITH_CUDA
  if (name == "nccl") return true;
#endif
  return false;
}

}  // namespace tandem::dist
