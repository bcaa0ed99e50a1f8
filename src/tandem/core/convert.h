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

// The scalar reference paths, exposed for tests of the vector paths.
void convert_f32_to_bf16_scalar(const float* src, bfloat16* dst, int64_t n);
void convert_f32_to_f16_scalar(const float* src, half* dst, int64_t n);

}  // namespace tandem
