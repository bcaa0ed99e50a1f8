// One attempt of `tandem run` on one node: fork/exec the local workers, relay their output line
// by line with a rank prefix, watch for failures and signals, and stop the group. Invariant: the
// monitor loop is driven by poll() with a bounded tick, so every wait ends (child exit, signal,
// grace deadline); nothing here blocks on a worker.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tandem::tools {

// Catches SIGINT, SIGTERM, SIGHUP and SIGCHLD into a self-pipe (so poll() wakes on them) and
// ignores SIGPIPE, for the lifetime of the object; restores the previous dispositions after.
// One per process (the handler needs a process-wide pipe).
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int fd() const;  // readable when a signal arrived
  // Drains the pipe; returns the first terminating signal (SIGINT/SIGTERM/SIGHUP) seen, or 0.
  int drain();
};

// One local worker process.
struct WorkerSpec {
  int64_t rank = 0;                 // global rank
  int64_t local_rank = 0;
  std::vector<std::string> env;     // the complete environment, "KEY=VALUE"
  std::vector<int> cpus;            // CPU ids to bind to; empty: inherit the launcher's mask
};

struct GroupConfig {
  std::string program_path;          // resolved executable (execve'd as is)
  std::vector<std::string> argv;     // argv[0] is the program as the user typed it
  std::vector<WorkerSpec> workers;
  int64_t attempt = 0;               // TORCHELASTIC_RESTART_COUNT of this attempt
  std::string log_dir;               // "": console only; else <log_dir>/attempt_<k>/<rank>/{stdout,stderr}.log
  bool tee = false;                  // with log_dir: also to the console
  std::chrono::milliseconds stop_grace{5000};  // SIGTERM -> SIGKILL
  std::chrono::milliseconds tick{100};         // longest poll(); also how often `remote_stop` is asked
  size_t stderr_tail_lines = 10;
};

// How one worker ended.
struct WorkerExit {
  int64_t rank = 0;
  int64_t local_rank = 0;
  pid_t pid = 0;
  bool signaled = false;
  int code = 0;                          // exit code, or the signal number when signaled
  std::vector<std::string> stderr_tail;  // its last stderr lines
  bool failed() const { return signaled || code != 0; }
};
// "exit code 3" or "signal 9 (SIGKILL)".
std::string describe_exit(const WorkerExit& e);

struct AttemptResult {
  enum class Kind {
    kSucceeded,     // every worker exited 0
    kWorkerFailed,  // a local worker failed: `failure`
    kRemoteStop,    // remote_stop asked us to stop: `remote_reason`
    kInterrupted,   // the launcher got `signal`
  };
  Kind kind = Kind::kSucceeded;
  std::optional<WorkerExit> failure;     // the first local worker that failed
  std::vector<WorkerExit> also_failed;   // others that failed on their own before being stopped
  std::string remote_reason;
  int signal = 0;
};

// Runs one attempt to its end. `remote_stop` (may be empty) is asked about once per tick whether
// another node asks the group to stop; it returns the reason, and may throw (treated as a stop
// with the exception's text). Throws tandem::Error when a worker cannot be started (pipe, fork,
// log file); workers already started are killed first.
AttemptResult run_worker_group(const GroupConfig& config, SignalPipe& signals,
                               const std::function<std::optional<std::string>()>& remote_stop);

}  // namespace tandem::tools
