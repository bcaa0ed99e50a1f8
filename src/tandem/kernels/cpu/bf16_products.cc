#include "tandem/kernels/cpu/bf16_products.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "tandem/core/cpu_features.h"
#include "tandem/core/error.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/core_peak.h"

namespace tandem::kernels {
namespace {

// The measured VDPBF16PS rate must reach this fraction of the f32 FMA rate for bf16 to run
// natively. Measured ratios: ~2 on AMD Zen 4, ~0.49 on an Intel Xeon without AMX; at equal
// rates native still wins (half the bytes, no widening passes).
constexpr double kNativeMinRatio = 0.8;

const Bf16Decision& first_decision() {
  static const Bf16Decision d = [] {
    const char* env = std::getenv("TANDEM_BF16_GEMM");
    const CpuFeatures& f = cpu_features();
    return decide_bf16_products(env != nullptr ? env : "", amx_bf16_usable(),
                                f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16, [] {
                                  // Interleaved, best of nine each (~2 ms): a run slowed by another
                                  // process does not decide.
                                  double fma = 0, dot = 0;
                                  for (int rep = 0; rep < 9; ++rep) {
                                    fma = std::max(fma, measure_f32_fma_gflops(20'000, 1));
                                    dot = std::max(dot, measure_bf16_dot_gflops(20'000, 1));
                                  }
                                  return std::make_pair(fma, dot);
                                });
  }();
  return d;
}

// -1: not overridden; else the Bf16Products set by set_bf16_products.
std::atomic<int> overridden{-1};

}  // namespace

Bf16Decision decide_bf16_products(const std::string& env, bool amx_usable, bool avx512_bf16,
                                  const std::function<std::pair<double, double>()>& measure) {
  Bf16Decision d;
  if (env == "onednn") {
    d.products = Bf16Products::native;
    d.own_kernels_off = true;
    d.reason = "TANDEM_BF16_GEMM=onednn";
    return d;
  }
  if (env == "f32") {
    d.products = Bf16Products::widened;
    d.reason = "TANDEM_BF16_GEMM=f32";
    return d;
  }
  if (!env.empty() && env != "amx" && env != "auto") {
    throw ValueError(fmt::format(
        "TANDEM_BF16_GEMM=\"{}\" is not a known way to run bf16 products; use \"auto\" (or \"amx\": Tandem's choice, "
        "AMX where the CPU has it), \"onednn\" (oneDNN's bf16 kernels) or \"f32\" (operands widened to f32)",
        env));
  }
  if (amx_usable) {
    d.products = Bf16Products::amx;
    d.reason = "AMX-BF16";
    return d;
  }
  if (!avx512_bf16) {
    d.products = Bf16Products::widened;
    d.reason = "no AVX512-BF16";
    return d;
  }
  const auto [fma, dot] = measure();
  d.products = dot >= kNativeMinRatio * fma ? Bf16Products::native : Bf16Products::widened;
  d.reason = fmt::format("VDPBF16PS {:.0f} GFLOP/s vs f32 FMA {:.0f} GFLOP/s on this core", dot, fma);
  return d;
}

Bf16Products bf16_products() {
  const int o = overridden.load(std::memory_order_relaxed);
  return o >= 0 ? static_cast<Bf16Products>(o) : first_decision().products;
}

void set_bf16_products(Bf16Products p) {
  TANDEM_CHECK(p != Bf16Products::amx || amx_bf16_usable(), ValueError,
               "set_bf16_products: amx needs AMX-BF16 tiles, which this CPU (or its kernel) does not offer; use native "
               "or widened");
  overridden.store(static_cast<int>(p), std::memory_order_relaxed);
}

const char* bf16_products_name(Bf16Products p) {
  switch (p) {
    case Bf16Products::amx: return "amx";
    case Bf16Products::native: return "native";
    case Bf16Products::widened: return "widened";
  }
  return "?";
}

std::string bf16_products_reason() { return first_decision().reason; }

bool bf16_kernels_switched_off() { return first_decision().own_kernels_off; }

}  // namespace tandem::kernels
