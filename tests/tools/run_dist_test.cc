// `tandem run` with real Tandem workers: init_process_group("env://") must find the launcher's
// hosted store (TANDEM_STORE_HOSTED=1: rank 0 is a client too) and a restarted group must not be
// confused by the keys its first attempt left in that store.
#include <gtest/gtest.h>

#include "tools/subprocess.h"

namespace tandem::testing {
namespace {

const std::string kTandem = TANDEM_CLI_PATH;
const std::string kDistProbe = DIST_PROBE_PATH;

TEST(RunDist, ShmAllReduceUnderTheLauncher) {
  ProcResult r = run_process({kTandem, "run", "--standalone", "--nproc-per-node", "2", kDistProbe, "shm"},
                             launcher_env(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]: allreduce ok attempt=0 world=2 sum=3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]: allreduce ok attempt=0 world=2 sum=3"), std::string::npos) << r.out;
}

TEST(RunDist, ARestartedGroupRendezvousesAgainOnTheSameStore) {
  // Rank 1 fails after attempt 0's all_reduce; attempt 1 meets on the store that still holds
  // attempt 0's keys.
  ProcResult r = run_process(
      {kTandem, "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", kDistProbe, "shm", "1"},
      launcher_env(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.err.find("exit code 3 on attempt 0"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("[rank0]: allreduce ok attempt=1 world=2 sum=3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]: allreduce ok attempt=1 world=2 sum=3"), std::string::npos) << r.out;
}

TEST(RunDist, ARankKilledDuringAllReduceLoopIsNamedAndTheJobFails) {
  ProcResult r = run_process(
      {kTandem, "run", "--standalone", "--nproc-per-node", "3", kDistProbe, "shm", "1", "kill"}, launcher_env(), 60);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.seconds, 15.0);
  EXPECT_NE(r.err.find("rank 1 (local rank 1 on node 0"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("failed with signal 9 (SIGKILL)"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tandem::testing
