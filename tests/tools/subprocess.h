// Test helper: runs a program with a given environment, collecting its stdout/stderr, with a
// deadline on every wait (a hung launcher fails the test instead of hanging it).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace tandem::testing {

struct ProcResult {
  int exit_code = -1;   // -1 when killed by a signal (see term_signal) or timed out
  int term_signal = 0;
  bool timed_out = false;
  std::string out, err;
  double seconds = 0;
};

// The test's environment without the variables a launcher sets (so the test sees the launcher's
// choices, not the suite's TANDEM_NUM_THREADS=1), plus `set`.
inline std::vector<std::string> launcher_env(const std::map<std::string, std::string>& set = {}) {
  static const char* kDrop[] = {"TANDEM_NUM_THREADS", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TANDEM_STORE_TOKEN",
                                "TANDEM_STORE_HOSTED", "TORCHELASTIC_RESTART_COUNT"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    bool drop = set.count(key) > 0;
    for (const char* d : kDrop) drop = drop || key == d;
    if (!drop) env.push_back(kv);
  }
  for (auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

class Subprocess {
 public:
  Subprocess(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    std::vector<char*> a, e;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    for (auto& s : env) e.push_back(const_cast<char*>(s.c_str()));
    e.push_back(nullptr);
    start_ = std::chrono::steady_clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      execve(a[0], a.data(), e.data());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }
  ~Subprocess() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_) if (fd >= 0) close(fd);
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) { kill(pid_, sig); }
  const std::string& out() const { return result_.out; }

  // Reads output until `text` occurs `times` times in stdout; false on timeout or EOF.
  bool wait_for_stdout(const std::string& text, int times, double timeout_s) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (count(result_.out, text) < times) {
      if (std::chrono::steady_clock::now() >= deadline || (fds_[0] < 0 && fds_[1] < 0)) return false;
      pump(50);
    }
    return true;
  }

  // Waits for exit and EOF; kills the process after `timeout_s`.
  ProcResult wait(double timeout_s) {
    auto deadline = start_ + std::chrono::duration<double>(timeout_s);
    while (!reaped_ || fds_[0] >= 0 || fds_[1] >= 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        if (!reaped_) {
          kill(pid_, SIGKILL);
          result_.timed_out = true;
        } else {
          break;  // exited, but something still holds its pipes: take what we have
        }
      }
      pump(20);
      if (!reaped_) {
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
          reaped_ = true;
          result_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
          if (WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
          if (WIFSIGNALED(status)) result_.term_signal = WTERMSIG(status);
        }
      }
    }
    return result_;
  }

 private:
  static int count(const std::string& hay, const std::string& needle) {
    int n = 0;
    for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
    return n;
  }
  void pump(int ms) {
    pollfd p[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
    if (poll(p, 2, ms) <= 0) return;
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0 || p[i].revents == 0) continue;
      char buf[65536];
      ssize_t n = read(fds_[i], buf, sizeof(buf));
      if (n > 0) {
        (i == 0 ? result_.out : result_.err).append(buf, size_t(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds_[i]);
        fds_[i] = -1;
      }
    }
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int fds_[2] = {-1, -1};
  std::chrono::steady_clock::time_point start_;
  ProcResult result_;
};

inline ProcResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                              double timeout_s = 20) {
  Subprocess p(argv, env);
  return p.wait(timeout_s);
}

// A fresh directory under the temp dir, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tandem_tools_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tandem::testing
