// Local workers of one `tandem run` attempt. Works as follows: each worker is forked with its
// stdout and stderr on two pipes, in a process group of its own (so a stop reaches whatever it
// started, and a terminal's Ctrl-C reaches only the launcher, which forwards it once); the parent
// then loops on poll() over those pipes and a signal self-pipe, relaying complete lines, reaping
// exits with WNOHANG, and driving the stop sequence (SIGTERM, SIGKILL after the grace period)
// from deadlines checked every tick.
#include "tools/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "tandem/core/error.h"

namespace tandem::tools {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// ---- signals ----
// The pipe a signal handler writes to: process-wide because a handler can reach nothing else.
// Only SignalPipe's constructor and destructor change them.
int g_signal_fds[2] = {-1, -1};
constexpr int kCaughtSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
struct sigaction g_previous[std::size(kCaughtSignals)];
struct sigaction g_previous_pipe;

extern "C" void on_signal(int sig) {
  int saved = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  if (g_signal_fds[1] >= 0) {
    ssize_t ignored = write(g_signal_fds[1], &byte, 1);  // a full pipe already holds a wake-up
    (void)ignored;
  }
  errno = saved;
}

bool is_terminating(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

// Writes everything or gives up on a broken/closed destination (the console may be gone).
void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 1000) <= 0) return;  // a console that does not drain in 1 s loses the line
    } else {
      return;
    }
  }
}

// ---- output relay ----
constexpr size_t kMaxLineBytes = 64 << 10;  // a longer line is relayed in pieces of this size

struct Stream {
  int fd = -1;        // read end of the worker's pipe; -1 once closed
  int log_fd = -1;    // <rank>/{stdout,stderr}.log, or -1
  int console_fd = 1; // 1 or 2; -1: not relayed to the console
  bool is_stderr = false;
  std::string partial;  // bytes after the last newline
};

struct Worker {
  const WorkerSpec* spec = nullptr;
  pid_t pid = -1;
  bool alive = false;
  bool lingers = false;  // reaped, but its process group still had members then
  WorkerExit exit;
  std::string prefix;  // "[rank3]: "
  Stream out, err;
  std::deque<std::string> tail;  // last stderr lines
};

void emit_line(Worker& w, Stream& s, std::string_view line, size_t tail_lines) {
  if (s.log_fd >= 0) {
    std::string text(line);
    text += '\n';
    write_all(s.log_fd, text.data(), text.size());
  }
  if (s.console_fd >= 0) {
    // One write per complete line: lines of different ranks never interleave.
    std::string text = w.prefix;
    text.append(line);
    text += '\n';
    write_all(s.console_fd, text.data(), text.size());
  }
  if (s.is_stderr && tail_lines > 0) {
    w.tail.emplace_back(line);
    while (w.tail.size() > tail_lines) w.tail.pop_front();
  }
}

void close_stream(Worker& w, Stream& s, size_t tail_lines) {
  if (!s.partial.empty()) {
    emit_line(w, s, s.partial, tail_lines);
    s.partial.clear();
  }
  if (s.fd >= 0) close(s.fd);
  s.fd = -1;
}

// Reads what is there; relays complete lines; closes the stream at EOF.
void read_stream(Worker& w, Stream& s, size_t tail_lines) {
  char buf[64 << 10];
  while (s.fd >= 0) {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      close_stream(w, s, tail_lines);
      return;
    }
    s.partial.append(buf, size_t(n));
    size_t start = 0;
    while (true) {
      size_t nl = s.partial.find('\n', start);
      if (nl == std::string::npos) break;
      emit_line(w, s, std::string_view(s.partial).substr(start, nl - start), tail_lines);
      start = nl + 1;
    }
    s.partial.erase(0, start);
    while (s.partial.size() >= kMaxLineBytes) {
      emit_line(w, s, std::string_view(s.partial).substr(0, kMaxLineBytes), tail_lines);
      s.partial.erase(0, kMaxLineBytes);
    }
    if (size_t(n) < sizeof(buf)) return;
  }
}

int open_log(const std::filesystem::path& path) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TANDEM_CHECK(fd >= 0, IOError, "tandem run: cannot create the log file {}: {} (check --log-dir)", path.string(),
               std::strerror(errno));
  return fd;
}

// ---- spawning ----
// Appends the decimal form of v (async-signal-safe).
void append_number(char* buf, size_t cap, long v) {
  char digits[24];
  int n = 0;
  bool neg = v < 0;
  unsigned long u = neg ? 0UL - static_cast<unsigned long>(v) : static_cast<unsigned long>(v);
  do {
    digits[n++] = char('0' + u % 10);
    u /= 10;
  } while (u != 0 && n < 22);
  if (neg) digits[n++] = '-';
  size_t len = std::strlen(buf);
  while (n > 0 && len + 1 < cap) buf[len++] = digits[--n];
  buf[len] = '\0';
}

// "<text><number>\n" into buf, truncated to fit (async-signal-safe: for the forked child).
void child_message(char* buf, size_t cap, const char* text, long number) {
  size_t len = std::min(std::strlen(text), cap - 24);
  std::memcpy(buf, text, len);
  buf[len] = '\0';
  append_number(buf, cap - 1, number);
  len = std::strlen(buf);
  buf[len] = '\n';
  buf[len + 1] = '\0';
}

// Forks and execs one worker. The child runs only async-signal-safe calls before execve (the
// launcher has threads: the store server), so everything it needs is prepared here first.
pid_t spawn(const GroupConfig& config, const WorkerSpec& spec, int out_w, int err_w, int devnull) {
  std::vector<char*> argv;
  for (const std::string& a : config.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int c : spec.cpus) CPU_SET(c, &cpus);
  const bool bind = !spec.cpus.empty();
  std::string exec_failed = fmt::format("tandem run: cannot execute {}: errno ", config.program_path);
  std::string bind_failed = fmt::format("tandem run: rank {}: sched_setaffinity failed: errno ", spec.rank);

  // Descriptors the launcher inherited or opened (a caller's lock files, pipes) are closed in the
  // child, as torchrun's Popen(close_fds=True): a worker holding a pipe's write end would keep its
  // reader from ever seeing EOF. close_range needs Linux 5.9; older kernels get the loop.
  const int max_fd = static_cast<int>(std::clamp<long>(sysconf(_SC_OPEN_MAX), 256, 1 << 20));
  const pid_t launcher = getpid();
  // Signals stay blocked across fork so that the child never runs the launcher's handler.
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  pid_t pid = fork();
  if (pid == 0) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int sig : kCaughtSignals) sigaction(sig, &dfl, nullptr);
    sigaction(SIGPIPE, &dfl, nullptr);
    setpgid(0, 0);
    // A launcher that dies (even by SIGKILL) takes its workers along instead of orphaning them.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(127);  // it died before the prctl
    dup2(devnull, 0);
    dup2(out_w, 1);
    dup2(err_w, 2);
    if (close_range(3, ~0U, 0) != 0) {
      for (int fd = 3; fd < max_fd; ++fd) close(fd);
    }
    char msg[512];
    if (bind && sched_setaffinity(0, sizeof(cpus), &cpus) != 0) {
      child_message(msg, sizeof(msg), bind_failed.c_str(), errno);
      write_all(2, msg, std::strlen(msg));
      _exit(127);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(config.program_path.c_str(), argv.data(), envp.data());
    int err = errno;
    child_message(msg, sizeof(msg), exec_failed.c_str(), err);
    write_all(2, msg, std::strlen(msg));
    _exit(127);
  }
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  TANDEM_CHECK(pid > 0, Error, "tandem run: fork of rank {} failed: {}", spec.rank, std::strerror(fork_errno));
  setpgid(pid, pid);  // also here: whichever of parent and child runs first makes the group
  return pid;
}

// The worker's process group, else (not yet made) the process. The group also once the worker
// itself has exited, when processes it started were left in it at that moment (`lingers`: a
// group with members keeps its id from reuse): they must not outlive a stopped attempt, holding
// memory or ports (torchrun signals only the groups of workers still running).
void signal_worker(const Worker& w, int sig) {
  if (w.pid <= 0) return;  // never started: -0 would be our own group
  if (w.alive) {
    if (kill(-w.pid, sig) != 0) kill(w.pid, sig);
  } else if (w.lingers) {
    kill(-w.pid, sig);
  }
}

}  // namespace

// ---- SignalPipe ----

SignalPipe::SignalPipe() {
  TANDEM_CHECK(g_signal_fds[0] < 0, Error, "tandem run: only one SignalPipe may exist at a time");
  TANDEM_CHECK(pipe2(g_signal_fds, O_NONBLOCK | O_CLOEXEC) == 0, Error, "tandem run: cannot create a pipe: {}",
               std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kCaughtSignals); ++i) sigaction(kCaughtSignals[i], &sa, &g_previous[i]);
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, &g_previous_pipe);
}

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < std::size(kCaughtSignals); ++i) sigaction(kCaughtSignals[i], &g_previous[i], nullptr);
  sigaction(SIGPIPE, &g_previous_pipe, nullptr);
  close(g_signal_fds[0]);
  close(g_signal_fds[1]);
  g_signal_fds[0] = g_signal_fds[1] = -1;
}

int SignalPipe::fd() const { return g_signal_fds[0]; }

int SignalPipe::drain() {
  int first = 0;
  unsigned char buf[256];
  while (true) {
    ssize_t n = read(g_signal_fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      if (first == 0 && is_terminating(buf[i])) first = buf[i];
    }
  }
  return first;
}

std::string describe_exit(const WorkerExit& e) {
  if (!e.signaled) return fmt::format("exit code {}", e.code);
  const char* abbrev = sigabbrev_np(e.code);
  return abbrev != nullptr ? fmt::format("signal {} (SIG{})", e.code, abbrev) : fmt::format("signal {}", e.code);
}

// ---- the attempt ----

AttemptResult run_worker_group(const GroupConfig& config, SignalPipe& signals,
                               const std::function<std::optional<std::string>()>& remote_stop) {
  const size_t tail_lines = config.stderr_tail_lines;
  const bool console = config.log_dir.empty() || config.tee;
  std::vector<std::unique_ptr<Worker>> workers;
  bool stopping = false;
  auto cleanup = [&]() noexcept {
    for (auto& w : workers) {
      if (w->alive) {
        signal_worker(*w, SIGKILL);
        int status = 0;
        waitpid(w->pid, &status, 0);  // bounded: SIGKILL cannot be caught
        w->alive = false;
      } else if (stopping) {
        signal_worker(*w, SIGKILL);  // what an exited worker left behind, if it outlived SIGTERM
      }
      for (Stream* s : {&w->out, &w->err}) {
        if (s->fd >= 0) close(s->fd);
        if (s->log_fd >= 0) close(s->log_fd);
        s->fd = s->log_fd = -1;
      }
    }
  };

  // ---- start every worker ----
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(devnull >= 0, Error, "tandem run: cannot open /dev/null: {}", std::strerror(errno));
  try {
    for (const WorkerSpec& spec : config.workers) {
      auto w = std::make_unique<Worker>();
      w->spec = &spec;
      w->prefix = fmt::format("[rank{}]: ", spec.rank);
      w->exit.rank = spec.rank;
      w->exit.local_rank = spec.local_rank;
      w->out.console_fd = console ? 1 : -1;
      w->err.console_fd = console ? 2 : -1;
      w->err.is_stderr = true;
      if (!config.log_dir.empty()) {
        std::filesystem::path dir = std::filesystem::path(config.log_dir) /
                                    fmt::format("attempt_{}", config.attempt) / std::to_string(spec.rank);
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        TANDEM_CHECK(!ec, IOError, "tandem run: cannot create the log directory {}: {} (check --log-dir)",
                     dir.string(), ec.message());
        w->out.log_fd = open_log(dir / "stdout.log");
        w->err.log_fd = open_log(dir / "stderr.log");
      }
      int out[2], err[2];
      TANDEM_CHECK(pipe2(out, O_CLOEXEC) == 0, Error, "tandem run: pipe failed: {}", std::strerror(errno));
      if (pipe2(err, O_CLOEXEC) != 0) {
        int e = errno;
        close(out[0]);
        close(out[1]);
        throw Error(fmt::format("tandem run: pipe failed: {}", std::strerror(e)));
      }
      w->out.fd = out[0];
      w->err.fd = err[0];
      workers.push_back(std::move(w));
      Worker& wr = *workers.back();
      try {
        wr.pid = spawn(config, spec, out[1], err[1], devnull);
      } catch (...) {
        close(out[1]);
        close(err[1]);
        throw;
      }
      wr.alive = true;
      wr.exit.pid = wr.pid;
      close(out[1]);
      close(err[1]);
      fcntl(wr.out.fd, F_SETFL, fcntl(wr.out.fd, F_GETFL) | O_NONBLOCK);
      fcntl(wr.err.fd, F_SETFL, fcntl(wr.err.fd, F_GETFL) | O_NONBLOCK);
    }
  } catch (...) {
    close(devnull);
    cleanup();
    throw;
  }
  close(devnull);

  // ---- monitor ----
  AttemptResult result;
  bool killed = false;
  Clock::time_point kill_deadline{}, drain_deadline{}, next_remote_check = Clock::now();
  bool all_reaped = false;
  auto begin_stop = [&](int sig) {
    if (!stopping) kill_deadline = Clock::now() + config.stop_grace;
    stopping = true;
    for (auto& w : workers) signal_worker(*w, sig);
  };

  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  while (true) {
    // 1. wait for output, a signal or the next deadline
    fds.clear();
    owners.clear();
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, nullptr});
    for (auto& w : workers) {
      for (Stream* s : {&w->out, &w->err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.push_back({w.get(), s});
        }
      }
    }
    auto now = Clock::now();
    auto wait = config.tick;
    if (stopping && !killed) wait = std::min(wait, std::chrono::ceil<milliseconds>(kill_deadline - now));
    if (all_reaped) wait = std::min(wait, std::chrono::ceil<milliseconds>(drain_deadline - now));
    int n = poll(fds.data(), fds.size(), int(std::max<int64_t>(0, wait.count())));
    if (n < 0 && errno != EINTR) throw Error(fmt::format("tandem run: poll failed: {}", std::strerror(errno)));

    // 2. relay output
    for (size_t i = 1; n > 0 && i < fds.size(); ++i) {
      if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second, tail_lines);
    }

    // 3. signals to the launcher: forward; a second one kills
    if (n > 0 && fds[0].revents != 0) {
      if (int sig = signals.drain(); sig != 0) {
        if (result.kind == AttemptResult::Kind::kInterrupted) {
          for (auto& w : workers) signal_worker(*w, SIGKILL);
          killed = true;
        } else {
          result.kind = AttemptResult::Kind::kInterrupted;
          result.signal = sig;
          begin_stop(sig);
        }
      }
    }

    // 4. reap exits; the first failure (with any in the same pass) stops the group
    std::vector<WorkerExit> failed_now;
    for (auto& w : workers) {
      if (!w->alive) continue;
      int status = 0;
      pid_t r = waitpid(w->pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w->alive = false;
      w->lingers = kill(-w->pid, 0) == 0;
      if (r < 0) {  // not our child any more (cannot happen unless someone reaped it): count it failed
        w->exit.signaled = false;
        w->exit.code = 255;
      } else if (WIFSIGNALED(status)) {
        w->exit.signaled = true;
        w->exit.code = WTERMSIG(status);
      } else {
        w->exit.code = WEXITSTATUS(status);
      }
      if (w->exit.failed() && !stopping) failed_now.push_back(w->exit);
    }
    if (!failed_now.empty()) {
      result.kind = AttemptResult::Kind::kWorkerFailed;
      result.failure = failed_now.front();
      result.also_failed.assign(failed_now.begin() + 1, failed_now.end());
      begin_stop(SIGTERM);
    }
    now = Clock::now();
    if (stopping && !killed && now >= kill_deadline) {
      for (auto& w : workers) signal_worker(*w, SIGKILL);
      killed = true;
    }

    // 5. another node's failure
    if (!stopping && remote_stop && now >= next_remote_check) {
      next_remote_check = now + config.tick;
      std::optional<std::string> reason;
      try {
        reason = remote_stop();
      } catch (const std::exception& e) {
        reason = e.what();
      }
      if (reason) {
        result.kind = AttemptResult::Kind::kRemoteStop;
        result.remote_reason = *reason;
        begin_stop(SIGTERM);
      }
    }

    // 6. done when every worker is reaped and its pipes are drained (or a grandchild that keeps
    // them open has had a second to finish)
    if (!all_reaped && std::none_of(workers.begin(), workers.end(), [](auto& w) { return w->alive; })) {
      all_reaped = true;
      drain_deadline = now + milliseconds(1000);
    }
    if (all_reaped) {
      bool drained = std::all_of(workers.begin(), workers.end(),
                                 [](auto& w) { return w->out.fd < 0 && w->err.fd < 0; });
      if (drained || now >= drain_deadline) break;
    }
  }

  for (auto& w : workers) {
    close_stream(*w, w->out, tail_lines);
    close_stream(*w, w->err, tail_lines);
    w->exit.stderr_tail.assign(w->tail.begin(), w->tail.end());
  }
  auto with_tail = [&](WorkerExit& e) {
    for (auto& w : workers) {
      if (w->exit.rank == e.rank) e.stderr_tail = w->exit.stderr_tail;
    }
  };
  if (result.failure) with_tail(*result.failure);
  for (WorkerExit& e : result.also_failed) with_tail(e);
  cleanup();
  return result;
}

}  // namespace tandem::tools
