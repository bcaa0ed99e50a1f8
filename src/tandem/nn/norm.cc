#include "tandem/nn/norm.h"

#include "tandem/autograd/grad_mode.h"
#include "tandem/ops/norm.h"

namespace tandem::nn {

BatchNorm::BatchNorm(int64_t n, int64_t expected_dims, const BatchNormOptions& o, std::string type_name)
    : Module(std::move(type_name)), num_features(n), options(o), expected_dims_(expected_dims) {
  TANDEM_CHECK(n > 0, ValueError, "{}: num_features must be positive, got {}", this->type_name(), n);
  TANDEM_CHECK(expected_dims == 0 || expected_dims == 2 || expected_dims == 4 || expected_dims == 5, ValueError,
               "{}: expected input dims must be 0 (any (N, C, *)), 2 ((N, C) or (N, C, L)), 4 or 5, got {}",
               this->type_name(), expected_dims);
  if (o.affine) {
    weight = register_parameter("weight", ones({n}));
    bias = register_parameter("bias", zeros({n}));
  }
  if (o.track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({n}));
    running_var = register_buffer("running_var", ones({n}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, kInt64));
  }
}

Tensor BatchNorm::forward(const Tensor& x) { return forward_impl(x, false); }

Tensor BatchNorm::forward_relu(const Tensor& x) { return forward_impl(x, true); }

Tensor BatchNorm::forward_impl(const Tensor& x, bool relu) {
  const bool ok = expected_dims_ == 0   ? x.dim() >= 2
                  : expected_dims_ == 2 ? x.dim() == 2 || x.dim() == 3
                                        : x.dim() == expected_dims_;
  TANDEM_CHECK(ok, ShapeError, "{}: expected {} input, got shape {}", type_name(),
               expected_dims_ == 0   ? "an (N, C, *)"
               : expected_dims_ == 2 ? "2-d (N, C) or 3-d (N, C, L)"
               : expected_dims_ == 4 ? "4-d (N, C, H, W)"
                                     : "5-d (N, C, D, H, W)",
               shape_str(x.shape()));
  TANDEM_CHECK(x.size(1) == num_features, ShapeError, "{}: expected {} channels, got input of shape {}", type_name(),
               num_features, shape_str(x.shape()));
  const bool use_batch_stats = is_training() || !options.track_running_stats;
  const bool update = is_training() && options.track_running_stats;
  if (update) {
    NoGradGuard no_grad;
    *num_batches_tracked.data_ptr<int64_t>() += 1;
  }
  if (is_training() && group_stats) {
    return ops::batch_norm_over_group(x, update ? running_mean : Tensor(), update ? running_var : Tensor(), weight, bias,
                                      update ? running_average_factor() : 0.0, options.eps, relu, group_stats);
  }
  return (relu ? ops::batch_norm_relu : ops::batch_norm)(x, update || !use_batch_stats ? running_mean : Tensor(),
                         update || !use_batch_stats ? running_var : Tensor(), weight, bias, use_batch_stats,
                         update ? running_average_factor() : 0.0, options.eps);
}

double BatchNorm::running_average_factor() const {
  if (options.momentum) return *options.momentum;
  return 1.0 / static_cast<double>(*num_batches_tracked.data_ptr<int64_t>());
}

std::string BatchNorm::extra_repr() const {
  return fmt::format("{}, eps={}, momentum={}, affine={}, track_running_stats={}", num_features, options.eps,
                     options.momentum ? fmt::format("{}", *options.momentum) : "None", options.affine ? "True" : "False",
                     options.track_running_stats ? "True" : "False");
}

LayerNorm::LayerNorm(Shape shape, double e, bool affine, bool with_bias)
    : Module("LayerNorm"), normalized_shape(std::move(shape)), eps(e) {
  if (affine) {
    weight = register_parameter("weight", ones(normalized_shape));
    if (with_bias) bias = register_parameter("bias", zeros(normalized_shape));
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return ops::layer_norm(x, normalized_shape, weight, bias, eps); }

std::string LayerNorm::extra_repr() const {
  // PyTorch prints normalized_shape as a tuple: "(256,), eps=1e-05, elementwise_affine=True".
  std::string shape = "(";
  for (size_t i = 0; i < normalized_shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(normalized_shape[i]);
  shape += normalized_shape.size() == 1 ? ",)" : ")";
  return fmt::format("{}, eps={}, elementwise_affine={}", shape, eps, weight.defined() ? "True" : "False");
}

GroupNorm::GroupNorm(int64_t g, int64_t c, double e, bool affine)
    : Module("GroupNorm"), num_groups(g), num_channels(c), eps(e) {
  TANDEM_CHECK(g >= 1 && c % g == 0, ValueError, "GroupNorm: num_groups={} must divide num_channels={}", g, c);
  if (affine) {
    weight = register_parameter("weight", ones({c}));
    bias = register_parameter("bias", zeros({c}));
  }
}

Tensor GroupNorm::forward(const Tensor& x) { return ops::group_norm(x, num_groups, weight, bias, eps); }

std::string GroupNorm::extra_repr() const {
  return fmt::format("{}, {}, eps={}, affine={}", num_groups, num_channels, eps, weight.defined() ? "True" : "False");
}

}  // namespace tandem::nn
