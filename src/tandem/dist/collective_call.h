// What a collective is, as every rank must agree on it: the op, dtype, element count, root and
// reduce op, in 16 bytes. Backends whose transport has no way of its own to compare the ranks'
// calls (gloo, mpi) exchange these before each collective (a fixed-size all_gather, which cannot
// mismatch) and stop every rank with the same error when they differ: otherwise counts that
// differ abort the process inside gloo (std::terminate) or truncate in MPI, and a dtype or reduce
// op that differs at the same byte count reduces garbage without a word. shm compares its own
// descriptors. TANDEM_COLLECTIVE_CHECK=0 in rank 0's environment turns the exchange off for the
// group (one small all_gather per collective less).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/core/dtype.h"
#include "tandem/dist/process_group.h"

namespace tandem::dist {

enum class CallOp : uint8_t {
  all_reduce, reduce, broadcast, all_gather, reduce_scatter, gather, scatter, all_to_all, barrier
};

struct CollectiveCall {
  CallOp op = CallOp::barrier;
  DType dtype = DType::f32;
  ReduceOp redop = ReduceOp::SUM;
  uint8_t pad = 0;
  int32_t root = 0;
  int64_t count = 0;  // the count every rank passes (gather: input, scatter: output, ...)

  bool has_root() const {
    return op == CallOp::reduce || op == CallOp::broadcast || op == CallOp::gather || op == CallOp::scatter;
  }
  bool has_redop() const {
    return op == CallOp::all_reduce || op == CallOp::reduce || op == CallOp::reduce_scatter;
  }
  bool same_as(const CollectiveCall& o) const {
    return op == o.op && (op == CallOp::barrier || (dtype == o.dtype && count == o.count)) &&
           (!has_root() || root == o.root) && (!has_redop() || redop == o.redop);
  }
  std::string str() const {
    static const char* const names[] = {"all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                                        "gather", "scatter", "all_to_all", "barrier"};
    const auto i = static_cast<size_t>(op);
    std::string s = i < std::size(names) ? names[i] : "unknown collective";
    if (op == CallOp::barrier) return s;
    s += fmt::format(" ({}, {}", dtype_name(dtype), count);
    if (has_root()) s += fmt::format(", root {}", root);
    if (has_redop()) s += fmt::format(", {}", reduce_op_name(redop));
    return s + ")";
  }
};
static_assert(sizeof(CollectiveCall) == 16);

// The error for the first rank whose call differs from rank 0's (calls: one per rank, as every
// rank gathered them, so every rank finds the same), or "" when all agree.
inline std::string call_mismatch(const std::vector<CollectiveCall>& calls, int64_t seq) {
  for (size_t r = 1; r < calls.size(); ++r) {
    if (!calls[r].same_as(calls[0])) {
      return fmt::format(
          "collective mismatch at #{}: rank {} called {} while rank 0 called {}; every rank must issue the same "
          "collectives in the same order with the same dtype, count and root",
          seq, r, calls[r].str(), calls[0].str());
    }
  }
  return {};
}

// Whether this process's environment leaves the exchange on (rank 0's decides for a group).
inline bool collective_check_wanted() {
  const char* v = std::getenv("TANDEM_COLLECTIVE_CHECK");
  return v == nullptr || std::string(v) != "0";
}

}  // namespace tandem::dist
