// Metric helpers (see metrics.h).
#include "tandem/dist/metrics.h"

#include <cstdio>
#include <cstring>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tandem/core/hash.h"

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

std::vector<int> ranks_unlike_rank0(const std::vector<std::vector<int64_t>>& all, std::initializer_list<size_t> columns) {
  std::vector<int> ranks;
  for (size_t r = 1; r < all.size(); ++r) {
    for (size_t k : columns) {
      if (all[r][k] != all[0][k]) {
        ranks.push_back(static_cast<int>(r));
        break;
      }
    }
  }
  return ranks;
}

std::vector<LinesDifference> differences_from_rank0(ProcessGroup& group,
                                                    const std::vector<std::vector<std::string>>& lists) {
  std::vector<std::string> texts;
  std::vector<int64_t> hashes;
  for (const auto& lines : lists) {
    std::string text;
    for (const std::string& l : lines) text += l + "\n";
    hashes.push_back(static_cast<int64_t>(fnv1a(text.data(), text.size())));
    texts.push_back(std::move(text));
  }
  const auto all = all_gather_i64(group, hashes);
  auto split = [](const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  };
  std::vector<LinesDifference> out(lists.size());
  for (size_t k = 0; k < lists.size(); ++k) {
    LinesDifference& d = out[k];
    d.ranks = ranks_unlike_rank0(all, {k});
    if (d.ranks.empty()) continue;
    const auto lines0 = split(broadcast_string(group, texts[k], 0));
    const auto lines_r = split(broadcast_string(group, texts[k], d.ranks.front()));
    while (d.line < lines0.size() && d.line < lines_r.size() && lines0[d.line] == lines_r[d.line]) ++d.line;
    if (d.line < lines0.size()) d.at0 = lines0[d.line];
    if (d.line < lines_r.size()) d.at_first = lines_r[d.line];
  }
  return out;
}

std::string ranks_differ(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? fmt::format("rank {} differs", ranks.front())
                           : fmt::format("ranks {} differ", fmt::join(ranks, ", "));
}

}  // namespace tandem::dist
