#include "tandem/kernels/cpu/dnnl_common.h"

#include <omp.h>

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
