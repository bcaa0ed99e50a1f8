// The intra-op thread pool. One pool per process; ops split large loops across it with
// parallel_for. oneDNN's OpenMP runtime is given the same thread count.
// Default: TANDEM_NUM_THREADS, else hardware cores / LOCAL_WORLD_SIZE (one core per rank).
#pragma once

#include <cstdint>
#include <functional>

namespace tandem {

// Sets the number of threads intra-op work uses (>= 1). Not to be called from inside a
// parallel_for body.
void set_num_threads(int n);
int get_num_threads();

// Runs fn(begin_i, end_i) over disjoint chunks covering [begin, end), each of at least `grain`
// iterations (except maybe the last), on up to get_num_threads() threads; blocks until all are
// done. An exception from any chunk is rethrown here. Nested calls run inline.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tandem
