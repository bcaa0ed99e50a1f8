// DDP over the mpi backend, run under mpirun (one process per rank, ranks from OpenMPI's or
// Slurm's variables): the acceptance's equivalences that tests/parallel/ddp_test.cc proves over
// shm (and gloo), here through MPI — what a user who hand-rolled MPI all-reduce around LibTorch
// would switch to. W1 (SGD momentum) within rel 1e-5 and W2 with SyncBatchNorm (AdamW) within
// rel 5e-5 (ddp_test explains both bounds) of one process on the global batch after 10 steps.
// Rank 0 prints OK when every rank passed; a failing rank prints FAILED and its reason and exits
// 1 (its peers' next collective then fails within the 60 s timeout instead of hanging).
#include <chrono>
#include <cstdio>
#include <exception>

#include "tandem/dist/backends.h"
#include "parallel/equivalence.h"

int main() {
  namespace td = tandem;
  int rank = 0, size = 1;
  try {
    const td::dist::LaunchEnv env = td::dist::read_launch_env();  // OpenMPI's (or Slurm's) variables
    if (env.rank >= 0) rank = env.rank;
    if (env.world_size > 0) size = env.world_size;
    td::dist::ProcessGroupOptions pgo;
    pgo.timeout = std::chrono::seconds(60);
    auto group = td::dist::make_mpi_group(nullptr, rank, size, pgo);
    td::testing::expect_ddp_equals_global_batch(group, td::testing::w1_mlp(), 8, 10, 1e-5, false);
    td::testing::expect_ddp_equals_global_batch(group, td::testing::w2_cnn(), 4, 10, 5e-5, true);
    group->barrier()->wait();  // every rank got here: all passed
    if (rank == 0) std::printf("OK: DDP over mpi on %d ranks equals the global batch (W1, W2 + SyncBatchNorm)\n", size);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED (rank %d of %d): %s\n", rank, size, e.what());
    return 1;
  }
}
