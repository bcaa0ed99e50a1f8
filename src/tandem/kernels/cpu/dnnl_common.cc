#include "tandem/kernels/cpu/dnnl_common.h"
#include "tandem/kernels/cpu/kernel_timing.h"

#include <omp.h>

#include <atomic>

#include "tandem/core/error.h"
#include "tandem/core/parallel.h"

namespace tandem::kernels {

dnnl::engine& dnnl_engine() {
  static dnnl::engine* e = new dnnl::engine(dnnl::engine::kind::cpu, 0);  // leaked: used in teardown
  return *e;
}

dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream s(dnnl_engine());
  return s;
}

dnnl::memory::data_type dnnl_type(DType t, const char* op) {
  switch (t) {
    case DType::f32: return dnnl::memory::data_type::f32;
    case DType::bf16: return dnnl::memory::data_type::bf16;
    case DType::f16: return dnnl::memory::data_type::f16;
    default: throw DTypeError(fmt::format("{}: oneDNN has no path for {}", op, dtype_name(t)));
  }
}

void dnnl_sync_threads() {
  const int threads = get_num_threads();
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
}

}  // namespace tandem::kernels

namespace tandem::kernels {
namespace {

struct TimingTotals {
  std::atomic<bool> on{false};
  std::atomic<int64_t> calls[2]{};
  std::atomic<int64_t> ns[2]{};
  std::atomic<double> flops[2]{};
};

TimingTotals& timing_totals() {
  static TimingTotals t;
  return t;
}

}  // namespace

void set_kernel_timing(bool on) { timing_totals().on.store(on, std::memory_order_relaxed); }

bool kernel_timing_enabled() { return timing_totals().on.load(std::memory_order_relaxed); }

KernelTime kernel_time(KernelKind kind) {
  const auto& t = timing_totals();
  const int k = static_cast<int>(kind);
  return {t.calls[k].load(), 1e-9 * static_cast<double>(t.ns[k].load()), t.flops[k].load()};
}

void reset_kernel_timing() {
  auto& t = timing_totals();
  for (int k = 0; k < 2; ++k) {
    t.calls[k] = 0;
    t.ns[k] = 0;
    t.flops[k] = 0.0;
  }
}

void KernelTimer::record(KernelKind kind, std::chrono::steady_clock::duration d, double flops) {
  auto& t = timing_totals();
  const int k = static_cast<int>(kind);
  t.calls[k].fetch_add(1, std::memory_order_relaxed);
  t.ns[k].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(), std::memory_order_relaxed);
  double f = t.flops[k].load(std::memory_order_relaxed);
  while (!t.flops[k].compare_exchange_weak(f, f + flops, std::memory_order_relaxed)) {
  }
}

}  // namespace tandem::kernels
