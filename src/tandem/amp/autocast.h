// Autocast: the thread-local switch that makes ops compute in bf16/f16 where the precision
// policy (amp/policy.h) says so, and the weight cast cache that casts each f32 parameter once per
// outermost autocast region. Invariant: when no autocast guard is enabled on this thread, the
// op-entry check is one thread_local bool load and nothing else happens.
#pragma once

#include <cstdint>
#include <string>

#include "tandem/core/dtype.h"
#include "tandem/core/storage.h"
#include "tandem/core/tensor.h"

namespace tandem::amp {

namespace detail {
// True while an enabled autocast guard is in scope and no op is already being re-dispatched by
// the policy hook (so ops called from inside an autocast op run as plain ops, as in PyTorch).
inline thread_local bool tls_autocast_active = false;
}  // namespace detail

// The op-entry check: cheap enough for every op call.
inline bool autocast_active() noexcept { return detail::tls_autocast_active; }

struct AutocastOptions {
  Device device = kCPU;       // cpu (cuda once a CUDA device layer exists; other devices throw)
  DType dtype = kBFloat16;    // the lower-precision dtype: bf16 or f16
  bool enabled = true;        // false: f32 again inside an enclosing autocast region
  bool cache_enabled = true;  // cast each f32 leaf parameter once per outermost region
};

// torch.autocast as an RAII guard: in its scope, ops in the policy table run in `dtype` (matmul,
// linear, conv, attention), f32 (softmax, norms, reductions, losses) or the widest input dtype
// (cat, stack, where). Nestable; an inner guard with enabled = false turns autocast off for its
// scope; the previous state comes back on exit. Thread-local: other threads are unaffected.
// The cast cache is freed when the outermost guard exits. Throws DTypeError for a dtype other
// than bf16/f16 and ValueError for a non-cpu device. Backward runs in the dtypes its forward ops
// chose; PyTorch recommends calling it outside the region, and for the ops in the table a
// backward inside gives the same gradients (tests/amp: BackwardInsideTheRegionEqualsOutside).
class autocast {
 public:
  explicit autocast(const AutocastOptions& options = {});
  explicit autocast(DType dtype) : autocast(AutocastOptions{.dtype = dtype}) {}
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
  bool prev_cache_enabled_;
};
using Autocast = autocast;  // the DESIGN sketch's spelling

// Whether an autocast guard is enabled on this thread (regardless of re-dispatch), and its dtype.
bool is_autocast_enabled();
DType get_autocast_dtype();
bool is_autocast_cache_enabled();

// Inside its scope the policy hook does nothing (used while an autocast op runs its plain body,
// and by code that must see exact dtypes, e.g. optimizer steps). Nestable.
class AutocastSuspend {
 public:
  AutocastSuspend() noexcept;
  ~AutocastSuspend();
  AutocastSuspend(const AutocastSuspend&) = delete;
  AutocastSuspend& operator=(const AutocastSuspend&) = delete;
};

// Casts `t` to `dtype` for an autocast op (differentiable: the gradient flows back to `t` in
// its own dtype). An f32 leaf that requires grad, cast to the autocast dtype with grad mode on
// and the cache enabled, is cast once per outermost region and the cast reused.
Tensor cached_cast(const Tensor& t, DType dtype);

// Per-thread counters of the casts autocast made (for tests and diagnostics).
struct CastStats {
  int64_t casts = 0;        // conversions actually run
  int64_t cache_hits = 0;   // parameter casts served from the cache
  int64_t cache_size = 0;   // entries in the cache now
};
CastStats cast_stats();
void reset_cast_stats();

// precision "auto": bf16 where the CPU has avx512_bf16 or AMX-BF16, else f16 (which then needs a
// GradScaler). Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16", "auto";
// anything else throws ValueError naming the value.
DType auto_precision();
DType parse_precision(const std::string& name);
// Whether training in `dtype` needs loss scaling (f16 only).
inline bool needs_grad_scaler(DType dtype) { return dtype == kFloat16; }

}  // namespace tandem::amp
