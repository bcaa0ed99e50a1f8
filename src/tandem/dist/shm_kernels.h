// Reduction kernels of the shm backend: combine N input arrays element-wise into one output.
// Vectorised through function multiversioning (AVX-512 / AVX2 / baseline clones picked at load
// time from CPUID; the build never assumes more than x86-64); f16/bf16 have hand-written paths
// (AVX-512 BF16, AVX-512F / AVX2 + F16C) chosen at run time, see kernel_name().
//
// Numerics: f16/bf16 inputs are widened to f32, combined in f32 and rounded once to 16 bits at
// the end (round to nearest even; NaN stays NaN), so an N-input sum has a single 16-bit rounding.
// Integer SUM/PRODUCT wrap around (two's complement, like PyTorch); AVG on integers truncates.
#pragma once

#include <cstdint>

#include "tandem/core/dtype.h"
#include "tandem/dist/process_group.h"

namespace tandem::dist::shm {

// out[i] = op over k < nin of in[k][i] for i < count; AVG divides the sum by `avg_divisor`.
// `out` may be one of the inputs (same elements); other overlaps are not allowed.
// Throws ValueError for bool (reductions need a numeric dtype).
void reduce_arrays(void* out, const void* const* in, int nin, int64_t count, DType dtype, ReduceOp op,
                   int avg_divisor);

// reduce_arrays into each of outs[0..nout): one pass over the inputs that stores every result
// vector into all outputs (AVX-512 f32/bf16/f16), otherwise 16 KiB pieces reduced into outs[0]
// and copied from L1 into the others. The same bits as reduce_arrays in every output. An output
// may be the same elements as one of the inputs (each element is read before it is written);
// other overlaps are not allowed. The push all_reduce writes each reduced chunk into its own
// buffer and every peer's this way.
void reduce_arrays_to(void* const* outs, int nout, const void* const* in, int nin, int64_t count, DType dtype,
                      ReduceOp op, int avg_divisor);

// Which implementation reduce_arrays uses for `dtype` on this CPU: "avx512bf16" (bf16),
// "avx512f+f16c" / "avx2+f16c" (f16), or "generic" (compiler-vectorised loops; also forced for
// every dtype by TANDEM_SHM_KERNELS=generic). Every path gives the same bits: bf16 rounding
// flushes f32 subnormals to zero everywhere, as vcvtne2ps2bf16 does.
const char* kernel_name(DType dtype);

// reduce_arrays through the generic loops whatever the CPU (tests compare the two paths).
void reduce_arrays_generic(void* out, const void* const* in, int nin, int64_t count, DType dtype, ReduceOp op,
                           int avg_divisor);

// The AVX2 + F16C f16 path (what CPUs without AVX-512 use), for tests on CPUs that would pick
// another; false when this CPU cannot run it.
bool reduce_f16_avx2_for_tests(void* out, const void* const* in, int nin, int64_t count, ReduceOp op,
                               int avg_divisor);

// The short names used in fingerprints and errors: "f32", "bf16", "i64", "bool", ...
const char* short_dtype_name(DType dtype);

}  // namespace tandem::dist::shm
