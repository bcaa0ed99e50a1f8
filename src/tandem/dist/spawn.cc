// dist::spawn: fork, set the torchrun variables, run fn(rank), report an exception through a pipe,
// _exit. The parent polls the pipes and reaps children until all ended or the deadline passed.
#include "tandem/dist/spawn.h"

#include <fcntl.h>
#include <cxxabi.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <typeinfo>

#include <fmt/ranges.h>

#include "tandem/dist/tcp_store_server.h"

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::string type_name(const std::exception& e) {
  int status = 0;
  char* d = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
  std::string s = (status == 0 && d != nullptr) ? d : typeid(e).name();
  std::free(d);
  return s;
}

void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string random_token() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

}  // namespace

std::string ProcessResult::describe() const {
  std::string how = signal != 0 ? fmt::format("was killed by signal {} ({})", signal, strsignal(signal))
                                : fmt::format("exited with code {}", exit_code);
  return fmt::format("rank {} (pid {}) {}{}{}", rank, pid, how, error.empty() ? "" : ": ", error);
}

SpawnError::SpawnError(const ProcessResult& r) : Error("dist::spawn: " + r.describe()), result_(r) {}

std::vector<ProcessResult> spawn_results(int nprocs, const std::function<void(int)>& fn, const SpawnOptions& options) {
  TANDEM_CHECK(nprocs >= 1, ValueError, "dist::spawn: nprocs must be >= 1, got {}", nprocs);
  // Without a given port, the store's socket is bound here, before forking, and handed to rank 0
  // (TANDEM_STORE_LISTEN_FD, taken by its TCPStore): a port picked and closed here could be taken
  // by another process before rank 0 binds it.
  int listen_fd = -1;
  int port = options.master_port;
  if (port <= 0) {
    uint16_t bound = 0;
    listen_fd = TCPStoreServer::listen_on(0, &bound);
    port = bound;
  }
  struct CloseListener {
    int& fd;
    ~CloseListener() {
      if (fd >= 0) close(fd);
    }
  } close_listener{listen_fd};
  const std::string token = random_token();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<ProcessResult> results(nprocs);
  std::vector<int> fds(nprocs, -1);
  std::vector<std::string> texts(nprocs);
  std::vector<bool> running(nprocs, false);
  auto kill_all = [&](int sig) {
    for (int r = 0; r < nprocs; ++r) {
      if (running[r]) kill(results[r].pid, sig);
    }
  };
  for (int r = 0; r < nprocs; ++r) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      kill_all(SIGKILL);
      throw CommError(fmt::format("dist::spawn: pipe() failed: {}", std::strerror(errno)));
    }
    const pid_t pid = fork();
    if (pid < 0) {
      const int e = errno;
      close(p[0]);
      close(p[1]);
      kill_all(SIGKILL);
      throw CommError(fmt::format("dist::spawn: fork() of rank {} failed: {}", r, std::strerror(e)));
    }
    if (pid == 0) {
      close(p[0]);
      for (int k = 0; k < r; ++k) close(fds[k]);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
      setenv("GROUP_RANK", "0", 1);
      setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("TANDEM_STORE_TOKEN", token.c_str(), 1);
      if (listen_fd >= 0 && r == 0) {
        setenv("TANDEM_STORE_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
      } else if (listen_fd >= 0) {
        close(listen_fd);
      }
      for (const auto& [k, v] : options.env) setenv(k.c_str(), v.c_str(), 1);
      int code = 0;
      try {
        fn(r);
      } catch (const std::exception& e) {
        write_all(p[1], type_name(e) + ": " + e.what());
        code = 1;
      } catch (...) {
        write_all(p[1], "unknown exception (not derived from std::exception)");
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      close(p[1]);
      _exit(code);  // the child's end: no atexit handlers or static destructors of the parent's image
    }
    close(p[1]);
    fds[r] = p[0];
    results[r].rank = r;
    results[r].pid = pid;
    running[r] = true;
  }
  if (listen_fd >= 0) {  // rank 0 has its copy
    close(listen_fd);
    listen_fd = -1;
  }
  const auto deadline = Clock::now() + options.timeout;
  int left = nprocs;
  bool stopping = false;
  auto stop_deadline = Clock::time_point::max();
  while (left > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 0; r < nprocs; ++r) {
      if (fds[r] >= 0) {
        pfds.push_back({fds[r], POLLIN, 0});
        who.push_back(r);
      }
    }
    if (!pfds.empty()) poll(pfds.data(), pfds.size(), 10);
    else std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = read(pfds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        if (texts[who[i]].size() < (1 << 16)) texts[who[i]].append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[who[i]]);
        fds[who[i]] = -1;
      }
    }
    for (int r = 0; r < nprocs; ++r) {
      if (!running[r]) continue;
      int status = 0;
      const pid_t w = waitpid(results[r].pid, &status, WNOHANG);
      if (w != results[r].pid) continue;
      running[r] = false;
      --left;
      if (WIFEXITED(status)) results[r].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) results[r].signal = WTERMSIG(status);
      if (!results[r].ok() && options.stop_others_on_failure && !stopping) {
        stopping = true;
        kill_all(SIGTERM);
        stop_deadline = Clock::now() + std::chrono::seconds(2);
      }
    }
    const auto now = Clock::now();
    if (now >= stop_deadline) {
      kill_all(SIGKILL);
      stop_deadline = Clock::time_point::max();
    }
    if (now >= deadline && left > 0) {
      std::vector<int> still;
      for (int r = 0; r < nprocs; ++r) {
        if (running[r]) still.push_back(r);
      }
      kill_all(SIGKILL);
      for (int r = 0; r < nprocs; ++r) {
        if (running[r]) waitpid(results[r].pid, nullptr, 0);
        if (fds[r] >= 0) close(fds[r]);
      }
      throw Timeout(fmt::format("dist::spawn: rank(s) {} of {} still ran after {} ms and were killed",
                                fmt::join(still, ", "), nprocs, options.timeout.count()));
    }
  }
  // Drain what is left in the pipes.
  for (int r = 0; r < nprocs; ++r) {
    if (fds[r] < 0) continue;
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[r], buf, sizeof(buf))) > 0) texts[r].append(buf, static_cast<size_t>(n));
    close(fds[r]);
  }
  for (int r = 0; r < nprocs; ++r) results[r].error = texts[r];
  return results;
}

void spawn(int nprocs, const std::function<void(int)>& fn, const SpawnOptions& options) {
  auto results = spawn_results(nprocs, fn, options);
  // The first failure that is not a consequence of our own SIGTERM/SIGKILL: prefer children that
  // reported an exception or died on their own.
  const ProcessResult* first = nullptr;
  for (const auto& r : results) {
    if (r.ok()) continue;
    const bool stopped_by_us = (r.signal == SIGTERM || r.signal == SIGKILL) && r.error.empty();
    if (first == nullptr || (!stopped_by_us && first->error.empty() && first->signal != 0)) first = &r;
  }
  if (first != nullptr) throw SpawnError(*first);
}

}  // namespace tandem::dist
