// Small helpers over ProcessGroup for training loops and agreement checks: the mean of a scalar
// over a group, logging from rank 0 only, a string broadcast, a gather of a few integers, and the
// way an error names the ranks that disagree with rank 0. The collectives among them (every rank
// must call them) say so.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

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

// Collective: `mine` on `root`, returned on every rank (length first, then the bytes).
std::string broadcast_string(ProcessGroup& group, const std::string& mine, int root);
// Collective: every rank's `mine` (the same length on every rank): result[r][i] is rank r's i-th.
std::vector<std::vector<int64_t>> all_gather_i64(ProcessGroup& group, const std::vector<int64_t>& mine);
// The ranks r >= 1 whose values in all_gather_i64's result `all` differ from rank 0's in any of
// `columns`, in rank order (every rank computes the same list).
std::vector<int> ranks_unlike_rank0(const std::vector<std::vector<int64_t>>& all, std::initializer_list<size_t> columns);
// Where one rank's list of lines (a model's description, a config) first differs from rank 0's.
struct LinesDifference {
  std::vector<int> ranks;       // the ranks whose list differs from rank 0's; empty: all agree
  size_t line = 0;              // the first line where rank 0's and ranks.front()'s lists part
  std::optional<std::string> at0, at_first;  // that line on each side (nullopt: that list ended)
};
// Collective: compares each list of `lists` (as many lists on every rank) with rank 0's, all in one
// gather of hashes; only a list that differs somewhere costs two broadcasts more (rank 0's and the
// first differing rank's text). Every rank gets the same result, so all can throw the same error.
std::vector<LinesDifference> differences_from_rank0(ProcessGroup& group,
                                                    const std::vector<std::vector<std::string>>& lists);
// "rank 2 differs" / "ranks 1, 3 differ": the subject of an error about ranks that disagree.
std::string ranks_differ(const std::vector<int>& ranks);

}  // namespace tandem::dist
