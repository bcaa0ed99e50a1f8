// Runs the collective sweep on the mpi backend (ctest: mpirun -np N mpi_sweep) or, with
// `--backend gloo --spawn N`, on the gloo backend over N forked local ranks. Prints "OK" and
// exits 0 when every rank passed; otherwise prints the first error and exits 1. Also:
// --desync (mpirun -np 2: timeout + desync diagnosis), --half-wire-check (mpirun -np 3: the
// 1-ulp check catches pairwise 16-bit rounding), --bench BYTES (all_reduce busbw).
//
//   mpi:  the world group (no store), then, with a TCPStore whose port rank 0 broadcasts over
//         the world group, a subgroup of the even world ranks (MPI_Comm_create_group path).
//   gloo: rank 0 hosts a TCPStore on a free port; forked children join it.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <functional>
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
  // The public path: init_process_group("mpi") on the same store, then new_group of the odd
  // world ranks (every rank calls it; the even ones get null).
  InitOptions io;
  io.backend = "mpi";
  io.store = store;
  io.rank = rank;
  io.world_size = size;
  io.timeout = std::chrono::seconds(60);
  auto pg = init_process_group(io);
  SweepOptions small;
  small.dtypes = {DType::f16, DType::i32};
  small.counts = {1, 149};
  log_report("init_process_group(mpi)", rank, run_collective_sweep(*pg, small));
  std::vector<int> odds;
  for (int r = 1; r < size; r += 2) odds.push_back(r);
  if (!odds.empty()) {
    auto sub = new_group(odds, std::chrono::seconds(60));
    if ((sub != nullptr) != (rank % 2 == 1)) throw std::runtime_error("new_group: membership is wrong");
    if (sub) log_report("new_group(odd ranks)", rank, run_collective_sweep(*sub, small));
  }
  destroy_process_group();
  world->barrier()->wait();  // rank 0 keeps the store alive until everyone is done with it
  return 0;
}

// A TCPStore hosted by rank 0 of `world` (its port handed out over the world group), for the
// desync diagnosis of a group made with it.
std::shared_ptr<TCPStore> store_on_rank0(ProcessGroup& world, const char* token) {
  TCPStoreOptions so;
  so.timeout = std::chrono::seconds(30);
  so.wait_for_workers = false;
  so.token = token;
  so.is_master = world.rank() == 0;
  std::shared_ptr<TCPStore> store;
  int32_t port = 0;
  if (world.rank() == 0) {
    store = std::make_shared<TCPStore>("127.0.0.1", 0, so);
    port = store->port();
  }
  world.broadcast(Buffer{&port, 1, DType::i32, kCPU}, 0)->wait();
  if (world.rank() != 0) store = std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(port), so);
  return store;
}

// Desync: rank 1 skips an all_reduce and enters a barrier instead. Both must fail with Timeout
// within the group's 2 s timeout, and each error must name what the other rank is doing.
int run_desync() {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const int size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  if (size != 2) {
    std::fprintf(stderr, "--desync needs mpirun -np 2\n");
    return 2;
  }
  auto world = make_mpi_group(nullptr, rank, size, {});
  std::shared_ptr<TCPStore> store = store_on_rank0(*world, "mpi-desync");
  ProcessGroupOptions pgo;
  pgo.timeout = std::chrono::seconds(2);
  auto pg = make_mpi_group(store, rank, size, pgo);
  float x[4] = {1, 2, 3, 4};
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    if (rank == 0) pg->all_reduce(Buffer{x, 4, DType::f32, kCPU})->wait();
    else pg->barrier()->wait();
    std::fprintf(stderr, "[rank %d] FAILED: the mismatched collective completed\n", rank);
    return 1;
  } catch (const Timeout& e) {
    message = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[rank %d] after %.1f s: %s\n", rank, waited, message.c_str());
  const std::string mine = rank == 0 ? "all_reduce #0" : "barrier #0";
  const std::string theirs = rank == 0 ? "rank 1 is in barrier #0" : "rank 0 is in all_reduce #0";
  int32_t failed = 0;
  if (message.find(mine) == std::string::npos || message.find(theirs) == std::string::npos || waited > 2 * 2.0 + 5.0) {
    std::fprintf(stderr, "[rank %d] FAILED: the error should name '%s' and '%s' within 9 s\n", rank, mine.c_str(), theirs.c_str());
    failed = 1;
  }
  // The group is unusable now; a new collective fails at once instead of hanging.
  try {
    pg->barrier()->wait(std::chrono::seconds(5));
    std::fprintf(stderr, "[rank %d] FAILED: a collective on the broken group succeeded\n", rank);
    failed = 1;
  } catch (const CommError& e) {
    if (dynamic_cast<const Timeout*>(&e) != nullptr) {
      std::fprintf(stderr, "[rank %d] FAILED: a collective on the broken group hung: %s\n", rank, e.what());
      failed = 1;
    }
  }
  // Both verdicts meet on the (healthy) world group, which also keeps rank 0's store up until
  // rank 1 is done with it. The ranks then exit without MPI_Finalize (a progress thread is still
  // inside the abandoned collective), so mpirun's exit status says nothing: ctest matches the line.
  world->all_reduce(Buffer{&failed, 1, DType::i32, kCPU}, ReduceOp::MAX)->wait(std::chrono::seconds(30));
  std::printf("desync diagnosed on rank %d\n", rank);
  if (rank == 0 && failed == 0) std::printf("desync test passed on every rank\n");
  std::fflush(stdout);
  return failed;
}

// Ranks that disagree on a collective: a dtype that differs at the same byte count used to reduce
// integer bits as floats without a word, counts that differ to end in MPI's truncation error or a
// hang. The calls are exchanged first, and every rank stops with an error naming both.
int run_mismatch() {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const int size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  if (size != 2) {
    std::fprintf(stderr, "--mismatch needs mpirun -np 2\n");
    return 2;
  }
  auto world = make_mpi_group(nullptr, rank, size, {});
  int32_t failed = 0;
  struct Case {
    const char* what;
    std::function<std::shared_ptr<Work>(ProcessGroup&, float*, int32_t*)> call;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"dtype", [&](ProcessGroup& pg, float* f, int32_t* i) {
         return rank == 0 ? pg.all_reduce(Buffer{f, 4, DType::f32, kCPU}) : pg.all_reduce(Buffer{i, 4, DType::i32, kCPU});
       }, "collective mismatch at #0: rank 1 called all_reduce (int32, 4, SUM) while rank 0 called all_reduce (float32, 4, SUM)"},
      {"count", [&](ProcessGroup& pg, float* f, int32_t*) {
         return pg.all_reduce(Buffer{f, rank == 0 ? 10 : 20, DType::f32, kCPU});
       }, "rank 1 called all_reduce (float32, 20, SUM) while rank 0 called all_reduce (float32, 10, SUM)"},
      {"op", [&](ProcessGroup& pg, float* f, int32_t*) {
         return pg.all_reduce(Buffer{f, 4, DType::f32, kCPU}, rank == 0 ? ReduceOp::SUM : ReduceOp::MAX);
       }, "rank 1 called all_reduce (float32, 4, MAX) while rank 0 called all_reduce (float32, 4, SUM)"},
  };
  for (const Case& c : cases) {
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(10);
    auto pg = make_mpi_group(nullptr, rank, size, o);
    std::vector<float> f(32, 1.0f);
    std::vector<int32_t> i(32, 1);
    std::string message = "(no error)";
    try {
      c.call(*pg, f.data(), i.data())->wait();
    } catch (const std::exception& e) {
      message = e.what();
    }
    if (message.find(c.expect) == std::string::npos) {
      std::fprintf(stderr, "[rank %d] FAILED: %s mismatch: %s\n", rank, c.what, message.c_str());
      failed = 1;
    }
  }
  world->all_reduce(Buffer{&failed, 1, DType::i32, kCPU}, ReduceOp::MAX)->wait(std::chrono::seconds(30));
  if (rank == 0 && failed == 0) std::printf("mismatch test passed on every rank\n");
  std::fflush(stdout);
  return failed;
}

// A late rank, not a desync: rank 1 enters all_reduce #0 3 s late under a 2 s timeout. Rank 0's
// watchdog fires at 2 s and spends up to 2 s on its desync diagnosis, during which #0 completes;
// it used to mark the group broken anyway once the diagnosis was over (and fail #0's Work, had it
// not finished), so a later collective failed with "the mpi process group is unusable". Now the
// completed collective stands and the group stays usable.
int run_late_arrival() {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const int size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  if (size != 2) {
    std::fprintf(stderr, "--late-arrival needs mpirun -np 2\n");
    return 2;
  }
  auto world = make_mpi_group(nullptr, rank, size, {});
  std::shared_ptr<TCPStore> store = store_on_rank0(*world, "mpi-late");
  ProcessGroupOptions pgo;
  pgo.timeout = std::chrono::seconds(2);
  auto pg = make_mpi_group(store, rank, size, pgo);
  const auto start = std::chrono::steady_clock::now();
  int32_t failed = 0;
  float x[4] = {1, 2, 3, 4};
  if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  std::string first = "ok";
  try {
    pg->all_reduce(Buffer{x, 4, DType::f32, kCPU})->wait();
  } catch (const std::exception& e) {
    first = e.what();
  }
  std::this_thread::sleep_until(start + std::chrono::milliseconds(5500));
  float y[4] = {1, 2, 3, 4};
  try {
    pg->all_reduce(Buffer{y, 4, DType::f32, kCPU})->wait();
    for (int i = 0; i < 4; ++i) {
      if (y[i] != 2.0f * static_cast<float>(i + 1)) {
        std::fprintf(stderr, "[rank %d] FAILED: all_reduce #1 element %d = %g\n", rank, i, y[i]);
        failed = 1;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] FAILED: all_reduce #1 after a late but completed #0 (%s): %s\n", rank,
                 first.c_str(), e.what());
    failed = 1;
  }
  world->all_reduce(Buffer{&failed, 1, DType::i32, kCPU}, ReduceOp::MAX)->wait(std::chrono::seconds(30));
  if (rank == 0 && failed == 0) std::printf("late-arrival test passed on every rank\n");
  std::fflush(stdout);
  return failed;
}

// The sweep's 1-ulp check must catch 16-bit partial sums: with TANDEM_MPI_HALF_WIRE=1 (pairwise
// rounding through MPI_Op_create ops) a bf16/f16 SUM over 3 ranks fails it, yet stays within the
// (n-1)-ulp bound of a pairwise chain. Exits 0 when both hold.
int run_half_wire_check() {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const int size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  setenv("TANDEM_MPI_HALF_WIRE", "1", 1);
  auto pg = make_mpi_group(nullptr, rank, size, {});
  SweepOptions opt;
  opt.ops = {"all_reduce"};
  opt.reduce_ops = {ReduceOp::SUM};
  opt.dtypes = {DType::bf16, DType::f16};
  opt.counts = {1009};
  std::string caught;
  try {
    run_collective_sweep(*pg, opt);
  } catch (const tandem::dist::testing::SweepError& e) {
    caught = e.what();
  }
  // Every rank gets the same (wrong) values, so every rank's check fails the same way.
  if (caught.find("all_reduce(SUM)") == std::string::npos) {
    std::fprintf(stderr, "[rank %d] FAILED: pairwise 16-bit rounding passed the 1-ulp check (%s)\n", rank, caught.c_str());
    return 1;
  }
  std::printf("[rank %d] pairwise rounding caught: %s\n", rank, caught.c_str());
  opt.reduced_float_one_rounding = false;
  run_collective_sweep(*pg, opt);  // within (n-1) ulp: throws otherwise
  return 0;
}

// all_reduce bus bandwidth (nccl-tests' busbw = algbw * 2(n-1)/n) of `bytes` of f32 or bf16.
void bench(ProcessGroup& pg, int64_t bytes, DType dt, int iters) {
  const int64_t count = bytes / static_cast<int64_t>(element_size(dt));
  auto mem = pg.allocate(static_cast<size_t>(bytes));
  std::memset(mem.get(), 0, static_cast<size_t>(bytes));
  Buffer buf{mem.get(), count, dt, kCPU};
  for (int i = 0; i < 3; ++i) pg.all_reduce(buf)->wait();
  pg.barrier()->wait();
  // Mean and best of `iters` (the best is the figure to trust on a shared, loaded machine).
  double total = 0, best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    pg.all_reduce(buf)->wait();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total += t;
    best = std::min(best, t);
  }
  const double s = total / iters;
  const int n = pg.size();
  const double bus = 2.0 * (n - 1) / n;
  if (pg.rank() == 0) {
    std::printf("%s all_reduce %lld bytes %s x%d ranks: mean %.1f us (busbw %.2f GB/s), best %.1f us (busbw %.2f GB/s)\n",
                pg.backend_name().c_str(), static_cast<long long>(bytes), std::string(dtype_name(dt)).c_str(), n, s * 1e6,
                bytes / s / 1e9 * bus, best * 1e6, bytes / best / 1e9 * bus);
  }
}

int run_gloo(int nprocs, int64_t bench_bytes);

int run_mpi_bench(int64_t bytes) {
  const int rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const int size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  auto world = make_mpi_group(nullptr, rank, size, {});
  bench(*world, bytes, DType::f32, 20);
  bench(*world, bytes, DType::bf16, 20);
  return 0;
}

int run_gloo(int nprocs, int64_t bench_bytes) {
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
        if (bench_bytes > 0) {
          bench(*pg, bench_bytes, DType::f32, 20);
          bench(*pg, bench_bytes, DType::bf16, 20);
        } else {
          SweepOptions opt;
          opt.ops = {"all_reduce", "broadcast", "all_gather", "barrier"};
          log_report("gloo", r, run_collective_sweep(*pg, opt));
        }
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
    if (bench_bytes > 0) {
      bench(*pg, bench_bytes, DType::f32, 20);
      bench(*pg, bench_bytes, DType::bf16, 20);
    } else {
      SweepOptions opt;
      opt.ops = {"all_reduce", "broadcast", "all_gather", "barrier"};
      log_report("gloo", 0, run_collective_sweep(*pg, opt));
    }
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
  bool large = false, desync = false, half_wire = false, late = false, mismatch = false;
  int64_t bench_bytes = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) backend = argv[++i];
    else if (a == "--spawn" && i + 1 < argc) spawn = std::atoi(argv[++i]);
    else if (a == "--large") large = true;
    else if (a == "--desync") desync = true;
    else if (a == "--late-arrival") late = true;
    else if (a == "--mismatch") mismatch = true;
    else if (a == "--half-wire-check") half_wire = true;
    else if (a == "--bench" && i + 1 < argc) bench_bytes = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--backend mpi|gloo] [--spawn N (gloo)] [--large] [--desync (mpi, np 2)] [--late-arrival (mpi, np 2)] [--mismatch (mpi, np 2)] [--half-wire-check (mpi, np 3)] [--bench BYTES]\n", argv[0]);
      return 2;
    }
  }
  try {
    int rc;
    if (backend == "gloo") rc = run_gloo(spawn, bench_bytes);
    else if (desync) rc = run_desync();
    else if (late) rc = run_late_arrival();
    else if (mismatch) rc = run_mismatch();
    else if (half_wire) rc = run_half_wire_check();
    else if (bench_bytes > 0) rc = run_mpi_bench(bench_bytes);
    else rc = run_mpi(large);
    if (rc == 0) std::printf("OK\n");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}
