// Metric helpers (see metrics.h).
#include "tandem/dist/metrics.h"

#include <cstdio>

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

}  // namespace tandem::dist
