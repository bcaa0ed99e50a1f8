// tandem run: the torchrun-compatible launcher. It parses torchrun's flags, hosts the rendezvous
// TCPStore (node 0), computes each local worker's environment and CPU share, and runs attempts of
// the worker group (worker_group.h) until one succeeds or --max-restarts is spent.
// Invariant: every wait here is bounded (a deadline or a child exit); main() gets an exit code:
// 0 success, 1 a failed job, 2 bad arguments, 128+N when stopped by signal N.
//
// Contract with the workers' init_process_group("env://") beyond torchrun's variables:
//   TANDEM_STORE_HOSTED=1   the launcher already hosts the TCPStore at MASTER_ADDR:MASTER_PORT;
//                           every worker, rank 0 included, connects as a client (never binds it).
//   TANDEM_STORE_TOKEN      the job's secret (random per job on one node; taken from the
//                           launcher's environment with --nnodes > 1); TCPStore clients send it.
//   TORCHELASTIC_RESTART_COUNT  the attempt number. One store serves every attempt, so workers
//                           keep their keys under the prefix "/worker/attempt_<count>/" (PyTorch's
//                           agent-store prefix): a restarted group never reads an earlier one's keys.
// The launchers' own keys live under "/tandem_run/".
#include <poll.h>
#include <sched.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#if TANDEM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "tandem/core/error.h"
#include "tandem/dist/tcp_store.h"
#include "tools/commands.h"
#include "tools/worker_group.h"

extern char** environ;

namespace tandem::tools {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Bad command-line input: exit code 2.
class UsageError : public ValueError {
  using ValueError::ValueError;
};

constexpr const char* kUsage = R"(usage: tandem run [options] PROGRAM [ARGS...]

Starts --nproc-per-node copies of PROGRAM on this node with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID) plus TANDEM_STORE_TOKEN, TANDEM_STORE_HOSTED=1 and
TANDEM_NUM_THREADS/OMP_NUM_THREADS (kept when already set), and hosts the rendezvous store.
Output lines are prefixed "[rank<N>]: "; workers read stdin from /dev/null and get SIGKILL if
the launcher dies. When a worker fails the others are stopped, the failure is reported with the
worker's last stderr lines, and the group restarts up to --max-restarts times.

options (torchrun's underscore spellings and --opt=value also work):
  --nproc-per-node N     workers on this node: an integer, "auto"/"cpu" (one per allowed core: Tandem
                         computes on CPU cores, where torchrun's auto counts GPUs) or "gpu" (one per
                         visible CUDA device) [1]
  --nnodes M             nodes in the job [1]
  --node-rank R          this node, 0..M-1; node 0 hosts the store (needed with --nnodes > 1) [0]
  --master-addr A        host of node 0's store [127.0.0.1]
  --master-port P        port of node 0's store [29500; on one node a free port unless given]
  --rdzv-endpoint A:P    same as --master-addr A --master-port P ([IPv6]:P too)
  --rdzv-backend c10d    accepted (c10d, static): the rendezvous is node 0's store either way
  --rdzv-id ID           TORCHELASTIC_RUN_ID for the workers [none]
  --role NAME            ROLE_NAME for the workers [default]
  --local-addr A         accepted for torchrun; not needed
  --standalone           one node, store on a free port on 127.0.0.1 (ignores --master-port)
  --max-restarts K       restart the whole group up to K times after a failure [0]
  --log-dir D            write D/attempt_<k>/<rank>/{stdout,stderr}.log instead of the console (D must
                         not hold an earlier run's logs)
  --tee [N], -t [N]      with --log-dir: also copy to the console (N, torchrun's 0-3 or per-rank
                         LOCAL_RANK:N list, accepted; every stream of every rank is copied)
  --redirects N, -r N    accepted for torchrun: with --log-dir output goes to files anyway
  --no-bind              do not bind each worker to its share of the allowed cores
  --stop-grace S         seconds between SIGTERM and SIGKILL when stopping workers [5]
  --rdzv-timeout S       seconds to wait for the other nodes (join, store connect) [900]
  --heartbeat-timeout S  with --nnodes > 1: a node's launcher silent this long fails the job [30]
  --monitor-interval S   seconds between health checks [0.1]
  --no-python            accepted for torchrun compatibility (PROGRAM is always executed directly)
  -h, --help             this text

With --nnodes > 1 every node needs the same TANDEM_STORE_TOKEN in its environment, e.g.
  export TANDEM_STORE_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
exit codes: 0 all workers succeeded, 1 the job failed, 2 bad arguments, 128+N stopped by signal N.
)";

struct RunOptions {
  int64_t nproc_per_node = 1;
  int64_t nnodes = 1;
  int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  int64_t max_restarts = 0;
  std::string log_dir;
  bool tee = false;
  bool standalone = false;
  bool bind = true;
  double stop_grace_s = 5.0;
  double rdzv_timeout_s = 900.0;
  double heartbeat_timeout_s = 30.0;
  double monitor_interval_s = 0.1;
  std::string rdzv_id = "none";      // --rdzv-id: TORCHELASTIC_RUN_ID
  std::string role = "default";      // --role: ROLE_NAME
  std::vector<std::string> program;  // PROGRAM ARGS...
};

// "[::1]" -> "::1": torchrun's bracketed IPv6 hosts (getaddrinfo wants the bare address).
std::string unbracket(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

// ---- argument parsing ----

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi, const char* what) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size())
    throw UsageError(fmt::format("tandem run: {} expects {}, got \"{}\"", flag, what, text));
  if (v < lo || v > hi)
    throw UsageError(fmt::format("tandem run: {} must be between {} and {}, got {}; give {}", flag, lo, hi, v, what));
  return v;
}

double parse_seconds(const std::string& flag, const std::string& text, double lo) {
  double v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= lo) || v > 1e7)
    throw UsageError(fmt::format("tandem run: {} expects seconds >= {}, got \"{}\"", flag, lo, text));
  return v;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// torchrun's std-stream selector: "0".."3", or "LOCAL_RANK:0-3" pairs joined by commas.
bool is_std_streams_spec(const std::string& v) {
  auto digit03 = [](char c) { return c >= '0' && c <= '3'; };
  if (v.size() == 1) return digit03(v[0]);
  if (v.empty()) return false;
  size_t pos = 0;
  while (pos <= v.size()) {
    size_t comma = v.find(',', pos);
    if (comma == std::string::npos) comma = v.size();
    const std::string item = v.substr(pos, comma - pos);
    const size_t colon = item.find(':');
    if (colon == std::string::npos || colon == 0 || colon + 2 != item.size() || !digit03(item.back())) return false;
    for (size_t k = 0; k < colon; ++k) {
      if (item[k] < '0' || item[k] > '9') return false;
    }
    pos = comma + 1;
  }
  return true;
}

// Visible CUDA devices (torchrun's "gpu"); 0 without CUDA.
int64_t gpu_count() {
#if TANDEM_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess) return n;
#endif
  return 0;
}

// Returns nullopt when --help was printed.
std::optional<RunOptions> parse_args(int argc, char** argv) {
  RunOptions o;
  bool port_given = false, node_rank_given = false;
  // Flags that take a value, and those that do not (canonical dashed spellings).
  static const std::vector<std::string> kValued = {
      "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint",
      "--max-restarts", "--log-dir", "--stop-grace", "--rdzv-timeout", "--heartbeat-timeout", "--monitor-interval",
      "--rdzv-backend", "--rdzv-id", "--role", "--local-addr", "--module", "--redirects"};
  static const std::vector<std::string> kSwitches = {"--standalone", "--no-bind", "--no-python", "--tee", "--help"};
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM
    if (arg == "-h") arg = "--help";
    if (arg == "-m") arg = "--module";
    if (arg == "-t" || arg.rfind("-t=", 0) == 0) arg = "--tee" + arg.substr(2);
    if (arg == "-r" || arg.rfind("-r=", 0) == 0) arg = "--redirects" + arg.substr(2);
    std::string name = arg, value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    std::replace(name.begin() + std::min<size_t>(2, name.size()), name.end(), '_', '-');
    const bool valued = std::find(kValued.begin(), kValued.end(), name) != kValued.end();
    const bool is_switch = std::find(kSwitches.begin(), kSwitches.end(), name) != kSwitches.end();
    if (!valued && !is_switch) {
      std::string best;
      size_t best_d = 4;
      for (const auto* list : {&kValued, &kSwitches}) {
        for (const std::string& k : *list) {
          if (size_t d = edit_distance(name, k); d < best_d) best_d = d, best = k;
        }
      }
      throw UsageError(fmt::format("tandem run: unknown option \"{}\"{}; see `tandem run --help`", arg,
                                   best.empty() ? "" : fmt::format(" (did you mean {}?)", best)));
    }
    // A switch takes no value (argparse's "ignored explicit argument"): --standalone=false must not
    // turn standalone on. --tee's value is torchrun's std-stream selector.
    if (is_switch && has_value && name != "--tee")
      throw UsageError(fmt::format("tandem run: {} takes no value, got \"{}\"; write {} to turn it on, or leave it out",
                                   name, arg, name));
    if (valued && !has_value) {
      if (i + 1 >= argc)
        throw UsageError(fmt::format("tandem run: {} needs a value, e.g. {} 2", name, name));
      value = argv[++i];
    }
    if (name == "--help") {
      std::fputs(kUsage, stdout);
      return std::nullopt;
    } else if (name == "--standalone") {
      o.standalone = true;
    } else if (name == "--no-bind") {
      o.bind = false;
    } else if (name == "--no-python") {
      // PROGRAM is executed directly in any case.
    } else if (name == "--tee") {
      // torchrun's --tee takes 0-3, or per local rank "0:3,1:1": such a value after it is that,
      // not PROGRAM. With --log-dir every rank's output is copied to the console either way.
      if (has_value) {
        if (!is_std_streams_spec(value))
          throw UsageError(fmt::format("tandem run: --tee expects 0-3 or LOCAL_RANK:0-3,..., got \"{}\"", value));
      } else if (i + 1 < argc && is_std_streams_spec(argv[i + 1])) {
        ++i;
      }
      o.tee = true;
    } else if (name == "--redirects") {
      // torchrun's --redirects sends workers' streams to files in the log dir; here --log-dir does.
      if (!is_std_streams_spec(value))
        throw UsageError(fmt::format("tandem run: --redirects expects 0-3 or LOCAL_RANK:0-3,..., got \"{}\"", value));
    } else if (name == "--nproc-per-node") {
      if (value == "auto" || value == "cpu") {
        o.nproc_per_node = int64_t(allowed_cpus().size());
      } else if (value == "gpu") {
        o.nproc_per_node = gpu_count();
        if (o.nproc_per_node < 1)
          throw UsageError(
              "tandem run: --nproc-per-node gpu: no CUDA device is visible (or this build has no CUDA); give a "
              "worker count, or \"auto\" for one worker per allowed core");
      } else {
        o.nproc_per_node =
            parse_int(name, value, 1, 4096, "a worker count >= 1 (or \"auto\"/\"cpu\" per core, \"gpu\" per GPU)");
      }
    } else if (name == "--nnodes") {
      if (size_t colon = value.find(':'); colon != std::string::npos) {
        // torchrun's elastic MIN:MAX: only a fixed size is supported.
        int64_t lo = parse_int(name, value.substr(0, colon), 1, 1 << 20, "a node count >= 1");
        int64_t hi = parse_int(name, value.substr(colon + 1), 1, 1 << 20, "a node count >= 1");
        if (lo != hi)
          throw UsageError(fmt::format("tandem run: --nnodes {}: elastic node ranges are not supported; give a "
                                       "fixed count such as --nnodes {}", value, hi));
        o.nnodes = lo;
      } else {
        o.nnodes = parse_int(name, value, 1, 1 << 20, "a node count >= 1");
      }
    } else if (name == "--node-rank") {
      o.node_rank = parse_int(name, value, 0, 1 << 20, "a node rank >= 0");
      node_rank_given = true;
    } else if (name == "--master-addr") {
      if (value.empty()) throw UsageError("tandem run: --master-addr is empty; give node 0's host name or address");
      o.master_addr = unbracket(value);
    } else if (name == "--master-port") {
      o.master_port = parse_int(name, value, 0, 65535, "a TCP port");
      port_given = true;
    } else if (name == "--rdzv-endpoint") {
      size_t colon = value.rfind(':');
      if (!value.empty() && value.front() == '[' && (colon == std::string::npos || colon < value.find(']'))) colon = std::string::npos;
      o.master_addr = unbracket(value.substr(0, colon));
      if (o.master_addr.empty())
        throw UsageError(fmt::format("tandem run: --rdzv-endpoint \"{}\" has no host; write HOST:PORT", value));
      if (colon != std::string::npos) {
        o.master_port = parse_int(name, value.substr(colon + 1), 0, 65535, "HOST:PORT with a TCP port");
        port_given = true;
      }
    } else if (name == "--rdzv-backend") {
      // One rendezvous here: node 0's store (torchrun's static and c10d backends both end there).
      if (value != "c10d" && value != "static") {
        throw UsageError(fmt::format(
            "tandem run: --rdzv-backend \"{}\" is not supported; tandem run's rendezvous is node 0's TCP store, "
            "torchrun's c10d (or static): drop the option or write --rdzv-backend c10d", value));
      }
    } else if (name == "--rdzv-id") {
      o.rdzv_id = value;
    } else if (name == "--role") {
      o.role = value;
    } else if (name == "--local-addr") {
      // torchrun uses it to name this node in the c10d rendezvous; node 0's store needs no name.
    } else if (name == "--module") {
      throw UsageError(fmt::format(
          "tandem run: -m/--module runs a Python module under torchrun; tandem run starts executables: give the "
          "program's path (e.g. build/tools/tandem train ...) instead of -m {}", value));
    } else if (name == "--max-restarts") {
      o.max_restarts = parse_int(name, value, 0, 1 << 20, "a restart count >= 0");
    } else if (name == "--log-dir") {
      if (value.empty()) throw UsageError("tandem run: --log-dir is empty; give a directory");
      o.log_dir = value;
    } else if (name == "--stop-grace") {
      o.stop_grace_s = parse_seconds(name, value, 0.0);
    } else if (name == "--rdzv-timeout") {
      o.rdzv_timeout_s = parse_seconds(name, value, 0.001);
    } else if (name == "--heartbeat-timeout") {
      o.heartbeat_timeout_s = parse_seconds(name, value, 0.1);
    } else if (name == "--monitor-interval") {
      o.monitor_interval_s = parse_seconds(name, value, 0.001);
    }
  }
  for (; i < argc; ++i) o.program.emplace_back(argv[i]);

  if (o.program.empty())
    throw UsageError(
        "tandem run: missing PROGRAM: give the program to launch after the options, e.g. "
        "`tandem run --nproc-per-node 2 ./train --epochs 1`");
  if (o.standalone) {
    if (o.nnodes != 1 || o.node_rank != 0)
      throw UsageError(fmt::format("tandem run: --standalone is one node; drop it or drop --nnodes {} / --node-rank {}",
                                   o.nnodes, o.node_rank));
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }
  if (o.nnodes > 1 && !node_rank_given)
    throw UsageError(fmt::format(
        "tandem run: --nnodes {} needs --node-rank on every node (0 on the node whose store the others reach at "
        "--master-addr/--rdzv-endpoint, then 1..{}): tandem run does not hand out node ranks as torchrun's c10d "
        "rendezvous does",
        o.nnodes, o.nnodes - 1));
  if (o.node_rank >= o.nnodes)
    throw UsageError(fmt::format("tandem run: --node-rank {} is out of range for --nnodes {}; use 0..{}", o.node_rank,
                                 o.nnodes, o.nnodes - 1));
  if (o.master_port == 0 && o.nnodes > 1)
    throw UsageError("tandem run: --master-port 0 cannot be shared with the other nodes; give a fixed port");
  // One node needs no agreed port: a free one avoids clashing with another job on 29500 (torchrun
  // would use 29500; the workers get the real port in MASTER_PORT either way).
  if (o.nnodes == 1 && !port_given) o.master_port = 0;
  if (o.nnodes > 1 && std::getenv("TANDEM_STORE_TOKEN") == nullptr)
    throw UsageError(
        "tandem run: --nnodes > 1 needs the same TANDEM_STORE_TOKEN on every node (the store's shared secret); "
        "e.g. export TANDEM_STORE_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n') before starting "
        "each node's launcher");
  return o;
}

// PROGRAM resolved like execvp: as given when it has a slash, else searched on PATH.
std::string resolve_program(const std::string& program) {
  auto is_dir = [](const std::string& p) {
    struct stat st {};
    return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  };
  if (program.find('/') != std::string::npos) {
    if (access(program.c_str(), X_OK) != 0)
      throw UsageError(fmt::format("tandem run: PROGRAM \"{}\" is not an executable file: {}", program,
                                   std::strerror(errno)));
    // (access() says X_OK for a searchable directory; every restart would fail the same execve.)
    if (is_dir(program))
      throw UsageError(fmt::format("tandem run: PROGRAM \"{}\" is a directory; give the program inside it", program));
    return program;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t pos = 0;
  while (pos <= dirs.size()) {
    size_t end = dirs.find(':', pos);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(pos, end - pos);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0 && !is_dir(candidate)) return candidate;  // execvp skips directories
    pos = end + 1;
  }
  throw UsageError(fmt::format("tandem run: PROGRAM \"{}\" was not found on PATH; give its path, e.g. ./{}", program,
                               program));
}

// ---- per-worker environment and CPU shares ----

// Local rank i's cores: contiguous blocks of the allowed cores, sizes differing by at most one;
// with more ranks than cores, ranks share cores round-robin (one each).
std::vector<std::vector<int>> cpu_shares(const std::vector<int>& allowed, int64_t nlocal) {
  std::vector<std::vector<int>> shares(static_cast<size_t>(nlocal));
  const int64_t n = int64_t(allowed.size());
  if (nlocal > n) {
    for (int64_t i = 0; i < nlocal; ++i) shares[size_t(i)] = {allowed[size_t(i % n)]};
    return shares;
  }
  int64_t base = n / nlocal, extra = n % nlocal, next = 0;
  for (int64_t i = 0; i < nlocal; ++i) {
    int64_t size = base + (i < extra ? 1 : 0);
    shares[size_t(i)].assign(allowed.begin() + next, allowed.begin() + next + size);
    next += size;
  }
  return shares;
}

std::string random_token() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    TANDEM_CHECK(n > 0, Error, "tandem run: getrandom failed: {}", std::strerror(errno));
    got += size_t(n);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

struct JobInfo {
  std::string token;
  uint16_t port = 0;
};

std::vector<WorkerSpec> make_workers(const RunOptions& o, const JobInfo& job, int64_t attempt) {
  std::map<std::string, std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    size_t eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const std::vector<int> allowed = allowed_cpus();
  const auto shares = cpu_shares(allowed, o.nproc_per_node);
  const int64_t world = o.nnodes * o.nproc_per_node;
  std::vector<WorkerSpec> workers;
  for (int64_t local = 0; local < o.nproc_per_node; ++local) {
    WorkerSpec w;
    w.local_rank = local;
    w.rank = o.node_rank * o.nproc_per_node + local;
    int64_t threads = 1;
    if (o.bind) {
      w.cpus = shares[size_t(local)];
      threads = int64_t(w.cpus.size());
    } else {
      threads = std::max<int64_t>(1, int64_t(allowed.size()) / o.nproc_per_node);
    }
    std::map<std::string, std::string> env = base;
    env["RANK"] = std::to_string(w.rank);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_RANK"] = std::to_string(local);
    env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
    env["GROUP_RANK"] = std::to_string(o.node_rank);
    env["GROUP_WORLD_SIZE"] = std::to_string(o.nnodes);
    env["ROLE_RANK"] = std::to_string(w.rank);
    env["ROLE_WORLD_SIZE"] = std::to_string(world);
    env["MASTER_ADDR"] = o.master_addr;
    env["MASTER_PORT"] = std::to_string(job.port);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o.max_restarts);
    env["TORCHELASTIC_RUN_ID"] = o.rdzv_id;
    env["ROLE_NAME"] = o.role;
    env["TANDEM_STORE_TOKEN"] = job.token;
    env["TANDEM_STORE_HOSTED"] = "1";
    // An explicit setting of the user wins (as torchrun keeps OMP_NUM_THREADS).
    if (!base.count("TANDEM_NUM_THREADS")) env["TANDEM_NUM_THREADS"] = std::to_string(threads);
    if (!base.count("OMP_NUM_THREADS")) env["OMP_NUM_THREADS"] = std::to_string(threads);
    for (auto& [k, v] : env) w.env.push_back(k + "=" + v);
    workers.push_back(std::move(w));
  }
  return workers;
}

// ---- launcher coordination through the store (all nodes) ----

// The launchers' view of the job on the shared store: per-attempt join, failure and success
// keys, plus heartbeats so that a vanished launcher is noticed. With one node most of it is idle.
class Coordinator {
 public:
  // `store` is the launcher's owning pointer (the store may be replaced between attempts).
  Coordinator(std::unique_ptr<dist::TCPStore>& store, const RunOptions& o) : store_(store), o_(o) {}
  ~Coordinator() {
    {
      std::lock_guard lock(beat_mu_);
      beat_stop_ = true;
    }
    beat_cv_.notify_all();
    if (beat_thread_.joinable()) beat_thread_.join();
  }

  // With several nodes: this node's heartbeat, from a thread of its own on a store connection of
  // its own, every min(1 s, --heartbeat-timeout / 4) for as long as the launcher lives. (Sent from
  // the monitor loop it paused for a --monitor-interval or while the workers were being stopped,
  // and the other nodes took a healthy node for dead.) A lost store ends it; the others notice.
  void start_heartbeats(const std::string& host, uint16_t port, const std::string& token) {
    if (o_.nnodes == 1) return;
    dist::TCPStoreOptions so;
    so.is_master = false;
    so.token = token;
    so.timeout = std::max(heartbeat_timeout(), milliseconds(1000));
    auto beat_store = std::make_shared<dist::TCPStore>(host, port, so);
    const std::string beat_key = fmt::format("/tandem_run/heartbeat_{}", o_.node_rank);
    const milliseconds period = std::min(milliseconds(1000), heartbeat_timeout() / 4);
    beat_store->add(beat_key, 1);
    beat_thread_ = std::thread([this, beat_store, beat_key, period] {
      std::unique_lock lock(beat_mu_);
      while (!beat_cv_.wait_for(lock, period, [&] { return beat_stop_; })) {
        lock.unlock();
        try {
          beat_store->add(beat_key, 1);
        } catch (const std::exception&) {
          return;
        }
        lock.lock();
      }
    });
  }

  static std::string key(int64_t attempt, const std::string& name) {
    return fmt::format("/tandem_run/attempt_{}/{}", attempt, name);
  }

  // Every node joins attempt k; returns once all have (or throws on timeout / signal).
  void rendezvous(int64_t attempt, SignalPipe& signals, int* stop_signal) {
    if (o_.nnodes == 1) return;
    if (attempt == 0) {
      std::string mine = std::to_string(o_.nproc_per_node);
      std::string agreed = dist::to_string(store_->compare_set("/tandem_run/nproc_per_node", {}, dist::to_bytes(mine)));
      TANDEM_CHECK(agreed == mine, UsageError,
                   "tandem run: node {} has --nproc-per-node {} but another node started with {}; every node must "
                   "use the same value", o_.node_rank, mine, agreed);
    }
    TANDEM_CHECK(store_->add(key(attempt, fmt::format("node_{}", o_.node_rank)), 1) == 1, UsageError,
                 "tandem run: two launchers joined with --node-rank {}; give each node its own rank", o_.node_rank);
    if (store_->add(key(attempt, "joined"), 1) == o_.nnodes) store_->set(key(attempt, "all_joined"), "1");
    const auto deadline = Clock::now() + rdzv_timeout();
    while (!store_->check({key(attempt, "all_joined")})) {
      if (int sig = wait_signal(signals, milliseconds(50)); sig != 0) {
        *stop_signal = sig;
        return;
      }
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int64_t r = 0; r < o_.nnodes; ++r) {
          if (!store_->check({key(attempt, fmt::format("node_{}", r))})) missing += fmt::format(" {}", r);
        }
        throw dist::Timeout(fmt::format(
            "tandem run: node(s){} did not join attempt {} within {} s; start `tandem run --nnodes {} --node-rank R` "
            "with the same --master-addr/--master-port and TANDEM_STORE_TOKEN on each of them",
            missing, attempt, o_.rdzv_timeout_s, o_.nnodes));
      }
    }
    last_seen_.assign(size_t(o_.nnodes), {-1, Clock::now()});
  }

  // Publishes this node's failure of attempt k (the first report wins); `abort`: the job ends
  // without restarts (a launcher was interrupted). Best effort: a lost store is reported, and the
  // other nodes notice the missing heartbeats.
  void report_failure(int64_t attempt, const std::string& what, bool abort = false) noexcept {
    if (o_.nnodes == 1) return;
    try {
      if (abort) store_->set("/tandem_run/abort", "1");
      store_->compare_set(key(attempt, "failed"), {}, dist::to_bytes(what));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem run: could not tell the other nodes: %s\n", e.what());
    }
  }

  // Called every tick while workers run or this node waits: heartbeats, and the reason to stop
  // if another node failed attempt k or stopped answering.
  std::optional<std::string> remote_stop(int64_t attempt) {
    if (o_.nnodes == 1) return std::nullopt;
    auto now = Clock::now();
    if (now >= next_heartbeat_) {
      next_heartbeat_ = now + std::min(milliseconds(1000), heartbeat_timeout() / 4);
      for (int64_t r = 0; r < o_.nnodes; ++r) {
        if (r == o_.node_rank) continue;
        int64_t beat = store_->add(fmt::format("/tandem_run/heartbeat_{}", r), 0);
        auto& [last, since] = last_seen_[size_t(r)];
        if (beat != last) {
          last = beat;
          since = now;
        } else if (now - since > heartbeat_timeout() &&
                   !store_->check({fmt::format("/tandem_run/exit_{}", r)})) {
          fatal_ = true;
          return fmt::format("the launcher of node {} stopped answering (no heartbeat for {} s, --heartbeat-timeout)",
                             r, o_.heartbeat_timeout_s);
        }
      }
    }
    if (store_->check({key(attempt, "failed")})) {
      if (store_->check({"/tandem_run/abort"})) fatal_ = true;
      return dist::to_string(store_->get(key(attempt, "failed")));
    }
    return std::nullopt;
  }

  // After this node's workers all succeeded: true once every node's did, false when another node
  // failed attempt k (`reason` says why). Driven by the other launchers (heartbeats bound it).
  bool wait_all_succeeded(int64_t attempt, SignalPipe& signals, int* stop_signal, std::string* reason) {
    if (o_.nnodes == 1) return true;
    store_->set(key(attempt, fmt::format("succeeded_{}", o_.node_rank)), "1");
    std::vector<std::string> keys;
    for (int64_t r = 0; r < o_.nnodes; ++r) keys.push_back(key(attempt, fmt::format("succeeded_{}", r)));
    while (!store_->check(keys)) {
      if (auto why = remote_stop(attempt)) {
        *reason = *why;
        return false;
      }
      if (int sig = wait_signal(signals, milliseconds(50)); sig != 0) {
        *stop_signal = sig;
        return false;
      }
    }
    return true;
  }

  // At the end of the job: the other nodes say they are leaving; node 0 keeps the store up until
  // they have (at most 10 s), so that nobody loses the store while reading the outcome.
  void finish() noexcept {
    if (o_.nnodes == 1) return;
    try {
      if (o_.node_rank != 0) {
        store_->set(fmt::format("/tandem_run/exit_{}", o_.node_rank), "1");
        return;
      }
      if (fatal_) return;  // a vanished or interrupted node may not say goodbye
      std::vector<std::string> keys;
      for (int64_t r = 1; r < o_.nnodes; ++r) keys.push_back(fmt::format("/tandem_run/exit_{}", r));
      auto deadline = Clock::now() + milliseconds(10000);
      while (!store_->check(keys) && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(20));
    } catch (const std::exception&) {
      // best effort: the job's outcome is already decided
    }
  }

  // Whether the job must end without restarts: a node vanished or its launcher was interrupted.
  bool fatal() const { return fatal_; }

  // Waits up to `d` for a terminating signal; returns it or 0.
  static int wait_signal(SignalPipe& signals, milliseconds d) {
    pollfd p{signals.fd(), POLLIN, 0};
    if (poll(&p, 1, int(d.count())) > 0) return signals.drain();
    return 0;
  }

 private:
  milliseconds rdzv_timeout() const { return milliseconds(int64_t(o_.rdzv_timeout_s * 1000)); }
  milliseconds heartbeat_timeout() const { return milliseconds(int64_t(o_.heartbeat_timeout_s * 1000)); }

  std::unique_ptr<dist::TCPStore>& store_;
  const RunOptions& o_;
  Clock::time_point next_heartbeat_{};  // the next look at the other nodes' heartbeats
  std::vector<std::pair<int64_t, Clock::time_point>> last_seen_;
  bool fatal_ = false;
  std::mutex beat_mu_;
  std::condition_variable beat_cv_;
  bool beat_stop_ = false;
  std::thread beat_thread_;
};

// ---- reporting ----

void say(const std::string& text) {
  std::string line = "tandem run: " + text + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

std::string describe_failure(const RunOptions& o, const WorkerExit& e, int64_t attempt, bool with_tail) {
  std::string text = fmt::format("rank {} (local rank {} on node {}, pid {}) failed with {} on attempt {}", e.rank,
                                 e.local_rank, o.node_rank, e.pid, describe_exit(e), attempt);
  if (with_tail) {
    if (e.stderr_tail.empty()) {
      text += "; it wrote nothing to stderr";
    } else {
      text += fmt::format("; its last {} stderr line(s):", e.stderr_tail.size());
      for (const std::string& l : e.stderr_tail) text += fmt::format("\n  [rank{}]: {}", e.rank, l);
    }
  }
  return text;
}

int signal_exit_code(int sig) { return 128 + sig; }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : std::to_string(sig);
}

// ---- the launcher ----

int run(const RunOptions& o) {
  SignalPipe signals;
  const std::string program_path = resolve_program(o.program.front());
  if (!o.log_dir.empty()) {
    // An earlier run's logs would be overwritten file by file and mixed with this run's (torchrun
    // makes a new job directory each run): refused, naming them, before anything starts. (This
    // node's first rank only: other nodes may share the directory.)
    std::error_code ec;
    const std::filesystem::path earlier =
        std::filesystem::path(o.log_dir) / "attempt_0" / std::to_string(o.node_rank * o.nproc_per_node);
    if (std::filesystem::exists(earlier, ec))
      throw UsageError(fmt::format("tandem run: --log-dir {} already holds an earlier run's logs ({}); give a new "
                                   "directory (e.g. {}/run2) or remove them first",
                                   o.log_dir, earlier.string(), o.log_dir));
  }

  // ---- the store: hosted on node 0, reached as a client elsewhere ----
  JobInfo job;
  std::unique_ptr<dist::TCPStore> store;
  const milliseconds store_timeout(10000);
  auto host_store = [&](uint16_t port) {
    dist::TCPStoreOptions so;
    so.is_master = true;
    so.wait_for_workers = false;
    so.timeout = store_timeout;
    so.token = job.token;
    try {
      return std::make_unique<dist::TCPStore>("127.0.0.1", port, so);
    } catch (const dist::CommError& e) {
      throw dist::CommError(fmt::format("cannot host the rendezvous store on port {}: {}; pick a free --master-port "
                                        "or use --standalone", port, e.what()));
    }
  };
  if (o.node_rank == 0) {
    const char* env_token = std::getenv("TANDEM_STORE_TOKEN");
    job.token = (o.nnodes > 1 && env_token != nullptr) ? env_token : random_token();
    store = host_store(uint16_t(o.master_port));
  } else {
    job.token = std::getenv("TANDEM_STORE_TOKEN");
    dist::TCPStoreOptions so;
    so.is_master = false;
    so.token = job.token;
    const auto deadline = Clock::now() + milliseconds(int64_t(o.rdzv_timeout_s * 1000));
    while (!store) {
      so.timeout = std::clamp(std::chrono::ceil<milliseconds>(deadline - Clock::now()), milliseconds(1),
                              milliseconds(1000));
      try {
        store = std::make_unique<dist::TCPStore>(o.master_addr, uint16_t(o.master_port), so);
      } catch (const dist::CommError& e) {
        // A refused token will not get better by retrying (TCPStore's message says "rejected our token").
        if (std::string(e.what()).find("rejected our token") != std::string::npos)
          throw dist::CommError(fmt::format("node {}: node 0's store at {}:{} refused this node's TANDEM_STORE_TOKEN; "
                                            "export the same token on every node: {}",
                                            o.node_rank, o.master_addr, o.master_port, e.what()));
        if (Clock::now() >= deadline)
          throw dist::CommError(fmt::format("node {} cannot reach node 0's store at {}:{} within {} s: {}",
                                            o.node_rank, o.master_addr, o.master_port, o.rdzv_timeout_s, e.what()));
        if (int sig = Coordinator::wait_signal(signals, milliseconds(100)); sig != 0) {
          say(fmt::format("got {} while waiting for node 0's store; exiting", signal_name(sig)));
          return signal_exit_code(sig);
        }
      }
    }
    store->set_timeout(store_timeout);
  }
  job.port = store->port();
  Coordinator coord(store, o);
  coord.start_heartbeats(o.node_rank == 0 ? "127.0.0.1" : o.master_addr, uint16_t(job.port), job.token);

  GroupConfig group;
  group.program_path = program_path;
  group.argv = o.program;
  group.log_dir = o.log_dir;
  group.tee = o.tee;
  group.stop_grace = milliseconds(int64_t(o.stop_grace_s * 1000));
  group.tick = std::max(milliseconds(1), milliseconds(int64_t(o.monitor_interval_s * 1000)));

  // ---- attempts ----
  std::string last_failure;
  for (int64_t attempt = 0; attempt <= o.max_restarts; ++attempt) {
    if (attempt > 0 && o.nnodes == 1) {
      // One node: a fresh store for every attempt, on the same port. The last attempt's workers are
      // gone, and the restarted group must not find their keys, whatever prefix its rendezvous
      // uses. (Across nodes the store carries the launchers' state too; there the workers' prefix
      // "/worker/attempt_<k>/" of the contract above keeps attempts apart.)
      const uint16_t port = store->port();
      store.reset();
      store = host_store(port);
    }
    int stop_signal = 0;
    coord.rendezvous(attempt, signals, &stop_signal);
    if (stop_signal != 0) {
      say(fmt::format("got {} while waiting for the other nodes; exiting", signal_name(stop_signal)));
      coord.finish();
      return signal_exit_code(stop_signal);
    }
    group.attempt = attempt;
    group.workers = make_workers(o, job, attempt);
    AttemptResult r = run_worker_group(group, signals, [&] { return coord.remote_stop(attempt); });

    using Kind = AttemptResult::Kind;
    if (r.kind == Kind::kInterrupted) {
      say(fmt::format("got {}; forwarded it to the workers and stopped them", signal_name(r.signal)));
      coord.report_failure(attempt, fmt::format("the launcher of node {} got {}", o.node_rank, signal_name(r.signal)),
                           /*abort=*/true);
      coord.finish();
      return signal_exit_code(r.signal);
    }
    if (r.kind == Kind::kSucceeded) {
      std::string reason;
      if (coord.wait_all_succeeded(attempt, signals, &stop_signal, &reason)) {
        coord.finish();
        return 0;
      }
      if (stop_signal != 0) {
        say(fmt::format("got {} while waiting for the other nodes; exiting", signal_name(stop_signal)));
        coord.finish();
        return signal_exit_code(stop_signal);
      }
      r.kind = Kind::kRemoteStop;
      r.remote_reason = reason;
    }
    if (r.kind == Kind::kWorkerFailed) {
      last_failure = describe_failure(o, *r.failure, attempt, false);
      say(describe_failure(o, *r.failure, attempt, true));
      for (const WorkerExit& e : r.also_failed) say("also " + describe_failure(o, e, attempt, true));
      coord.report_failure(attempt, last_failure);
    } else {
      last_failure = r.remote_reason;
      say(fmt::format("stopped the workers of node {}: {}", o.node_rank, r.remote_reason));
      if (coord.fatal()) break;  // a vanished or interrupted node will not rejoin a restart
    }
    if (attempt < o.max_restarts)
      say(fmt::format("restarting the worker group (restart {} of --max-restarts {})", attempt + 1, o.max_restarts));
  }
  if (coord.fatal())
    say(fmt::format("job failed: {}; not restarted (a node's launcher vanished or was interrupted)", last_failure));
  else
    say(fmt::format("job failed: {}; no restarts left (--max-restarts {})", last_failure, o.max_restarts));
  coord.finish();
  return 1;
}

}  // namespace

int run_main(int argc, char** argv) {
  try {
    std::optional<RunOptions> options = parse_args(argc, argv);
    if (!options) return 0;
    return run(*options);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::fprintf(stderr, "%s%s\n", what.rfind("tandem run:", 0) == 0 ? "" : "tandem run: ", what.c_str());
    return 1;
  }
}

}  // namespace tandem::tools
