// SyncBatchNorm's forward and backward (see sync_batch_norm.h).
#include "tandem/parallel/sync_batch_norm.h"

#include <algorithm>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/ops/norm.h"

namespace tandem::parallel {

std::shared_ptr<const ops::BatchNormGroupStats> group_batch_stats(std::shared_ptr<dist::ProcessGroup> group) {
  TANDEM_CHECK(group != nullptr, ValueError, "SyncBatchNorm: process group is null");
  auto stats = std::make_shared<ops::BatchNormGroupStats>();
  ops::BatchNormGroupStats& g = *stats;
  // Every rank's (count, mean, biased variance) per channel, gathered and combined in rank order
  // (Chan et al.): the same numbers in the same order on every rank, so the running stats stay
  // identical. The first rank with values is taken as it is, so a group where one rank has them
  // all (world size 1 included) normalises exactly as BatchNorm.
  g.stats = [group](double& count, std::vector<double>& mean, std::vector<double>& var) {
    const int64_t C = static_cast<int64_t>(mean.size()), W = group->size(), row_len = 1 + 2 * C;
    Tensor mine = empty({row_len}, kFloat64);
    double* m = mine.data_ptr<double>();
    m[0] = count;
    std::copy(mean.begin(), mean.end(), m + 1);
    std::copy(var.begin(), var.end(), m + 1 + C);
    Tensor all = empty({W * row_len}, kFloat64);
    group->all_gather(dist::as_buffer(all), dist::as_buffer(mine))->wait();
    const double* a = all.data_ptr<double>();
    double n_tot = 0;
    for (int64_t r = 0; r < W; ++r) n_tot += a[r * row_len];
    // 0: every rank's batch is empty, which batch_norm handles as BatchNorm does an empty batch.
    TANDEM_CHECK(n_tot != 1, ValueError,
                 "SyncBatchNorm: expected more than 1 value per channel when training over the group, got {} "
                 "(rank {}'s batch has {} per channel)",
                 n_tot, group->rank(), count);
    if (n_tot == 0) {
      count = 0;
      return;
    }
    for (int64_t c = 0; c < C; ++c) {
      double n = 0, mu = 0, m2 = 0, v = 0;
      for (int64_t r = 0; r < W; ++r) {
        const double* row = a + r * row_len;
        const double n_r = row[0], mu_r = row[1 + c], var_r = row[1 + C + c];
        if (n_r == 0) continue;
        if (n == 0) {
          n = n_r, mu = mu_r, m2 = var_r * n_r, v = var_r;
          continue;
        }
        const double n_new = n + n_r, delta = mu_r - mu;
        mu += delta * n_r / n_new;
        m2 += var_r * n_r + delta * delta * n * n_r / n_new;
        n = n_new;
        v = m2 / n;
      }
      mean[c] = mu;
      var[c] = v;
    }
    count = n_tot;
  };
  // The two backward sums over the group, in one all-reduce.
  g.grad_sums = [group](std::vector<double>& sum_dy, std::vector<double>& sum_dy_xc) {
    const int64_t C = static_cast<int64_t>(sum_dy.size());
    Tensor sums = empty({2 * C}, kFloat64);
    double* sd = sums.data_ptr<double>();
    std::copy(sum_dy.begin(), sum_dy.end(), sd);
    std::copy(sum_dy_xc.begin(), sum_dy_xc.end(), sd + C);
    group->all_reduce(sums, dist::ReduceOp::SUM)->wait();
    std::copy(sd, sd + C, sum_dy.begin());
    std::copy(sd + C, sd + 2 * C, sum_dy_xc.begin());
  };
  return stats;
}

SyncBatchNorm::SyncBatchNorm(int64_t num_features, std::shared_ptr<dist::ProcessGroup> group,
                             const nn::BatchNormOptions& options, int64_t dims)
    : nn::BatchNorm(num_features, dims, options, "SyncBatchNorm") {
  group_stats = group_batch_stats(std::move(group));
}

int64_t convert_sync_batchnorm(nn::Module& module, std::shared_ptr<dist::ProcessGroup> group) {
  TANDEM_CHECK(group != nullptr, ValueError, "convert_sync_batchnorm: process group is null");
  const auto stats = group_batch_stats(std::move(group));
  int64_t converted = 0;
  for (auto& [name, m] : module.named_modules()) {
    if (auto* bn = dynamic_cast<nn::BatchNorm*>(m.get())) {
      bn->group_stats = stats;
      ++converted;
    }
  }
  return converted;
}

}  // namespace tandem::parallel
