// Factories of the process-group backends, one per file under dist/ (shm_*.cc, mpi_*.cc, ...).
// make_process_group (init.cc) picks one by name. A backend built out (no MPI, no CUDA) still
// links: its factory throws ValueError saying how to build it in.
#pragma once

#include <memory>
#include <string>

#include "tandem/dist/process_group.h"

namespace tandem::dist {

// Our shared-memory ring for one node: every rank on this host; the store carries the segment names.
std::shared_ptr<ProcessGroup> make_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                             ProcessGroupOptions options);
// OpenMPI (TANDEM_WITH_MPI): the ranks of MPI_COMM_WORLD, or a communicator split from it.
std::shared_ptr<ProcessGroup> make_mpi_group(std::shared_ptr<Store> store, int rank, int size,
                                             ProcessGroupOptions options);
// gloo (TANDEM_WITH_GLOO), for comparison.
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options);
// NCCL (TANDEM_WITH_CUDA): CUDA buffers only.
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options);

// Where a pid names one process, with the hostname: this boot of the machine (its boot id) and
// this pid namespace, "<boot id>,<pid namespace>" (one word). Two processes with the same hostname
// and scope can check each other's pid with kill(pid, 0).
std::string pid_scope();

// Whether a backend was compiled in ("shm" always is).
bool backend_available(const std::string& name);

}  // namespace tandem::dist
