// tandem env: what this machine and this build offer, for bug reports and for choosing
// --nproc-per-node. Read-only: it changes nothing.
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "tandem/core/cpu_features.h"
#include "tandem/dist/backends.h"
#include "tandem/dist/shm_segment.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tools/commands.h"

namespace tandem::tools {

int env_main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: tandem env\n\nPrints the CPU features, core counts, build options and the process-group "
                  "backends of this build.\n");
      return 0;
    }
    std::fprintf(stderr, "tandem env: unknown argument \"%s\"; it takes none (see `tandem env --help`)\n", argv[i]);
    return 2;
  }
  const CpuFeatures& f = cpu_features();
  cpu_set_t set;
  CPU_ZERO(&set);
  int allowed = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
  auto yes = [](bool b) { return b ? "yes" : "no"; };

  std::printf("tandem %s (%s build, %s)\n", TANDEM_VERSION, TANDEM_BUILD_TYPE, TANDEM_CXX_COMPILER);
  std::printf("\ncpu\n");
  std::printf("  features         %s\n", f.summary().c_str());
  std::printf("  avx512_bf16      %s\n", yes(f.avx512_bf16));
  std::printf("  amx_bf16         %s\n", yes(f.amx_bf16));
  std::printf("  avx512_fp16      %s\n", yes(f.avx512_fp16));
  try {
    const kernels::Bf16Products bp = kernels::bf16_products();
    std::printf("  bf16 products    %s (%s)\n", kernels::bf16_products_name(bp), kernels::bf16_products_reason().c_str());
  } catch (const std::exception& e) {  // an unknown TANDEM_BF16_GEMM
    std::fflush(stdout);
    std::fprintf(stderr, "tandem env: %s\n", e.what());
    return 2;
  }
  std::printf("  cores online     %ld\n", sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("  cores allowed    %d (this process's affinity mask)\n", allowed);
  std::printf("\nbuild options\n");
#ifdef TANDEM_WITH_MPI
  std::printf("  TANDEM_WITH_MPI  ON\n");
#else
  std::printf("  TANDEM_WITH_MPI  OFF\n");
#endif
#ifdef TANDEM_WITH_GLOO
  std::printf("  TANDEM_WITH_GLOO ON\n");
#else
  std::printf("  TANDEM_WITH_GLOO OFF\n");
#endif
#ifdef TANDEM_WITH_CUDA
  std::printf("  TANDEM_WITH_CUDA ON\n");
#else
  std::printf("  TANDEM_WITH_CUDA OFF\n");
#endif
  std::printf("\nprocess-group backends\n");
  for (const char* b : {"shm", "mpi", "gloo", "nccl"})
    std::printf("  %-16s %s\n", b, dist::backend_available(b) ? "available" : "not built");
  // shm's buffers live in /dev/shm: Docker's default of 64 MiB is too small for most models.
  std::printf("  %-16s %s\n", "shared memory", dist::shm::shm_space_summary().c_str());
  std::printf("\nenvironment\n");
  for (const char* v : {"TANDEM_NUM_THREADS", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    const char* value = std::getenv(v);
    std::printf("  %-18s %s\n", v, value != nullptr ? value : "(unset)");
  }
  return 0;
}

}  // namespace tandem::tools
