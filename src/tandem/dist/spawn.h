// dist::spawn: torch.multiprocessing.spawn in C++. Forks `nprocs` processes that each run
// fn(rank) with the torchrun environment set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT on a free port, TANDEM_STORE_TOKEN), joins them with a timeout and
// rethrows the first failure with its rank and the child's exception text (sent back through a
// pipe). Without a master_port, the store's port is bound and listening before the fork and
// handed to rank 0 (TANDEM_STORE_LISTEN_FD, which rank 0's env:// TCPStore takes over), so no
// other process can take it in between.
//
// Fork safety: the children are forks of the caller. Tandem's own thread pool is fork-safe (a
// child starts with a fresh pool), but OpenMP (libgomp, which oneDNN uses) is not: a child of a
// process that already ran an OpenMP region may hang in its first parallel region. Call spawn
// before any OpenMP/oneDNN work, or run such children with TANDEM_NUM_THREADS=1 / OMP_NUM_THREADS=1
// (the tests do), or use `tandem run`, which starts fresh processes.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tandem/dist/error.h"

namespace tandem::dist {

struct SpawnOptions {
  std::chrono::milliseconds timeout{10 * 60 * 1000};  // for the whole job; then every child is killed
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                           // 0: a free port, held from the start (above)
  std::map<std::string, std::string> env;        // extra variables for every child
  // When a child fails, stop the others (SIGTERM, then SIGKILL after 2 s), like torch's spawn.
  bool stop_others_on_failure = true;
};

// How one child ended.
struct ProcessResult {
  int rank = -1;
  int pid = -1;
  int exit_code = -1;   // when it exited
  int signal = 0;       // when a signal killed it
  std::string error;    // the exception text it reported (empty on success)
  bool ok() const { return exit_code == 0 && signal == 0; }
  std::string describe() const;  // "rank 1 (pid 123) exited with code 1: CommError: ..."
};

// A child failed: names its rank, exit code or signal, and its exception text.
class SpawnError : public Error {
 public:
  SpawnError(const ProcessResult& r);
  const ProcessResult& result() const { return result_; }

 private:
  ProcessResult result_;
};

// Runs fn(rank) in nprocs forked processes and waits for all of them. Throws SpawnError for the
// first child that failed (an exception out of fn, a non-zero exit, a signal), Timeout naming the
// ranks still running after options.timeout (they are killed), ValueError for nprocs < 1.
void spawn(int nprocs, const std::function<void(int rank)>& fn, const SpawnOptions& options = {});

// Like spawn but never throws for a child's failure: every child's outcome, in rank order.
// (options.stop_others_on_failure still applies.)
std::vector<ProcessResult> spawn_results(int nprocs, const std::function<void(int rank)>& fn,
                                         const SpawnOptions& options = {});

}  // namespace tandem::dist
