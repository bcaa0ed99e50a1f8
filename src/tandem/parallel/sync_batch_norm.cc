// SyncBatchNorm's forward and backward (see sync_batch_norm.h).
#include "tandem/parallel/sync_batch_norm.h"

#include <cmath>
#include <vector>

#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/core/error.h"

namespace tandem::parallel {
namespace {

// x as contiguous f32 (N, C, S) data, plus the sizes.
struct Planar {
  Tensor data;  // f32, contiguous, x's shape
  int64_t N, C, S;
};

Planar planar(const Tensor& x) {
  NoGradGuard no_grad;
  Planar p{x.detach().to(kFloat32).contiguous(), x.size(0), x.size(1), 0};
  p.S = x.numel() / std::max<int64_t>(1, p.N * p.C);
  return p;
}

}  // namespace

Tensor sync_batch_norm(const Tensor& x, nn::BatchNorm& bn, std::shared_ptr<dist::ProcessGroup> group) {
  TANDEM_CHECK(group != nullptr, ValueError, "SyncBatchNorm: process group is null");
  const Planar p = planar(x);
  const int64_t N = p.N, C = p.C, S = p.S;
  const float* xd = p.data.data_ptr<float>();

  // ---- local (count, mean, M2) per channel, two passes in f64 ----
  const int64_t W = group->size();
  Tensor mine = zeros({3 * C}, kFloat64);
  double* m = mine.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float* row = xd + (n * C + c) * S;
      for (int64_t s = 0; s < S; ++s) sum += row[s];
    }
    const double count = static_cast<double>(N * S);
    const double mean = count > 0 ? sum / count : 0.0;
    double m2 = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float* row = xd + (n * C + c) * S;
      for (int64_t s = 0; s < S; ++s) m2 += (row[s] - mean) * (row[s] - mean);
    }
    m[c] = count;
    m[C + c] = mean;
    m[2 * C + c] = m2;
  }
  Tensor all = empty({W * 3 * C}, kFloat64);
  group->all_gather(dist::as_buffer(all), dist::as_buffer(mine))->wait();

  // ---- combine in rank order (the same numbers in the same order on every rank) ----
  std::vector<double> mean(C, 0.0), var(C, 0.0), count(C, 0.0);
  const double* a = all.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    double n_tot = 0, mu = 0, m2 = 0;
    for (int64_t r = 0; r < W; ++r) {
      const double n_r = a[r * 3 * C + c], mu_r = a[r * 3 * C + C + c], m2_r = a[r * 3 * C + 2 * C + c];
      if (n_r == 0) continue;
      const double n_new = n_tot + n_r, delta = mu_r - mu;
      mu += delta * n_r / n_new;
      m2 += m2_r + delta * delta * n_tot * n_r / n_new;
      n_tot = n_new;
    }
    TANDEM_CHECK(n_tot > 1, ValueError,
                 "SyncBatchNorm: expected more than 1 value per channel when training over the group, got {} "
                 "(input shape {} on rank {})",
                 n_tot, shape_str(x.shape()), group->rank());
    mean[c] = mu;
    var[c] = m2 / n_tot;
    count[c] = n_tot;
  }

  // ---- running stats (identical on every rank) ----
  if (bn.options.track_running_stats) {
    NoGradGuard no_grad;
    *bn.num_batches_tracked.data_ptr<int64_t>() += 1;
    const double mom = bn.running_average_factor();  // after counting this batch, as BatchNorm
    Tensor rm32 = bn.running_mean.to(kFloat64).contiguous(), rv32 = bn.running_var.to(kFloat64).contiguous();
    double* rm = rm32.data_ptr<double>();
    double* rv = rv32.data_ptr<double>();
    for (int64_t c = 0; c < C; ++c) {
      rm[c] = (1 - mom) * rm[c] + mom * mean[c];
      rv[c] = (1 - mom) * rv[c] + mom * var[c] * count[c] / (count[c] - 1);
    }
    bn.running_mean.copy_(rm32);
    bn.running_var.copy_(rv32);
  }

  // ---- normalize ----
  std::vector<double> invstd(C);
  for (int64_t c = 0; c < C; ++c) invstd[c] = 1.0 / std::sqrt(var[c] + bn.options.eps);
  const bool affine = bn.weight.defined();
  Tensor w32 = affine ? bn.weight.detach().to(kFloat32).contiguous() : Tensor();
  Tensor b32 = affine ? bn.bias.detach().to(kFloat32).contiguous() : Tensor();
  Tensor y32 = empty(x.shape(), kFloat32);
  float* yd = y32.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const double scale = invstd[c] * (affine ? w32.data_ptr<float>()[c] : 1.0);
      const double shift = (affine ? b32.data_ptr<float>()[c] : 0.0) - mean[c] * scale;
      const float* row = xd + (n * C + c) * S;
      float* out = yd + (n * C + c) * S;
      for (int64_t s = 0; s < S; ++s) out[s] = static_cast<float>(row[s] * scale + shift);
    }
  }
  Tensor y = x.dtype() == kFloat32 ? y32 : y32.to(x.dtype());

  std::vector<Tensor> inputs{x};
  if (affine) {
    inputs.push_back(bn.weight);
    inputs.push_back(bn.bias);
  }
  Tensor saved_x = p.data;
  const DType x_dtype = x.dtype();
  const DType w_dtype = affine ? bn.weight.dtype() : kFloat32;
  autograd::record("SyncBatchNormBackward", inputs, {y},
                   [saved_x, mean, invstd, count, w32, group, affine, x_dtype, w_dtype, N, C, S](const std::vector<Tensor>& grads) {
                     NoGradGuard no_grad;
                     Tensor dy = grads[0].to(kFloat32).contiguous();
                     const float* g = dy.data_ptr<float>();
                     const float* xv = saved_x.data_ptr<float>();
                     // Local sums, then their sum over the group.
                     Tensor sums = zeros({2 * C}, kFloat64);
                     double* sd = sums.data_ptr<double>();
                     for (int64_t n = 0; n < N; ++n) {
                       for (int64_t c = 0; c < C; ++c) {
                         const float* gr = g + (n * C + c) * S;
                         const float* xr = xv + (n * C + c) * S;
                         double s1 = 0, s2 = 0;
                         for (int64_t s = 0; s < S; ++s) {
                           s1 += gr[s];
                           s2 += gr[s] * (xr[s] - mean[c]);
                         }
                         sd[c] += s1;
                         sd[C + c] += s2;
                       }
                     }
                     Tensor local = sums.clone();
                     group->all_reduce(sums, dist::ReduceOp::SUM)->wait();
                     const double* ld = local.data_ptr<double>();
                     Tensor dx32 = empty(saved_x.shape(), kFloat32);
                     float* dxd = dx32.data_ptr<float>();
                     for (int64_t c = 0; c < C; ++c) {
                       const double w = affine ? w32.data_ptr<float>()[c] : 1.0;
                       const double mean_dy = sd[c] / count[c];
                       const double mean_dy_xmu = sd[C + c] / count[c];
                       const double k = invstd[c] * invstd[c] * mean_dy_xmu;
                       for (int64_t n = 0; n < N; ++n) {
                         const float* gr = g + (n * C + c) * S;
                         const float* xr = xv + (n * C + c) * S;
                         float* out = dxd + (n * C + c) * S;
                         for (int64_t s = 0; s < S; ++s) {
                           out[s] = static_cast<float>((gr[s] - mean_dy - (xr[s] - mean[c]) * k) * invstd[c] * w);
                         }
                       }
                     }
                     std::vector<Tensor> out{x_dtype == kFloat32 ? dx32 : dx32.to(x_dtype)};
                     if (affine) {
                       // Parameter gradients from the local batch: DDP averages them over ranks.
                       Tensor dw = empty({C}, kFloat32), db = empty({C}, kFloat32);
                       for (int64_t c = 0; c < C; ++c) {
                         dw.data_ptr<float>()[c] = static_cast<float>(ld[C + c] * invstd[c]);
                         db.data_ptr<float>()[c] = static_cast<float>(ld[c]);
                       }
                       out.push_back(w_dtype == kFloat32 ? dw : dw.to(w_dtype));
                       out.push_back(w_dtype == kFloat32 ? db : db.to(w_dtype));
                     }
                     return out;
                   });
  return y;
}

SyncBatchNorm::SyncBatchNorm(int64_t num_features, std::shared_ptr<dist::ProcessGroup> group,
                             const nn::BatchNormOptions& options, int64_t dims)
    : nn::BatchNorm(num_features, dims, options, "SyncBatchNorm") {
  TANDEM_CHECK(group != nullptr, ValueError, "SyncBatchNorm: process group is null");
  training_forward = [group](nn::BatchNorm& bn, const Tensor& x) { return sync_batch_norm(x, bn, group); };
}

int64_t convert_sync_batchnorm(nn::Module& module, std::shared_ptr<dist::ProcessGroup> group) {
  TANDEM_CHECK(group != nullptr, ValueError, "convert_sync_batchnorm: process group is null");
  int64_t converted = 0;
  for (auto& [name, m] : module.named_modules()) {
    if (auto* bn = dynamic_cast<nn::BatchNorm*>(m.get())) {
      bn->training_forward = [group](nn::BatchNorm& b, const Tensor& x) { return sync_batch_norm(x, b, group); };
      ++converted;
    }
  }
  return converted;
}

}  // namespace tandem::parallel
