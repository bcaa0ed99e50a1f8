// A real Tandem worker for the `tandem run` tests: init_process_group("env://") on the launcher's
// hosted store, one all_reduce checked against its closed form, and optionally a failure after
// it (so a restarted group meets a store that still holds the first attempt's keys).
// usage: dist_probe BACKEND [FAIL_RANK_ON_ATTEMPT_0 [kill]]
//   kill: all ranks loop on all_reduce and FAIL_RANK kills itself (SIGKILL) at iteration 20.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tandem/dist/process_group.h"

int main(int argc, char** argv) {
  namespace dist = tandem::dist;
  const int attempt = std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT") ? std::getenv("TORCHELASTIC_RESTART_COUNT") : "0");
  const int fail_rank = argc > 2 ? std::atoi(argv[2]) : -1;
  try {
    dist::InitOptions o;
    o.backend = argc > 1 ? argv[1] : "shm";
    o.timeout = std::chrono::milliseconds(20000);
    auto pg = dist::init_process_group(o);
    const int rank = pg->rank(), world = pg->size();
    // Each rank contributes rank+1 in every element: the sum is world*(world+1)/2, exact in f32.
    float x[5];
    for (float& v : x) v = float(rank + 1);
    pg->all_reduce(dist::Buffer{x, 5, tandem::DType::f32})->wait();
    const float expected = float(world * (world + 1) / 2);
    for (float v : x) {
      if (v != expected) {
        std::fprintf(stderr, "all_reduce gave %g, expected %g\n", double(v), double(expected));
        return 5;
      }
    }
    std::printf("allreduce ok attempt=%d world=%d sum=%g\n", attempt, world, double(expected));
    std::fflush(stdout);
    if (argc > 3 && std::string(argv[3]) == "kill") {
      for (int i = 0; i < 100000; ++i) {
        if (i == 20 && rank == fail_rank) kill(getpid(), SIGKILL);
        pg->all_reduce(dist::Buffer{x, 5, tandem::DType::f32})->wait();
      }
      return 0;
    }
    if (attempt == 0 && rank == fail_rank) return 3;  // fails after the collective: its keys stay behind
    dist::barrier();
    dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_probe: %s\n", e.what());
    return 4;
  }
  return 0;
}
