// Opt-in accounting of the time spent inside oneDNN's compute calls (GEMM and convolution), for
// splitting a training step into "matrix products" and "everything else" (the benches'
// --phases). Off by default; then a timed scope costs one relaxed atomic load. Totals are summed
// over all threads since the last reset (on more than one thread, overlapping calls add up).
#pragma once

#include <chrono>
#include <cstdint>

namespace tandem::kernels {

enum class KernelKind { gemm, conv };

struct KernelTime {
  int64_t calls = 0;
  double seconds = 0;  // summed wall time of the calls
  double flops = 0;    // 2 x multiply-adds of those calls
};

void set_kernel_timing(bool on);
bool kernel_timing_enabled();
KernelTime kernel_time(KernelKind kind);
void reset_kernel_timing();

// Adds the scope's wall time and `flops` to `kind` when timing is on.
class KernelTimer {
 public:
  KernelTimer(KernelKind kind, double flops) : kind_(kind), flops_(flops), on_(kernel_timing_enabled()) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~KernelTimer() {
    if (on_) record(kind_, std::chrono::steady_clock::now() - t0_, flops_);
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

 private:
  static void record(KernelKind kind, std::chrono::steady_clock::duration d, double flops);
  KernelKind kind_;
  double flops_;
  bool on_;
  std::chrono::steady_clock::time_point t0_{};
};

}  // namespace tandem::kernels
