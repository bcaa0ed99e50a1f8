// Runs the collective sweep on the mpi backend (ctest: mpirun -np N mpi_sweep) or, with
// `--backend gloo --spawn N`, on the gloo backend over N forked local ranks. Prints "OK" and
// exits 0 when every rank passed; otherwise prints the first error and exits 1.
//
//   mpi:  the world group (no store), then, with a TCPStore whose port rank 0 broadcasts over
//         the world group, a subgroup of the even world ranks (MPI_Comm_create_group path).
//   gloo: rank 0 hosts a TCPStore on a free port; forked children join it.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "collective_sweep.h"
#include "tandem/dist/backends.h"
#include "tandem/dist/tcp_store.h"

namespace {

using namespace tandem;
using namespace tandem::dist;
using tandem::dist::testing::SweepOptions;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

void log_report(const char* what, int rank, const tandem::dist::testing::SweepReport& r) {
  std::printf("[rank %d] %s: %lld collectives, %lld elements checked\n", rank, what, static_cast<long long>(r.collectives),
              static_cast<long long>(r.elements_checked));
  std::fflush(stdout);
}

int run_mpi(bool large) {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", env_int("PMI_RANK", env_int("SLURM_PROCID", 0)));
  const int size = env_int("OMPI_COMM_WORLD_SIZE", env_int("PMI_SIZE", env_int("SLURM_NTASKS", 1)));
  ProcessGroupOptions pgo;
  pgo.timeout = std::chrono::seconds(60);
  auto world = make_mpi_group(nullptr, rank, size, pgo);
  SweepOptions opt;
  opt.large = large;
  log_report("world group", rank, run_collective_sweep(*world, opt));

  // The store path: rank 0 hosts a TCPStore on a free port and broadcasts the port.
  std::unique_ptr<TCPStore> store_owner;
  int32_t port = 0;
  TCPStoreOptions so;
  so.timeout = std::chrono::seconds(60);
  so.wait_for_workers = false;
  so.token = "mpi-sweep";
  if (rank == 0) {
    so.is_master = true;
    store_owner = std::make_unique<TCPStore>("127.0.0.1", 0, so);
    port = store_owner->port();
  }
  world->broadcast(Buffer{&port, 1, DType::i32, kCPU}, 0)->wait();
  std::shared_ptr<Store> store;
  if (rank == 0) {
    store = std::shared_ptr<Store>(store_owner.get(), [](Store*) {});
  } else {
    so.is_master = false;
    store = std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(port), so);
  }
  // A subgroup of the even world ranks, numbered in reverse (group rank 0 = highest even rank).
  const int evens = (size + 1) / 2;
  if (rank % 2 == 0) {
    const int group_rank = evens - 1 - rank / 2;
    auto sub = make_mpi_group(std::make_shared<PrefixStore>("evens", store), group_rank, evens, pgo);
    SweepOptions small;
    small.dtypes = {DType::f32, DType::bf16, DType::i64};
    small.counts = {0, 1, 149};
    log_report("even subgroup", rank, run_collective_sweep(*sub, small));
  }
  world->barrier()->wait();  // rank 0 keeps the store alive until everyone is done with it
  return 0;
}

int run_gloo(int nprocs) {
  TCPStoreOptions so;
  so.timeout = std::chrono::seconds(60);
  so.wait_for_workers = false;
  so.token = "gloo-sweep";
  so.is_master = true;
  auto master = std::make_shared<TCPStore>("127.0.0.1", 0, so);
  const uint16_t port = master->port();
  std::vector<pid_t> children;
  for (int r = 1; r < nprocs; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int rc = 0;
      try {
        TCPStoreOptions co = so;
        co.is_master = false;
        auto store = std::make_shared<TCPStore>("127.0.0.1", port, co);
        ProcessGroupOptions pgo;
        pgo.timeout = std::chrono::seconds(60);
        auto pg = make_gloo_group(store, r, nprocs, pgo);
        SweepOptions opt;
        opt.ops = {"all_reduce", "broadcast", "all_gather", "barrier"};
        log_report("gloo", r, run_collective_sweep(*pg, opt));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] FAILED: %s\n", r, e.what());
        rc = 1;
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    children.push_back(pid);
  }
  int rc = 0;
  try {
    ProcessGroupOptions pgo;
    pgo.timeout = std::chrono::seconds(60);
    auto pg = make_gloo_group(master, 0, nprocs, pgo);
    SweepOptions opt;
    opt.ops = {"all_reduce", "broadcast", "all_gather", "barrier"};
    log_report("gloo", 0, run_collective_sweep(*pg, opt));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank 0] FAILED: %s\n", e.what());
    rc = 1;
  }
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "mpi";
  int spawn = 2;
  bool large = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) backend = argv[++i];
    else if (a == "--spawn" && i + 1 < argc) spawn = std::atoi(argv[++i]);
    else if (a == "--large") large = true;
    else {
      std::fprintf(stderr, "usage: %s [--backend mpi|gloo] [--spawn N (gloo)] [--large]\n", argv[0]);
      return 2;
    }
  }
  try {
    const int rc = backend == "gloo" ? run_gloo(spawn) : run_mpi(large);
    if (rc == 0) std::printf("OK\n");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}
