#include "tandem/data/synthetic.h"

#include <cstdint>

#include "tandem/core/rng.h"

namespace tandem::data {

Synthetic::Synthetic(const Options& options) : options_(options) {
  TANDEM_CHECK(options.size >= 0, ValueError, "Synthetic: size must be >= 0, got {}", options.size);
  TANDEM_CHECK(options.num_classes >= 1, ValueError, "Synthetic: num_classes must be >= 1, got {}", options.num_classes);
  for (const Shape* s : {&options.input_shape, &options.target_shape}) {
    for (int64_t d : *s) {
      TANDEM_CHECK(d >= 0, ValueError, "Synthetic: shapes must not have negative extents, got {}", shape_str(*s));
    }
  }
  TANDEM_CHECK(options.input_dtype != kBool, DTypeError, "Synthetic: input_dtype bool is not supported");
  // Integer inputs are ids in [0, num_classes): the largest must fit the dtype, or they would wrap.
  const int64_t max_id = options.input_dtype == kUInt8 ? 255 : options.input_dtype == kInt32 ? INT32_MAX : INT64_MAX;
  TANDEM_CHECK(is_floating(options.input_dtype) || options.num_classes - 1 <= max_id, DTypeError,
               "Synthetic: input ids go up to num_classes - 1 = {}, which {} cannot hold (largest {}); use a wider "
               "input_dtype (int64) or fewer classes",
               options.num_classes - 1, dtype_name(options.input_dtype), max_id);
}

Example Synthetic::get(int64_t i) const {
  check_index(i, "Synthetic");
  // A generator of its own per example: the seed is a Philox hash of (seed, i).
  const auto h = philox4x32(static_cast<uint64_t>(i), 0x53594e5448455449ull /* "SYNTHETI" */, options_.seed);
  Generator gen((uint64_t{h[0]} << 32) | h[1]);
  Tensor input;
  if (is_floating(options_.input_dtype)) {
    input = randn(options_.input_shape, options_.input_dtype, &gen);
  } else {
    input = randint(0, options_.num_classes, options_.input_shape, &gen).to(options_.input_dtype);
  }
  Tensor target = randint(0, options_.num_classes, options_.target_shape, &gen);
  return {input, target};
}

}  // namespace tandem::data
