// A worker for the `tandem run` tests: runs the steps given as arguments, in order, so each test
// scripts the behaviour it needs (print env, sleep, fail, raise a signal, meet on the store...).
// A step "rN/STEP" runs only on rank N, "aK/STEP" only on attempt K (TORCHELASTIC_RESTART_COUNT);
// prefixes combine ("a0/r1/exit:3").
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "tandem/dist/tcp_store.h"

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

void put(int fd, const std::string& text) {
  const char* p = text.data();
  size_t n = text.size();
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return;
    p += w;
    n -= size_t(w);
  }
}

extern "C" void on_signal(int sig) {
  const char* msg = sig == SIGINT ? "got SIGINT\n" : "got SIGTERM\n";
  ssize_t ignored = write(1, msg, std::strlen(msg));
  (void)ignored;
  _exit(42);
}

int run_step(const std::string& step, long rank, long attempt) {
  std::string s = step;
  // filters
  while (s.size() > 2 && (s[0] == 'r' || s[0] == 'a') && std::isdigit(static_cast<unsigned char>(s[1]))) {
    size_t slash = s.find('/');
    if (slash == std::string::npos) break;
    long want = std::atol(s.substr(1, slash - 1).c_str());
    if ((s[0] == 'r' ? rank : attempt) != want) return -1;
    s = s.substr(slash + 1);
  }
  std::string verb = s, arg;
  if (size_t colon = s.find(':'); colon != std::string::npos) {
    verb = s.substr(0, colon);
    arg = s.substr(colon + 1);
  }
  if (verb == "env") {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "TANDEM_STORE_TOKEN", "TANDEM_STORE_HOSTED", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "ROLE_NAME",
                          "TANDEM_NUM_THREADS", "OMP_NUM_THREADS"}) {
      put(1, "env " + std::string(v) + "=" + env_or(v, "<unset>") + "\n");
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof(set), &set);
    std::string cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus += (cpus.empty() ? "" : ",") + std::to_string(c);
    }
    put(1, "env CPUS=" + cpus + "\n");
  } else if (verb == "out") {
    put(1, arg + "\n");
  } else if (verb == "raw") {
    put(1, arg);  // no newline
  } else if (verb == "err") {
    put(2, arg + "\n");
  } else if (verb == "lines") {
    // Each line in three writes with pauses between them: a relay that forwarded partial lines
    // would interleave ranks.
    long n = std::atol(arg.c_str());
    for (long i = 0; i < n; ++i) {
      put(1, "line " + std::to_string(rank) + " ");
      if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      put(1, std::to_string(i) + " " + std::string(size_t(40 + rank * 7), 'x'));
      put(1, "end\n");
    }
  } else if (verb == "sleep") {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atol(arg.c_str())));
  } else if (verb == "exit") {
    std::exit(std::atoi(arg.c_str()));
  } else if (verb == "raise") {
    kill(getpid(), std::atoi(arg.c_str()));
    std::this_thread::sleep_for(std::chrono::seconds(5));  // a caught/ignored signal: not expected
    return 99;
  } else if (verb == "trap") {
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
  } else if (verb == "ignore-term") {
    signal(SIGTERM, SIG_IGN);
  } else if (verb == "store") {
    // The launcher's contract: the store is hosted (rank 0 is a client too) and wants the token.
    if (env_or("TANDEM_STORE_HOSTED", "") != "1") {
      put(2, "store: TANDEM_STORE_HOSTED is not 1\n");
      return 3;
    }
    tandem::dist::TCPStoreOptions o;
    o.is_master = false;
    o.timeout = std::chrono::milliseconds(10000);
    tandem::dist::TCPStore store(env_or("MASTER_ADDR", ""), uint16_t(std::atoi(env_or("MASTER_PORT", "0").c_str())), o);
    long world = std::atol(env_or("WORLD_SIZE", "0").c_str());
    std::string prefix = "/worker/attempt_" + std::to_string(attempt) + "/";
    store.set(prefix + "rank" + std::to_string(rank), std::to_string(rank));
    std::vector<std::string> keys;
    for (long r = 0; r < world; ++r) keys.push_back(prefix + "rank" + std::to_string(r));
    store.wait(keys, std::chrono::milliseconds(10000));
    put(1, "store ok world=" + std::to_string(store.add(prefix + "count", 1) > 0 ? world : -1) + "\n");
  } else if (verb == "wrong-token") {
    // The hosted store must refuse a client without the job's token.
    tandem::dist::TCPStoreOptions o;
    o.is_master = false;
    o.timeout = std::chrono::milliseconds(2000);
    o.token = "not-the-job-token";
    try {
      tandem::dist::TCPStore store(env_or("MASTER_ADDR", ""), uint16_t(std::atoi(env_or("MASTER_PORT", "0").c_str())),
                                   o);
      store.set("intruder", "1");
      put(1, "wrong token accepted\n");
    } catch (const tandem::dist::CommError&) {
      put(1, "wrong token refused\n");
    }
  } else if (verb == "pid") {
    put(1, "pid " + std::to_string(getpid()) + "\n");
  } else {
    put(2, "launch_probe: unknown step \"" + step + "\"\n");
    return 100;
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  long rank = std::atol(env_or("RANK", "0").c_str());
  long attempt = std::atol(env_or("TORCHELASTIC_RESTART_COUNT", "0").c_str());
  try {
    for (int i = 1; i < argc; ++i) {
      int rc = run_step(argv[i], rank, attempt);
      if (rc >= 0) return rc;
    }
  } catch (const std::exception& e) {
    put(2, std::string("launch_probe: ") + e.what() + "\n");
    return 4;
  }
  return 0;
}
