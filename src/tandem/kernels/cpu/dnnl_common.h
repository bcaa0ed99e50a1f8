// What every oneDNN-backed CPU kernel shares: one engine, a stream per thread, the dtype map,
// and OpenMP's thread count kept equal to Tandem's (OpenMP's is per calling thread).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include "tandem/core/dtype.h"

namespace tandem::kernels {

dnnl::engine& dnnl_engine();
// This thread's stream (streams are not shared between threads).
dnnl::stream& dnnl_stream();
// Throws DTypeError naming `op` for dtypes oneDNN has no CPU path for here.
dnnl::memory::data_type dnnl_type(DType t, const char* op);
// Call before executing a primitive: oneDNN then uses get_num_threads() threads.
void dnnl_sync_threads();

}  // namespace tandem::kernels
