// bench_common.h: the timing harness the side-by-side benchmarks (mlp_step.cc, models_step.cc)
// share: wall and process-CPU clocks, the common command-line flags, the warm-up + timed loop
// with medians, the per-phase split of a training step, and the "env" JSON line. Header-only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/kernels/cpu/core_peak.h"
#include "tandem/kernels/cpu/kernel_timing.h"
#include "tandem/tandem.h"

namespace tandem::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the whole process: on one thread it is the work done, without the time other
// processes on a shared machine took the core away.
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The flags every bench takes; each bench's Args derives from it and sets its own defaults.
struct CommonArgs {
  int threads = 1;
  double seconds = 3.0;     // timed wall time per workload (at least min_steps iterations)
  int64_t min_steps = 0;
  int64_t warmup = 0;
  std::string dtype;        // "", "f32" or "bf16"
  bool phases = false;
};

// Parses argv into `a`: --threads, --seconds, --min-steps, --warmup, --dtype, --phases and
// --help (prints "usage: <usage>") here, anything else through extra(k, value) (value() takes
// the flag's argument), which returns false for a flag it does not know. TANDEM_BENCH_PHASES
// (non-empty, not "0") turns --phases on.
template <class Extra>
void parse_args(int argc, char** argv, CommonArgs& a, const char* usage, Extra&& extra) {
  if (const char* e = std::getenv("TANDEM_BENCH_PHASES"); e != nullptr && std::string(e) != "0" && *e) a.phases = true;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ValueError(fmt::format("{} needs a value", k));
      return argv[++i];
    };
    if (k == "--threads") a.threads = std::stoi(value());
    else if (k == "--seconds") a.seconds = std::stod(value());
    else if (k == "--min-steps") a.min_steps = std::stoll(value());
    else if (k == "--warmup") a.warmup = std::stoll(value());
    else if (k == "--dtype") a.dtype = value();
    else if (k == "--phases") a.phases = true;
    else if (k == "--help" || k == "-h") {
      std::printf("usage: %s\n", usage);
      std::exit(0);
    } else if (!extra(k, value)) {
      throw ValueError(fmt::format("unknown argument \"{}\" (try --help)", k));
    }
  }
}

inline double median_of(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

// Per-iteration wall and process-CPU times; reports medians (robust on a shared machine), the
// mean and the best.
struct Timing {
  std::vector<double> t, cpu;
  double median() const { return median_of(t); }
  double cpu_median() const { return median_of(cpu); }
  double mean() const {
    double sum = 0;
    for (double x : t) sum += x;
    return sum / static_cast<double>(t.size());
  }
  double min() const { return *std::min_element(t.begin(), t.end()); }
};

// Warm-up, then after_warmup(), then the timed iterations (at least min_steps, at least
// `seconds` of wall time).
template <class F, class G>
Timing time_loop(const CommonArgs& a, F&& fn, G&& after_warmup) {
  for (int64_t i = 0; i < a.warmup; ++i) fn();
  after_warmup();
  Timing tm;
  const auto start = Clock::now();
  while (static_cast<int64_t>(tm.t.size()) < a.min_steps || seconds_since(start) < a.seconds) {
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    fn();
    tm.t.push_back(seconds_since(t0));
    tm.cpu.push_back(process_cpu_seconds() - c0);
  }
  return tm;
}

template <class F>
Timing time_loop(const CommonArgs& a, F&& fn) {
  return time_loop(a, std::forward<F>(fn), [] {});
}

// One training step on the next batch of a cycled pool: zero_grad, forward, cross_entropy,
// backward, optimizer step. Returns the loss.
template <class Forward>
Tensor train_step(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys, size_t& next,
                  optim::Optimizer& opt, Forward&& forward) {
  const Tensor& x = xs[next % xs.size()];
  const Tensor& y = ys[next % ys.size()];
  ++next;
  opt.zero_grad();
  Tensor loss = ops::cross_entropy(forward(x), y);
  loss.backward();
  opt.step();
  return loss;
}

struct Phases {
  double zero_grad = 0, forward = 0, loss = 0, backward = 0, step = 0;
  int64_t allocs = 0, system_allocs = 0, steps = 0;
  kernels::KernelTime gemm, conv;  // inside oneDNN's GEMM / convolution calls, all phases
};

// The same step with a process-CPU clock between phases (everything is synchronous on CPU),
// repeated for at least min_steps steps and `seconds` of wall time.
template <class Forward>
Phases time_phases(const CommonArgs& a, const std::vector<Tensor>& xs, const std::vector<Tensor>& ys, size_t& next,
                   optim::Optimizer& opt, Forward&& forward) {
  Phases ph;
  auto& alloc = cpu_allocator();
  kernels::reset_kernel_timing();
  kernels::set_kernel_timing(true);
  const auto t_end = Clock::now() + std::chrono::duration<double>(a.seconds);
  while (ph.steps < a.min_steps || Clock::now() < t_end) {
    const Tensor& x = xs[next % xs.size()];
    const Tensor& y = ys[next % ys.size()];
    ++next;
    const auto s0 = alloc.stats();
    double t0 = process_cpu_seconds(), t1;
    opt.zero_grad();
    ph.zero_grad += (t1 = process_cpu_seconds()) - t0;
    const Tensor logits = forward(x);
    ph.forward += (t0 = process_cpu_seconds()) - t1;
    Tensor loss = ops::cross_entropy(logits, y);
    ph.loss += (t1 = process_cpu_seconds()) - t0;
    loss.backward();
    ph.backward += (t0 = process_cpu_seconds()) - t1;
    opt.step();
    ph.step += process_cpu_seconds() - t0;
    const auto s1 = alloc.stats();
    ph.allocs += s1.num_allocs - s0.num_allocs;
    ph.system_allocs += s1.num_system_allocs - s0.num_system_allocs;
    ++ph.steps;
  }
  kernels::set_kernel_timing(false);
  ph.gemm = kernels::kernel_time(kernels::KernelKind::gemm);
  ph.conv = kernels::kernel_time(kernels::KernelKind::conv);
  return ph;
}

inline double gflops_per_s(const kernels::KernelTime& t) { return t.seconds > 0 ? 1e-9 * t.flops / t.seconds : 0.0; }

// The "<name>" phases JSON line (name is e.g. "mlp_step_phases").
inline void print_phases(const std::string& name, const std::string& dtype, const Phases& ph) {
  const double k = static_cast<double>(ph.steps);
  std::printf(
      "{\"name\":\"%s\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"steps\":%lld,\"zero_grad_ms\":%.3f,"
      "\"forward_ms\":%.3f,\"loss_ms\":%.3f,\"backward_ms\":%.3f,\"optimizer_ms\":%.3f,\"allocs_per_step\":%.1f,"
      "\"system_allocs_per_step\":%.2f,\"gemm_ms\":%.3f,\"gemm_gflops\":%.1f,\"conv_ms\":%.3f,\"conv_gflops\":%.1f}\n",
      name.c_str(), dtype.c_str(), static_cast<long long>(ph.steps), 1e3 * ph.zero_grad / k, 1e3 * ph.forward / k,
      1e3 * ph.loss / k, 1e3 * ph.backward / k, 1e3 * ph.step / k, static_cast<double>(ph.allocs) / k,
      static_cast<double>(ph.system_allocs) / k, 1e3 * ph.gemm.seconds / k, gflops_per_s(ph.gemm),
      1e3 * ph.conv.seconds / k, gflops_per_s(ph.conv));
  std::fflush(stdout);
}

// This core's f32 multiply-add peak, measured (kernels/cpu/core_peak.h) for ~0.1 s, the best of
// 3 runs, in GFLOP/s: the yardstick for how close the f32 GEMM time of a step is to what the core
// can do at all (--phases). 0 without FMA.
inline double f32_fma_peak_gflops() {
  static const double peak = kernels::measure_f32_fma_gflops(2'000'000, 3);
  return peak;
}

// This core's bf16 multiply-add peak without AMX, measured the same way with VDPBF16PS
// (AVX512-BF16): what the bf16 GEMMs of a step can reach at all on such a core. 0 where the CPU
// has no AVX512-BF16, and where it has AMX-BF16: there the bf16 products run on the tiles, whose
// peak this does not measure.
inline double bf16_dot_peak_gflops() {
  static const double peak = cpu_features().amx_bf16 ? 0.0 : kernels::measure_bf16_dot_gflops(2'000'000, 3);
  return peak;
}

// Sets the thread count and prints the "env" line (with the core's measured f32 FMA and bf16 dot
// product peaks).
inline void init_and_print_env(int threads) {
  set_num_threads(threads);
  std::printf("{\"name\":\"env\",\"impl\":\"tandem\",\"threads\":%d,\"cpu\":\"%s\",\"f32_fma_peak_gflops\":%.1f,"
              "\"bf16_dot_peak_gflops\":%.1f,\"bf16_products\":\"%s\"}\n",
              get_num_threads(), cpu_features().summary().c_str(), f32_fma_peak_gflops(), bf16_dot_peak_gflops(),
              kernels::bf16_products_name(kernels::bf16_products()));
  std::fflush(stdout);
}

// The dtypes to run: the one --dtype names, else f32 then bf16.
inline std::vector<std::string> dtypes_to_run(const CommonArgs& a) {
  return a.dtype.empty() ? std::vector<std::string>{"f32", "bf16"} : std::vector<std::string>{a.dtype};
}

}  // namespace tandem::bench
