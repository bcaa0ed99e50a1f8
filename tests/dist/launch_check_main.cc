// launch_check: one program for every launcher (tandem run, mpirun, torchrun, srun). It joins the
// default group from the environment, checks a few collectives against closed-form values and
// prints one line per rank. Exit 0 when everything matched; otherwise the error and exit 1.
//
//   launch_check [--backend shm|mpi|gloo]
#include <cstdio>
#include <string>

#include "tandem/dist/process_group.h"

namespace td = tandem;

int main(int argc, char** argv) try {
  std::string backend = "shm";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--backend" && i + 1 < argc) backend = argv[++i];
  }
  const td::dist::LaunchEnv env = td::dist::read_launch_env();
  auto group = td::dist::init_process_group({.backend = backend, .timeout = std::chrono::seconds(60)});
  const int r = group->rank(), n = group->size();
  TANDEM_CHECK(r == td::dist::get_rank() && n == td::dist::get_world_size(), td::Error, "default group mismatch");

  // all_reduce: rank r contributes r + 1 in every element; the sum is n(n+1)/2.
  td::Tensor t = td::full({1000}, r + 1.0, td::kFloat32);
  group->all_reduce(t)->wait();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TANDEM_CHECK(t.data_ptr<float>()[i] == n * (n + 1) / 2.0f, td::Error, "all_reduce element {} is {}, expected {}", i,
                 t.data_ptr<float>()[i], n * (n + 1) / 2.0);
  }
  // broadcast from the last rank.
  td::Tensor b = td::full({17}, r == n - 1 ? 42.0 : -1.0, td::kInt64);
  group->broadcast(b, n - 1)->wait();
  TANDEM_CHECK(b.data_ptr<int64_t>()[16] == 42, td::Error, "broadcast gave {}", b.data_ptr<int64_t>()[16]);
  td::dist::barrier();
  std::printf("launch_check: rank %d of %d ok (local rank %d, env from %s, backend %s)\n", r, n, env.local_rank,
              env.source.empty() ? "?" : env.source.c_str(), backend.c_str());
  td::dist::destroy_process_group();
  return 0;
} catch (const std::exception& e) {
  return td::report(e);
}
