// Bulk conversion between dtypes on contiguous buffers. f32 <-> bf16 and f32 <-> f16 have
// vector paths (AVX-512 BF16, AVX-512F, F16C) picked at run time; every path gives results
// bit-identical to the scalar round-to-nearest-even conversion in half.h, subnormals included.
#pragma once

#include <cstdint>

#include "tandem/core/dtype.h"

namespace tandem {

// dst[i] = cast<ddt>(src[i]) for i in [0, n). Buffers must not overlap unless src == dst and the
// dtypes have the same size. Float -> integer truncates toward zero, like PyTorch.
void convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n);

// convert() for a result that is written now and read much later (a parameter's gradient, widened
// from bf16 at the end of its backward, read by the optimizer after the rest of backward): large
// bf16 -> f32 results (>= kStreamingMinElements, 1 MiB of f32, more than a core's L2 on the CPUs
// measured) are written with streaming stores, which skip reading the destination lines first
// and leave the caches to the rest of backward. Same values as convert(), bit for bit; other
// dtype pairs and sizes are convert() itself. (W1 bf16 step on a Zen 4 core: backward 4.39-4.49
// vs 4.63-4.70 ms, optimizer unchanged, 5 alternated pairs.)
inline constexpr int64_t kStreamingMinElements = int64_t{1} << 18;
void convert_for_later(const void* src, DType sdt, void* dst, DType ddt, int64_t n);

// The scalar reference paths, exposed for tests of the vector paths.
void convert_f32_to_bf16_scalar(const float* src, bfloat16* dst, int64_t n);
void convert_f32_to_f16_scalar(const float* src, half* dst, int64_t n);

}  // namespace tandem
