// Autocast state, guards and the weight cast cache. All state is thread-local.
#include "tandem/amp/autocast.h"

#include <map>
#include <utility>

#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/core/cpu_features.h"

namespace tandem::amp {
namespace {

struct State {
  bool enabled = false;
  DType dtype = kBFloat16;
  bool cache_enabled = true;
  int depth = 0;     // autocast guards alive on this thread (enabled or not)
  int suppress = 0;  // AutocastSuspend guards alive
  CastStats stats;
  // Key: (source TensorImpl, target dtype). The entry holds the source Tensor, so the key's
  // address cannot be reused by another tensor while the entry lives.
  std::map<std::pair<const TensorImpl*, DType>, std::pair<Tensor, Tensor>> cache;
};

thread_local State tls;

void refresh() { detail::tls_autocast_active = tls.enabled && tls.suppress == 0; }

}  // namespace

autocast::autocast(const AutocastOptions& o)
    : prev_enabled_(tls.enabled), prev_dtype_(tls.dtype), prev_cache_enabled_(tls.cache_enabled) {
  TANDEM_CHECK(o.device.type == DeviceType::cpu, ValueError,
               "autocast: device type {} has no autocast support in this build; use the cpu device",
               static_cast<int>(o.device.type));
  TANDEM_CHECK(o.dtype == kBFloat16 || o.dtype == kFloat16, DTypeError,
               "autocast: dtype must be bfloat16 or float16, got {}", dtype_name(o.dtype));
  ++tls.depth;
  tls.enabled = o.enabled;
  tls.dtype = o.dtype;
  tls.cache_enabled = o.cache_enabled;
  refresh();
}

autocast::~autocast() {
  tls.enabled = prev_enabled_;
  tls.dtype = prev_dtype_;
  tls.cache_enabled = prev_cache_enabled_;
  if (--tls.depth == 0) {
    tls.cache.clear();  // the outermost region ends: casts of parameters die with it
    tls.stats.cache_size = 0;
  }
  refresh();
}

bool is_autocast_enabled() { return tls.enabled; }
DType get_autocast_dtype() { return tls.dtype; }
bool is_autocast_cache_enabled() { return tls.cache_enabled; }

AutocastSuspend::AutocastSuspend() noexcept {
  ++tls.suppress;
  refresh();
}
AutocastSuspend::~AutocastSuspend() {
  --tls.suppress;
  refresh();
}

Tensor cached_cast(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  // PyTorch's rule: only f32 leaves that require grad (parameters), cast down to the autocast
  // dtype. Casts made with grad mode off are not cached: they carry no graph, and a later use
  // with grad mode on must get one.
  const bool cacheable = tls.cache_enabled && tls.depth > 0 && dtype == tls.dtype && t.dtype() == kFloat32 &&
                         t.requires_grad() && t.is_leaf() && autograd::is_grad_enabled();
  if (cacheable) {
    auto key = std::make_pair(static_cast<const TensorImpl*>(&t.impl()), dtype);
    if (auto it = tls.cache.find(key); it != tls.cache.end()) {
      // A backward inside the region went through the cast's node and released it (PyTorch's
      // ToCopyBackward saves nothing and runs again): cast anew for this forward.
      const auto& fn = it->second.second.grad_fn();
      if (!fn || !fn->released()) {
        ++tls.stats.cache_hits;
        return it->second.second;
      }
      tls.cache.erase(it);
    }
    Tensor c = t.to(dtype);
    ++tls.stats.casts;
    tls.cache.emplace(key, std::make_pair(t, c));
    tls.stats.cache_size = static_cast<int64_t>(tls.cache.size());
    return c;
  }
  ++tls.stats.casts;
  return t.to(dtype);
}

CastStats cast_stats() { return tls.stats; }
void reset_cast_stats() {
  tls.stats.casts = 0;
  tls.stats.cache_hits = 0;
}

DType auto_precision() {
  const CpuFeatures& f = cpu_features();
  return (f.avx512_bf16 || f.amx_bf16) ? kBFloat16 : kFloat16;
}

DType parse_precision(const std::string& name) {
  if (name == "fp32" || name == "f32" || name == "float32") return kFloat32;
  if (name == "bf16" || name == "bfloat16") return kBFloat16;
  if (name == "fp16" || name == "f16" || name == "float16" || name == "half") return kFloat16;
  if (name == "auto") return auto_precision();
  throw ValueError(fmt::format("precision: unknown value \"{}\" (expected fp32, bf16, f16 or auto)", name));
}

}  // namespace tandem::amp
