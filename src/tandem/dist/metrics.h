// Metric helpers for training loops: the mean of a scalar over a group, and logging from rank 0
// only. Both are cheap conveniences over ProcessGroup; all_reduce_mean is a collective (every rank
// must call it), print_rank0 is not.
#pragma once

#include <string>

#include "tandem/dist/process_group.h"

namespace tandem::dist {

// The mean over the group's ranks of `value` (summed in f64).
double all_reduce_mean(double value, ProcessGroup& group);
// Same for a one-element tensor of any dtype (e.g. the loss); throws ValueError otherwise.
double all_reduce_mean(const Tensor& scalar, ProcessGroup& group);

// Whether this process is rank 0 of the default group (true without one: a single process).
bool is_main_process();
// Writes `line` (and a newline) to stdout on rank 0 of the default group only.
void print_rank0(const std::string& line);

}  // namespace tandem::dist
