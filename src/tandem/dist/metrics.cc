// Metric helpers (see metrics.h).
#include "tandem/dist/metrics.h"

#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace tandem::dist {

double all_reduce_mean(double value, ProcessGroup& group) {
  Tensor t = tensor(std::vector<double>{value}, {1}, kFloat64);
  group.all_reduce(t, ReduceOp::SUM)->wait();
  return t.data_ptr<double>()[0] / group.size();
}

double all_reduce_mean(const Tensor& scalar, ProcessGroup& group) {
  TANDEM_CHECK(scalar.defined() && scalar.numel() == 1, ValueError,
               "all_reduce_mean: expected a one-element tensor, got {}",
               scalar.defined() ? shape_str(scalar.shape()) : std::string("an undefined tensor"));
  return all_reduce_mean(scalar.detach().to(kFloat64).contiguous().data_ptr<double>()[0], group);
}

bool is_main_process() { return !is_initialized() || get_rank() == 0; }

void print_rank0(const std::string& line) {
  if (!is_main_process()) return;
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string broadcast_string(ProcessGroup& group, const std::string& mine, int root) {
  Tensor len = tensor(std::vector<int64_t>{static_cast<int64_t>(mine.size())}, {1});
  group.broadcast(len, root)->wait();
  const int64_t n = len.data_ptr<int64_t>()[0];
  Tensor bytes = zeros({n}, kUInt8);
  if (group.rank() == root && n > 0) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  group.broadcast(bytes, root)->wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

std::vector<std::vector<int64_t>> all_gather_i64(ProcessGroup& group, const std::vector<int64_t>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  Tensor in = tensor(mine, {n});
  Tensor out = empty({n * group.size()}, kInt64);
  group.all_gather(as_buffer(out), as_buffer(in))->wait();
  std::vector<std::vector<int64_t>> result(group.size());
  for (int r = 0; r < group.size(); ++r) {
    result[r].assign(out.data_ptr<int64_t>() + r * n, out.data_ptr<int64_t>() + (r + 1) * n);
  }
  return result;
}

std::string ranks_differ(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? fmt::format("rank {} differs", ranks.front())
                           : fmt::format("ranks {} differ", fmt::join(ranks, ", "));
}

}  // namespace tandem::dist
