// What this CPU can do, read once from CPUID (and the OS's XSAVE state). Kernels choose their
// fast paths from here at run time; the build itself targets plain x86-64.
#pragma once

#include <string>

namespace tandem {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_bf16 = false;
  bool intel = false;  // CPUID vendor "GenuineIntel": some kernel choices differ by microarchitecture
  std::string summary() const;  // "avx2 fma f16c avx512f ..." of what is present
};

// Detected on first call; thread-safe.
const CpuFeatures& cpu_features();

}  // namespace tandem
