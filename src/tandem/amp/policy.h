// The precision policy: ONE table saying, for every op autocast knows, whether it computes in
// the autocast dtype, in f32, or in the widest of its inputs' dtypes; and the op-entry hook
// that applies it. Invariant: ops never test autocast dtypes themselves; they call
// autocast_call() when autocast_active(), and kernels only implement dtypes.
#pragma once

#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/amp/autocast.h"

namespace tandem::amp {

// PyTorch's autocast categories.
enum class CastPolicy : uint8_t {
  lower_precision,  // cast floating inputs to the autocast dtype (bf16/f16); f32 accumulation inside
  fp32,             // cast floating inputs to f32 (reductions, softmax, norms, losses)
  promote,          // cast floating inputs to the widest floating dtype among them
};

// Every op with an autocast entry. The order is the table's order (policy.cc).
enum class Op : uint8_t {
  matmul, linear, conv2d, scaled_dot_product_attention,                           // lower precision
  softmax, log_softmax, cross_entropy, nll_loss, mse_loss, layer_norm, group_norm,  // f32
  sum, mean, exp, log, pow,                                                       // f32
  cat, stack, where,                                                              // promote
  kCount
};

struct PolicyEntry {
  Op op;
  std::string_view name;  // PyTorch's function name (torch.nn.functional / torch)
  CastPolicy policy;
};

// The whole table, in Op order.
const std::vector<PolicyEntry>& policy_table();
CastPolicy policy_of(Op op);
std::string_view op_name(Op op);
std::string_view policy_name(CastPolicy p);  // "lower_precision", "fp32", "promote"

namespace detail {

// Only floating tensors other than f64 take part in autocast (PyTorch's "eligible" tensors).
inline bool eligible(const Tensor& t) {
  return t.defined() && (t.dtype() == kFloat32 || t.dtype() == kFloat16 || t.dtype() == kBFloat16);
}

// Widest eligible dtype among the arguments (for promote ops).
struct Widest {
  std::optional<DType> dtype;
  void add(const Tensor& t) {
    if (!eligible(t)) return;
    dtype = dtype ? promote_types(*dtype, t.dtype()) : t.dtype();
  }
};
inline void gather(Widest& w, const Tensor& t) { w.add(t); }
inline void gather(Widest& w, const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts) w.add(t);
}
template <class T>
  requires(!std::is_same_v<std::decay_t<T>, Tensor> && !std::is_same_v<std::decay_t<T>, std::vector<Tensor>>)
void gather(Widest&, const T&) {}

inline Tensor cast_arg(const Tensor& t, DType to) { return eligible(t) && t.dtype() != to ? cached_cast(t, to) : t; }
inline std::vector<Tensor> cast_arg(const std::vector<Tensor>& ts, DType to) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(cast_arg(t, to));
  return out;
}
template <class T>
  requires(!std::is_same_v<std::decay_t<T>, Tensor> && !std::is_same_v<std::decay_t<T>, std::vector<Tensor>>)
const T& cast_arg(const T& x, DType) {
  return x;
}

}  // namespace detail

// The dtype `op` computes in for these arguments under the current autocast state; nullopt when
// nothing is cast (no eligible input).
template <class... Args>
std::optional<DType> target_dtype(Op op, const Args&... args) {
  detail::Widest w;
  (detail::gather(w, args), ...);
  if (!w.dtype) return std::nullopt;
  switch (policy_of(op)) {
    case CastPolicy::lower_precision: return get_autocast_dtype();
    case CastPolicy::fp32: return kFloat32;
    case CastPolicy::promote: return w.dtype;
  }
  return std::nullopt;
}

// The op-entry hook. Casts the tensor arguments as the table says for `op`, then calls `body`
// (the op itself) with autocast suspended, so that the op's own plain code runs on the cast
// inputs and ops it calls internally are not cast again. Non-tensor arguments pass through.
// Usage at the top of an op:
//   if (amp::autocast_active()) return amp::autocast_call(amp::Op::linear, linear, x, w, b);
template <class F, class... Args>
decltype(auto) autocast_call(Op op, F&& body, const Args&... args) {
  const std::optional<DType> to = target_dtype(op, args...);
  AutocastSuspend suspend;
  if (!to) return body(args...);
  return body(detail::cast_arg(args, *to)...);
}

}  // namespace tandem::amp
