// Dropout with Philox random numbers: for a given generator state the mask is the same on any
// thread count, so a run is reproducible from its seed.
#pragma once

#include "tandem/core/rng.h"
#include "tandem/core/tensor.h"

namespace tandem::ops {

// In training, zeroes each element with probability p and scales survivors by 1/(1-p);
// otherwise returns x. `gen` defaults to the thread's default generator.
Tensor dropout(const Tensor& x, double p, bool training, Generator* gen = nullptr);

}  // namespace tandem::ops
