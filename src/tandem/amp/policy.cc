// The precision policy table: the one place that decides which dtype each op computes in under
// autocast. Categories follow PyTorch's CUDA autocast lists (DESIGN.md: reductions, softmax,
// normalisation and losses in f32); see tests/oracle/amp_policy_oracle.py for how it compares
// with torch's CPU autocast. Not in the table, on purpose: batch_norm (its kernel computes the
// statistics in f32 from any input dtype and updates f32 running stats in place; PyTorch's CUDA
// and CPU lists leave it out too) and elementwise add/sub/mul/div (they promote by themselves).
#include "tandem/amp/policy.h"

namespace tandem::amp {

const std::vector<PolicyEntry>& policy_table() {
  using P = CastPolicy;
  static const std::vector<PolicyEntry> table = {
      {Op::matmul, "matmul", P::lower_precision},
      {Op::linear, "linear", P::lower_precision},
      {Op::conv2d, "conv2d", P::lower_precision},
      {Op::scaled_dot_product_attention, "scaled_dot_product_attention", P::lower_precision},
      {Op::softmax, "softmax", P::fp32},
      {Op::log_softmax, "log_softmax", P::fp32},
      {Op::cross_entropy, "cross_entropy", P::fp32},
      {Op::nll_loss, "nll_loss", P::fp32},
      {Op::mse_loss, "mse_loss", P::fp32},
      {Op::layer_norm, "layer_norm", P::fp32},
      {Op::group_norm, "group_norm", P::fp32},
      {Op::sum, "sum", P::fp32},
      {Op::mean, "mean", P::fp32},
      {Op::exp, "exp", P::fp32},
      {Op::log, "log", P::fp32},
      {Op::pow, "pow", P::fp32},
      {Op::cat, "cat", P::promote},
      {Op::stack, "stack", P::promote},
      {Op::where, "where", P::promote},
  };
  return table;
}

CastPolicy policy_of(Op op) { return policy_table()[static_cast<size_t>(op)].policy; }
std::string_view op_name(Op op) { return policy_table()[static_cast<size_t>(op)].name; }

std::string_view policy_name(CastPolicy p) {
  switch (p) {
    case CastPolicy::lower_precision: return "lower_precision";
    case CastPolicy::fp32: return "fp32";
    case CastPolicy::promote: return "promote";
  }
  return "?";
}

}  // namespace tandem::amp
