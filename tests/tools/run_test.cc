// `tandem run` end to end: the built launcher starts tests/tools/launch_probe and the tests read
// what the workers saw and what the launcher reported. Every run has a deadline (subprocess.h).
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tools/subprocess.h"
#include "util/test_util.h"

namespace tandem::testing {
namespace {

const std::string kTandem = TANDEM_CLI_PATH;
const std::string kProbe = LAUNCH_PROBE_PATH;

std::vector<std::string> cmd(std::vector<std::string> launcher_args, std::vector<std::string> probe_steps) {
  std::vector<std::string> argv = {kTandem, "run"};
  argv.insert(argv.end(), launcher_args.begin(), launcher_args.end());
  argv.push_back(kProbe);
  argv.insert(argv.end(), probe_steps.begin(), probe_steps.end());
  return argv;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof(set), &set);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// "[rank3]: env KEY=VALUE" lines -> env[3][KEY] = VALUE
std::map<int, std::map<std::string, std::string>> worker_env(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> env;
  std::regex line(R"(\[rank(\d+)\]: env ([A-Z_]+)=(.*))");
  std::istringstream in(out);
  std::string l;
  while (std::getline(in, l)) {
    std::smatch m;
    if (std::regex_match(l, m, line)) env[std::stoi(m[1])][m[2]] = m[3];
  }
  return env;
}

std::set<int> parse_cpus(const std::string& list) {
  std::set<int> cpus;
  std::istringstream in(list);
  std::string c;
  while (std::getline(in, c, ',')) cpus.insert(std::stoi(c));
  return cpus;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}


std::string fmt_rank(int r) { return "[rank" + std::to_string(r) + "]: "; }

#define EXPECT_CONTAINS(hay, needle) EXPECT_NE((hay).find(needle), std::string::npos) << "missing \"" << (needle) << "\" in:\n" << (hay)
#define EXPECT_NOT_CONTAINS(hay, needle) EXPECT_EQ((hay).find(needle), std::string::npos) << "unexpected \"" << (needle) << "\" in:\n" << (hay)

// ---- environment contract and affinity ----

class RunEnv : public ::testing::TestWithParam<int> {};

TEST_P(RunEnv, EveryRankSeesTorchrunEnvTokenThreadsAndItsCoreShare) {
  const int nproc = GetParam();
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", std::to_string(nproc)}, {"env", "store", "wrong-token"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto env = worker_env(r.out);
  ASSERT_EQ(int(env.size()), nproc) << r.out;
  for (int rank = 0; rank < nproc; ++rank) EXPECT_CONTAINS(r.out, fmt_rank(rank) + "wrong token refused");
  const std::vector<int> allowed = allowed_cpus();
  const int n = int(allowed.size());
  std::set<int> covered;
  for (int rank = 0; rank < nproc; ++rank) {
    auto& e = env[rank];
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], std::to_string(nproc));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], std::to_string(nproc));
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], env[0]["MASTER_PORT"]);
    EXPECT_NE(e["MASTER_PORT"], "0");
    EXPECT_EQ(e["TANDEM_STORE_HOSTED"], "1");
    EXPECT_TRUE(std::regex_match(e["TANDEM_STORE_TOKEN"], std::regex("[0-9a-f]{32}"))) << e["TANDEM_STORE_TOKEN"];
    EXPECT_EQ(e["TANDEM_STORE_TOKEN"], env[0]["TANDEM_STORE_TOKEN"]);
    EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
    // The share: n/nproc cores (one more for the first n%nproc ranks); oversubscribed, one core.
    const int expected = nproc > n ? 1 : n / nproc + (rank < n % nproc ? 1 : 0);
    std::set<int> cpus = parse_cpus(e["CPUS"]);
    EXPECT_EQ(int(cpus.size()), expected) << "rank " << rank << " CPUS=" << e["CPUS"];
    EXPECT_EQ(e["TANDEM_NUM_THREADS"], std::to_string(expected));
    EXPECT_EQ(e["OMP_NUM_THREADS"], std::to_string(expected));
    for (int c : cpus) {
      EXPECT_NE(std::find(allowed.begin(), allowed.end(), c), allowed.end()) << c << " is not an allowed core";
      if (nproc <= n) EXPECT_TRUE(covered.insert(c).second) << "core " << c << " is in two shares";
    }
  }
  if (nproc <= n) EXPECT_EQ(int(covered.size()), n) << "the shares do not cover every allowed core";
  // The ranks met on the launcher's store as clients with the token.
  for (int rank = 0; rank < nproc; ++rank)
    EXPECT_CONTAINS(r.out, fmt_rank(rank) + "store ok world=" + std::to_string(nproc));
}

INSTANTIATE_TEST_SUITE_P(Nproc, RunEnv, ::testing::Values(1, 2, 3));

TEST(Run, OneNodeWithoutAPortPicksAFreeOne) {
  // Two jobs at once without --standalone or --master-port must not clash on 29500.
  Subprocess a(cmd({"--nproc-per-node", "1"}, {"env", "store", "sleep:300"}), launcher_env());
  ProcResult rb = run_process(cmd({"--nproc-per-node", "1"}, {"env", "store"}), launcher_env());
  ProcResult ra = a.wait(10);
  ASSERT_EQ(ra.exit_code, 0) << ra.err;
  ASSERT_EQ(rb.exit_code, 0) << rb.err;
  EXPECT_NE(worker_env(ra.out)[0]["MASTER_PORT"], worker_env(rb.out)[0]["MASTER_PORT"]);
}

TEST(Run, NoBindLeavesTheMaskAndSplitsThreads) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2", "--no-bind"}, {"env"}), launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto env = worker_env(r.out);
  const int n = int(allowed_cpus().size());
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(int(parse_cpus(env[rank]["CPUS"]).size()), n);
    EXPECT_EQ(env[rank]["TANDEM_NUM_THREADS"], std::to_string(std::max(1, n / 2)));
  }
}

TEST(Run, KeepsThreadCountsTheUserSet) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2"}, {"env"}),
                             launcher_env({{"TANDEM_NUM_THREADS", "7"}, {"OMP_NUM_THREADS", "5"}}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto env = worker_env(r.out);
  EXPECT_EQ(env[1]["TANDEM_NUM_THREADS"], "7");
  EXPECT_EQ(env[1]["OMP_NUM_THREADS"], "5");
}

// torchrun's rendezvous flags as launch scripts pass them: --rdzv-backend c10d, --rdzv-id,
// --role, --local-addr are accepted (they used to be "unknown option"), the workers get
// TORCHELASTIC_RUN_ID and ROLE_NAME, and a bracketed IPv6 endpoint reaches them as a bare address
// (MASTER_ADDR=[::1] could not be resolved).
TEST(Run, TorchrunRendezvousFlagsAreAcceptedAndSetTheirVariables) {
  ProcResult r = run_process(cmd({"--nproc-per-node", "2", "--rdzv-backend=c10d", "--rdzv-id", "job7", "--role", "trainer",
                                  "--local-addr", "127.0.0.1", "--rdzv-endpoint", "[::1]:" + std::to_string(unused_port())},
                                 {"env"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto env = worker_env(r.out);
  ASSERT_EQ(env.size(), 2u);
  for (auto& [rank, vars] : env) {
    EXPECT_EQ(vars["TORCHELASTIC_RUN_ID"], "job7") << rank;
    EXPECT_EQ(vars["ROLE_NAME"], "trainer") << rank;
    EXPECT_EQ(vars["MASTER_ADDR"], "::1") << rank;
  }
}

TEST(Run, UnderscoreAndEqualsSpellingsAsTorchrunAccepts) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc_per_node=2", "--max_restarts", "0"}, {"env"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(worker_env(r.out).size(), 2u);
}

// ---- output ----

TEST(Run, EveryLineCarriesItsRankAndLinesNeverInterleave) {
  const int kLines = 300;
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "3"}, {"lines:" + std::to_string(kLines)}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Each probe line is written in three pieces; a relay of partial lines would break this shape.
  std::regex shape(R"(\[rank(\d)\]: line (\d) (\d+) (x+)end)");
  std::map<int, int> next;
  std::istringstream in(r.out);
  std::string l;
  int bad = 0;
  while (std::getline(in, l)) {
    std::smatch m;
    if (!std::regex_match(l, m, shape) || m[1] != m[2] || int(m[4].length()) != 40 + 7 * std::stoi(m[1])) {
      if (++bad < 5) ADD_FAILURE() << "malformed line: " << l;
      continue;
    }
    int rank = std::stoi(m[1]);
    EXPECT_EQ(std::stoi(m[3]), next[rank]) << "rank " << rank << " lines out of order";
    next[rank] = std::stoi(m[3]) + 1;
  }
  EXPECT_EQ(bad, 0);
  for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(next[rank], kLines) << "rank " << rank;
}

TEST(Run, StderrIsPrefixedOnTheLaunchersStderr) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2"}, {"r1/err:to-stderr", "out:to-stdout", "raw:no-newline"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "[rank1]: to-stderr");
  EXPECT_NOT_CONTAINS(r.out, "to-stderr");
  EXPECT_CONTAINS(r.out, "[rank0]: to-stdout");
  EXPECT_CONTAINS(r.out, "[rank1]: to-stdout");
  EXPECT_CONTAINS(r.out, "[rank0]: no-newline\n");  // a last line without newline is still relayed whole
}

TEST(Run, NprocAutoStartsOneWorkerPerAllowedCore) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node=auto"}, {"env"}), launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(worker_env(r.out).size(), allowed_cpus().size());
}

TEST(Run, AnExitedWorkersChildHoldingThePipeDoesNotHangTheLauncher) {
  // sh exits at once; its background sleep keeps the stdout pipe open for 3 s.
  ProcResult r = run_process({kTandem, "run", "--standalone", "/bin/sh", "-c", "sleep 3 & echo started"},
                             launcher_env());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "[rank0]: started");
  EXPECT_LT(r.seconds, 2.5);
}

TEST(Run, ATakenMasterPortIsReportedWithTheFix) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string port = std::to_string(ntohs(a.sin_port));
  ProcResult r = run_process(cmd({"--master-port", port}, {"out:started"}), launcher_env());
  close(fd);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_CONTAINS(r.err, "cannot host the rendezvous store on port " + port);
  EXPECT_CONTAINS(r.err, "pick a free --master-port or use --standalone");
  EXPECT_NOT_CONTAINS(r.out, "started");
}

TEST(Run, LogDirWritesEachRanksStreamsAndTeeCopiesThem) {
  ScratchDir dir;
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2", "--log-dir", dir.path()},
                                 {"out:hello", "err:oops"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::string base = dir.path() + "/attempt_0/" + std::to_string(rank);
    EXPECT_EQ(read_file(base + "/stdout.log"), "hello\n");
    EXPECT_EQ(read_file(base + "/stderr.log"), "oops\n");
  }
  EXPECT_NOT_CONTAINS(r.out, "hello");  // files only, without --tee

  ScratchDir dir2;
  r = run_process(cmd({"--standalone", "--nproc-per-node", "1", "--log-dir", dir2.path(), "--tee", "3"},
                      {"out:hello", "err:oops"}),
                  launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_file(dir2.path() + "/attempt_0/0/stdout.log"), "hello\n");
  EXPECT_CONTAINS(r.out, "[rank0]: hello");
  EXPECT_CONTAINS(r.err, "[rank0]: oops");
}

// torchrun's forms of --tee/--redirects are taken as options, not as PROGRAM ("0:3" was run).
TEST(Run, TorchrunTeeAndRedirectsFormsAreAccepted) {
  ScratchDir dir;
  ProcResult r = run_process(cmd({"--standalone", "--log-dir", dir.path(), "--tee", "0:3", "-r", "3"}, {"out:hello"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "[rank0]: hello");
  EXPECT_EQ(read_file(dir.path() + "/attempt_0/0/stdout.log"), "hello\n");
  ScratchDir dir2;
  r = run_process(cmd({"--standalone", "--log-dir", dir2.path(), "-t", "1"}, {"out:hi"}), launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "[rank0]: hi");
}

// A --log-dir holding an earlier run's logs is refused before anything starts: the new run
// overwrote them file by file and left the earlier attempts' directories mixed in.
TEST(Run, ALogDirWithAnEarlierRunsLogsIsRefused) {
  ScratchDir dir;
  ProcResult r = run_process(cmd({"--standalone", "--log-dir", dir.path()}, {"out:first"}), launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_process(cmd({"--standalone", "--log-dir", dir.path()}, {"out:second"}), launcher_env());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "already holds an earlier run's logs");
  EXPECT_EQ(read_file(dir.path() + "/attempt_0/0/stdout.log"), "first\n");
}

// Workers get only stdin, stdout and stderr: a descriptor the launcher inherited (here 7) was
// passed on to every worker (torchrun's Popen closes them).
TEST(Run, WorkersInheritOnlyTheStandardDescriptors) {
  ProcResult r = run_process({"/bin/sh", "-c", "exec 7</dev/null; exec \"$0\" run --standalone /bin/sh -c 'ls /proc/$$/fd'",
                              kTandem},
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> fds;
  std::istringstream in(r.out);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("[rank0]: ", 0) == 0) fds.insert(l.substr(9));
  }
  EXPECT_EQ(fds, (std::set<std::string>{"0", "1", "2"})) << r.out;
}

// A launcher started with stdout and stderr closed: its pipes took fds 1 and 2, and a worker's
// stderr byte 0x0f read as SIGTERM stopped the job (exit 143). The worker's line now goes to
// /dev/null and the job succeeds.
TEST(Run, ClosedStandardDescriptorsDoNotTurnOutputIntoSignals) {
  ScratchDir dir;
  const std::string done = dir.path() + "/done";
  ProcResult r = run_process({"/bin/sh", "-c",
                              "exec \"$0\" run --standalone /bin/sh -c 'sleep 0.3; printf \"x\\017y\\n\" >&2; sleep 0.5; "
                              "touch \"$1\"' sh \"$1\" >&- 2>&-",
                              kTandem, done},
                             launcher_env());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(std::filesystem::exists(done));
}

// ---- failures ----

TEST(Run, AFailingRankStopsTheOthersQuicklyAndIsNamedWithItsStderrTail) {
  // Ranks 0 and 2 would sleep 30 s and then print "woke"; rank 1 fails at once.
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "3"},
                                 {"r1/err:first-words", "r1/err:last-words", "r1/exit:3", "sleep:30000", "out:woke"}),
                             launcher_env());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.seconds, 10.0) << "the launcher waited for the sleeping ranks";
  EXPECT_NOT_CONTAINS(r.out, "woke");
  EXPECT_CONTAINS(r.err, "rank 1 (local rank 1 on node 0");
  EXPECT_CONTAINS(r.err, "failed with exit code 3");
  EXPECT_CONTAINS(r.err, "last 2 stderr line(s):\n  [rank1]: first-words\n  [rank1]: last-words");
  EXPECT_CONTAINS(r.err, "no restarts left");
  EXPECT_NOT_CONTAINS(r.err, "rank 0 (local");  // the stopped ranks are not reported as failures
}

// A worker that exited (here successfully) left a background process in its process group; when
// another rank's failure stops the attempt, that process is stopped too instead of living on
// with the launcher gone.
TEST(Run, AStoppedAttemptAlsoStopsWhatAnExitedWorkerLeftRunning) {
  tandem::testing::TempDir dir;
  const std::string pid_file = dir.path() + "/bg.pid";
  const std::string script = "if [ \"$RANK\" = 0 ]; then sleep 300 </dev/null >/dev/null 2>&1 & echo $! > " + pid_file +
                             "; exit 0; else sleep 1; exit 3; fi";
  ProcResult r = run_process({kTandem, "run", "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c", script},
                             launcher_env());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  std::ifstream f(pid_file);
  long pid = 0;
  ASSERT_TRUE(f >> pid) << "rank 0 did not start its background process";
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {  // SIGTERM when the attempt stops (SIGKILL at its end)
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    gone = !std::getline(stat, line) || line.find(") Z ") != std::string::npos;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!gone) kill(static_cast<pid_t>(pid), SIGKILL);
  EXPECT_TRUE(gone) << "rank 0's background process " << pid << " outlived the stopped attempt";
}

TEST(Run, ARankKilledByASignalIsNamedBySignal) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2"}, {"r0/raise:9", "sleep:30000"}),
                             launcher_env());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_CONTAINS(r.err, "rank 0 (local rank 0");
  EXPECT_CONTAINS(r.err, "failed with signal 9 (SIGKILL)");
  EXPECT_CONTAINS(r.err, "it wrote nothing to stderr");
}

TEST(Run, AWorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2", "--stop-grace", "0.5"},
                                 {"ignore-term", "r0/sleep:300", "r0/exit:1", "sleep:30000"}),
                             launcher_env());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.seconds, 8.0);
  EXPECT_GT(r.seconds, 0.7) << "rank 1 ignores SIGTERM, so only SIGKILL after 0.5 s stops it";
}

TEST(Run, RestartsTheGroupAndTheSecondAttemptSucceeds) {
  ScratchDir dir;
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--log-dir",
                                  dir.path(), "--tee"},
                                 {"a0/r1/err:flaky", "a0/r1/exit:5", "env", "store"}),
                             launcher_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "rank 1 (local rank 1 on node 0");
  EXPECT_CONTAINS(r.err, "exit code 5 on attempt 0");
  EXPECT_CONTAINS(r.err, "restarting the worker group (restart 1 of --max-restarts 2)");
  EXPECT_NOT_CONTAINS(r.err, "restart 2 of");
  // Attempt 1's workers saw the restart count and met on the store again (under a fresh prefix).
  EXPECT_CONTAINS(read_file(dir.path() + "/attempt_1/1/stdout.log"), "env TORCHELASTIC_RESTART_COUNT=1");
  EXPECT_CONTAINS(read_file(dir.path() + "/attempt_1/0/stdout.log"), "store ok world=2");
  EXPECT_CONTAINS(read_file(dir.path() + "/attempt_0/1/stderr.log"), "flaky");
}

TEST(Run, GivesUpAfterMaxRestarts) {
  ProcResult r = run_process(cmd({"--standalone", "--nproc-per-node", "1", "--max-restarts", "2"}, {"exit:4"}),
                             launcher_env());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_CONTAINS(r.err, "exit code 4 on attempt 2");
  EXPECT_CONTAINS(r.err, "job failed: rank 0");
  EXPECT_CONTAINS(r.err, "no restarts left (--max-restarts 2)");
}

// ---- signals ----

class RunSignal : public ::testing::TestWithParam<int> {};

TEST_P(RunSignal, ASignalToTheLauncherReachesEveryWorker) {
  const int sig = GetParam();
  const std::string name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  Subprocess p(cmd({"--standalone", "--nproc-per-node", "2"}, {"trap", "out:ready", "sleep:30000"}), launcher_env());
  ASSERT_TRUE(p.wait_for_stdout("ready", 2, 15)) << p.out();
  p.signal(sig);
  ProcResult r = p.wait(15);
  EXPECT_EQ(r.exit_code, 128 + sig) << r.err;
  EXPECT_CONTAINS(r.out, "[rank0]: got " + name);
  EXPECT_CONTAINS(r.out, "[rank1]: got " + name);
  EXPECT_CONTAINS(r.err, "got " + name + "; forwarded it to the workers");
}

INSTANTIATE_TEST_SUITE_P(Signals, RunSignal, ::testing::Values(SIGTERM, SIGINT));

TEST(Run, ASecondSignalKillsWorkersThatIgnoreTheFirst) {
  // The default grace is 5 s; the second SIGTERM must not wait for it.
  Subprocess p(cmd({"--standalone", "--nproc-per-node", "2"}, {"ignore-term", "out:ready", "sleep:30000"}),
               launcher_env());
  ASSERT_TRUE(p.wait_for_stdout("ready", 2, 15)) << p.out();
  auto t0 = std::chrono::steady_clock::now();
  p.signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  p.signal(SIGTERM);
  ProcResult r = p.wait(15);
  double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_LT(after, 3.0);
}

// Whether `pid` is gone (or a zombie nobody reaped yet).
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  size_t close_paren = text.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < text.size() && text[close_paren + 2] == 'Z';
}

std::vector<pid_t> worker_pids(const std::string& out) {
  std::vector<pid_t> pids;
  std::regex line(R"(\[rank\d+\]: pid (\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) pids.push_back(std::stoi((*it)[1]));
  return pids;
}

bool all_gone_within(const std::vector<pid_t>& pids, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (std::all_of(pids.begin(), pids.end(), process_gone)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(Run, WorkersDieWithAKilledLauncher) {
  Subprocess p(cmd({"--standalone", "--nproc-per-node", "2"}, {"ignore-term", "pid", "out:ready", "sleep:30000"}),
               launcher_env());
  ASSERT_TRUE(p.wait_for_stdout("ready", 2, 15)) << p.out();
  std::vector<pid_t> pids = worker_pids(p.out());
  ASSERT_EQ(pids.size(), 2u) << p.out();
  p.signal(SIGKILL);
  p.wait(5);
  EXPECT_TRUE(all_gone_within(pids, 5.0)) << "workers outlived their launcher";
}

// ---- bad arguments ----

struct BadArgs {
  std::vector<std::string> args;
  std::string expect;
};

class RunBadArgs : public ::testing::TestWithParam<BadArgs> {};

TEST_P(RunBadArgs, ExitTwoNamingTheArgument) {
  std::vector<std::string> argv = {kTandem, "run"};
  for (const auto& a : GetParam().args) argv.push_back(a == "PROBE" ? kProbe : a);
  ProcResult r = run_process(argv, launcher_env());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_CONTAINS(r.err, GetParam().expect);
  EXPECT_EQ(r.out, "");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RunBadArgs,
    ::testing::Values(BadArgs{{"--nproc-per-node", "2"}, "missing PROGRAM"},
                      BadArgs{{"--nproc-per-node", "0", "PROBE"}, "--nproc-per-node must be between 1 and 4096, got 0; give a worker count"},
                      BadArgs{{"--nproc-per-node", "two", "PROBE"}, "--nproc-per-node expects a worker count"},
                      BadArgs{{"--nproc-per-node"}, "--nproc-per-node needs a value"},
                      BadArgs{{"--nprocs-per-node", "2", "PROBE"}, "unknown option \"--nprocs-per-node\" (did you mean --nproc-per-node?)"},
                      BadArgs{{"--max-restarts", "-1", "PROBE"}, "--max-restarts must be between 0 and"},
                      BadArgs{{"--stop-grace", "soon", "PROBE"}, "--stop-grace expects seconds"},
                      BadArgs{{"--nnodes", "2", "--node-rank", "2", "PROBE"}, "--node-rank 2 is out of range"},
                      BadArgs{{"--nnodes", "1:4", "PROBE"}, "elastic node ranges are not supported"},
                      BadArgs{{"--nnodes", "2", "--node-rank", "0", "PROBE"}, "needs the same TANDEM_STORE_TOKEN"},
                      // torchrun's c10d assigns node ranks; here every node would have been node 0.
                      BadArgs{{"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "PROBE"},
                              "--nnodes 2 needs --node-rank on every node"},
                      // A switch with a value was taken as on: --standalone=false turned standalone on.
                      BadArgs{{"--standalone=false", "PROBE"}, "--standalone takes no value, got \"--standalone=false\""},
                      BadArgs{{"--no-bind=no", "PROBE"}, "--no-bind takes no value"},
                      BadArgs{{"--tee=9", "PROBE"}, "--tee expects 0-3 or LOCAL_RANK:0-3"},
                      BadArgs{{"--redirects", "x", "PROBE"}, "--redirects expects 0-3"},
                      // access(X_OK) passes a directory; every restart then failed the same execve.
                      BadArgs{{"--standalone", "--max-restarts", "2", "/tmp"}, "PROGRAM \"/tmp\" is a directory"},
                      BadArgs{{"--standalone", "./no-such-program"}, "\"./no-such-program\" is not an executable"},
                      BadArgs{{"--standalone", "no-such-program-on-path"}, "was not found on PATH"},
                      BadArgs{{"--rdzv-backend", "etcd", "PROBE"}, "--rdzv-backend \"etcd\" is not supported"},
                      BadArgs{{"-m", "train_module"}, "-m/--module runs a Python module under torchrun"}));

// ---- two nodes on one machine ----

TEST(Run, TwoLaunchersFormOneJobOverLoopback) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r, std::vector<std::string> steps) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-addr", "127.0.0.1", "--master-port", port,
                "--nproc-per-node", "2", "--rdzv-timeout", "15"},
               steps);
  };
  Subprocess n1(node(1, {"env", "store"}), env);  // node 1 first: it must wait for node 0's store
  Subprocess n0(node(0, {"env", "store"}), env);
  ProcResult r0 = n0.wait(20), r1 = n1.wait(20);
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  auto e0 = worker_env(r0.out), e1 = worker_env(r1.out);
  ASSERT_EQ(e0.size(), 2u);
  ASSERT_EQ(e1.size(), 2u);
  for (auto& [env_map, node_rank] : {std::pair{&e0, 0}, std::pair{&e1, 1}}) {
    for (int local = 0; local < 2; ++local) {
      int rank = node_rank * 2 + local;
      auto& e = (*env_map)[rank];
      EXPECT_EQ(e["RANK"], std::to_string(rank));
      EXPECT_EQ(e["LOCAL_RANK"], std::to_string(local));
      EXPECT_EQ(e["WORLD_SIZE"], "4");
      EXPECT_EQ(e["GROUP_RANK"], std::to_string(node_rank));
      EXPECT_EQ(e["MASTER_PORT"], port);
      EXPECT_EQ(e["TANDEM_STORE_TOKEN"], "two-node-test-secret");
    }
  }
  // All four ranks met on node 0's store.
  EXPECT_CONTAINS(r0.out, "[rank0]: store ok world=4");
  EXPECT_CONTAINS(r1.out, "[rank3]: store ok world=4");
}

TEST(Run, AFailureOnOneNodeStopsBothAndIsNamedOnNodeZero) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--nproc-per-node", "1",
                "--rdzv-timeout", "15"},
               {"r1/sleep:200", "r1/exit:7", "sleep:30000", "out:woke"});
  };
  Subprocess n0(node(0), env);
  Subprocess n1(node(1), env);
  ProcResult r0 = n0.wait(20), r1 = n1.wait(20);
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
  EXPECT_EQ(r1.exit_code, 1) << r1.err;
  EXPECT_LT(r0.seconds, 10.0);
  EXPECT_NOT_CONTAINS(r0.out, "woke");
  EXPECT_CONTAINS(r1.err, "rank 1 (local rank 0 on node 1");
  EXPECT_CONTAINS(r0.err, "rank 1 (local rank 0 on node 1");
  EXPECT_CONTAINS(r0.err, "exit code 7");
}

// Heartbeats come from their own thread: a --monitor-interval longer than --heartbeat-timeout
// made node 0 take the healthy node 1 (whose worker was still running) for dead.
TEST(Run, ASlowMonitorIntervalDoesNotMakeAHealthyNodeLookDead) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--nproc-per-node", "1",
                "--rdzv-timeout", "15", "--monitor-interval", "2", "--heartbeat-timeout", "0.8"},
               {"r1/sleep:4000", "out:done"});
  };
  Subprocess n0(node(0), env);
  Subprocess n1(node(1), env);
  ProcResult r0 = n0.wait(25), r1 = n1.wait(25);
  EXPECT_EQ(r0.exit_code, 0) << r0.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_NOT_CONTAINS(r0.err, "stopped answering");
  EXPECT_CONTAINS(r1.out, "[rank1]: done");
}

TEST(Run, ANodeThatNeverJoinsIsNamedAfterTheRendezvousTimeout) {
  const std::string port = std::to_string(unused_port());
  ProcResult r = run_process(cmd({"--nnodes", "2", "--node-rank", "0", "--master-port", port, "--rdzv-timeout", "0.5"},
                                 {"out:started"}),
                             launcher_env({{"TANDEM_STORE_TOKEN", "t"}}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_CONTAINS(r.err, "node(s) 1 did not join attempt 0 within 0.5 s");
  EXPECT_NOT_CONTAINS(r.out, "started");
}

TEST(Run, AFailureOnOneNodeRestartsBothNodes) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--nproc-per-node", "1",
                "--max-restarts", "1", "--rdzv-timeout", "15"},
               {"a0/r1/exit:7", "a0/sleep:30000", "env", "store"});
  };
  Subprocess n0(node(0), env);
  Subprocess n1(node(1), env);
  ProcResult r0 = n0.wait(20), r1 = n1.wait(20);
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_LT(r0.seconds, 10.0);
  EXPECT_CONTAINS(r0.err, "restarting the worker group (restart 1 of --max-restarts 1)");
  EXPECT_EQ(worker_env(r0.out)[0]["TORCHELASTIC_RESTART_COUNT"], "1");
  EXPECT_CONTAINS(r1.out, "[rank1]: store ok world=2");
}

TEST(Run, ANodeWhoseLauncherDiesIsNamedByTheOthers) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--nproc-per-node", "1",
                "--rdzv-timeout", "15", "--heartbeat-timeout", "1"},
               {"pid", "out:ready", "sleep:30000", "out:woke"});
  };
  Subprocess n0(node(0), env);
  Subprocess n1(node(1), env);
  ASSERT_TRUE(n1.wait_for_stdout("ready", 1, 15)) << n1.out();
  ASSERT_TRUE(n0.wait_for_stdout("ready", 1, 15)) << n0.out();
  n1.signal(SIGKILL);
  ProcResult r0 = n0.wait(20);
  n1.wait(5);
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
  EXPECT_LT(r0.seconds, 10.0);
  EXPECT_CONTAINS(r0.err, "the launcher of node 1 stopped answering");
  EXPECT_NOT_CONTAINS(r0.err, "restarting");
  EXPECT_TRUE(all_gone_within(worker_pids(n1.out()), 5.0));
}

TEST(Run, AnInterruptedNodeEndsTheJobOnEveryNodeWithoutRestarts) {
  const std::string port = std::to_string(unused_port());
  auto env = launcher_env({{"TANDEM_STORE_TOKEN", "two-node-test-secret"}});
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--nproc-per-node", "1",
                "--max-restarts", "3", "--rdzv-timeout", "15"},
               {"out:ready", "sleep:30000"});
  };
  Subprocess n0(node(0), env);
  Subprocess n1(node(1), env);
  ASSERT_TRUE(n0.wait_for_stdout("ready", 1, 15)) << n0.out();
  ASSERT_TRUE(n1.wait_for_stdout("ready", 1, 15)) << n1.out();
  n1.signal(SIGINT);
  ProcResult r1 = n1.wait(10), r0 = n0.wait(10);
  EXPECT_EQ(r1.exit_code, 128 + SIGINT) << r1.err;
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
  EXPECT_LT(r0.seconds, 8.0);
  EXPECT_CONTAINS(r0.err, "the launcher of node 1 got SIGINT");
  EXPECT_NOT_CONTAINS(r0.err, "restarting");
}

TEST(Run, ANodeWithTheWrongTokenFailsAtOnceNamingIt) {
  const std::string port = std::to_string(unused_port());
  auto node = [&](int r) {
    return cmd({"--nnodes", "2", "--node-rank", std::to_string(r), "--master-port", port, "--rdzv-timeout", "3"},
               {"out:started"});
  };
  Subprocess n0(node(0), launcher_env({{"TANDEM_STORE_TOKEN", "right"}}));
  ProcResult r1 = run_process(node(1), launcher_env({{"TANDEM_STORE_TOKEN", "wrong"}}));
  ProcResult r0 = n0.wait(10);
  EXPECT_EQ(r1.exit_code, 1);
  EXPECT_LT(r1.seconds, 2.5) << "retried a refused token";
  EXPECT_CONTAINS(r1.err, "refused this node's TANDEM_STORE_TOKEN");
  EXPECT_EQ(r0.exit_code, 1);
  EXPECT_CONTAINS(r0.err, "node(s) 1 did not join");
}

}  // namespace
}  // namespace tandem::testing
