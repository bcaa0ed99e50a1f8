// A backend-agnostic check of a ProcessGroup: every collective x dtype x count against
// closed-form serial references (each rank's input is a known function of (rank, index), so the
// expected output is computed locally, with no communication). Every rank of the group must call
// run_collective_sweep with the same options; the first mismatch throws SweepError naming the
// collective, dtype, count, index, the value got and the value expected.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/dist/process_group.h"

namespace tandem::dist::testing {

class SweepError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct SweepOptions {
  // The dtypes to sweep (bool is only moved, never reduced).
  std::vector<DType> dtypes{DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8, DType::b8};
  // Element counts (per rank block for all_gather/gather/scatter/reduce_scatter/all_to_all).
  // Empty: {0, 1, 1009 (prime), 4 * 37 + 1 = 149 (not divisible by 2, 3 or 4)}.
  std::vector<int64_t> counts;
  // Collectives to run (names below); empty: all of them. Names: all_reduce, broadcast, reduce,
  // all_gather, all_gather_list, reduce_scatter, gather, scatter, all_to_all, barrier, send_recv.
  std::set<std::string> ops;
  // Reduce ops for all_reduce/reduce/reduce_scatter (all_reduce runs all of them; reduce and
  // reduce_scatter run SUM and MAX, which cover the accumulate and select paths).
  std::vector<ReduceOp> reduce_ops{ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN, ReduceOp::PRODUCT};
  // The backend keeps f16/bf16 partial sums in f32 and rounds once: sums must then lie within
  // 1 ulp of the f64 sum of the inputs. Otherwise (pairwise 16-bit rounding) within (n-1) ulp.
  bool reduced_float_one_rounding = true;
  // Also run a 64 MiB f32 all_reduce (SUM).
  bool large = false;
  // Work::wait limit per collective.
  std::chrono::milliseconds wait_timeout{std::chrono::seconds(60)};
};

// What run_collective_sweep did, for the test's log.
struct SweepReport {
  int64_t collectives = 0;       // collectives issued and checked
  int64_t elements_checked = 0;  // output elements compared
};

// Runs the sweep on `pg`; throws SweepError at the first wrong element (and rethrows a
// collective's own error, prefixed with what was being checked).
SweepReport run_collective_sweep(ProcessGroup& pg, const SweepOptions& options = {});

}  // namespace tandem::dist::testing
