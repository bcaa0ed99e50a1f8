// Small helpers shared by the tests/ops suites (header-only, test code only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/core/cpu_features.h"
#include "tandem/kernels/cpu/amx_gemm.h"
#include "tandem/kernels/cpu/bf16_products.h"
#include "tandem/tandem.h"
#include "util/test_util.h"

namespace tandem::ops_test {

// A constant f64 tensor (no grad) with the given values.
inline Tensor f64(const std::vector<double>& values, const Shape& shape) { return tensor(values, shape, kFloat64); }

// An f64 leaf requiring grad with the given values.
inline Tensor param(const std::vector<double>& values, const Shape& shape) {
  Tensor t = tensor(values, shape, kFloat64);
  t.requires_grad_(true);
  return t;
}

// An int64 tensor.
inline Tensor i64(const std::vector<int64_t>& values, const Shape& shape) { return tensor(values, shape); }

// Expects `stmt` to throw exactly `ErrType` (or a subclass) whose what() contains (std::string::find) every string in
// `needles`. Usage: EXPECT_TANDEM_THROW(ops::matmul(a, b), ShapeError, {"[2, 3]", "[4, 5]"});
#define EXPECT_TANDEM_THROW(stmt, ErrType, ...)                                            \
  do {                                                                                     \
    bool caught_ = false;                                                                  \
    try {                                                                                  \
      (void)(stmt);                                                                        \
    } catch (const ::tandem::ErrType& e_) {                                                \
      caught_ = true;                                                                      \
      for (const std::string& needle_ : std::vector<std::string> __VA_ARGS__)              \
        EXPECT_NE(std::string(e_.what()).find(needle_), std::string::npos)                 \
            << #stmt ": message \"" << e_.what() << "\" lacks \"" << needle_ << "\"";      \
    } catch (const std::exception& e_) {                                                   \
      ADD_FAILURE() << #stmt " threw the wrong type (wanted " #ErrType "): " << e_.what(); \
      caught_ = true;                                                                      \
    }                                                                                      \
    if (!caught_) ADD_FAILURE() << #stmt " did not throw " #ErrType;                       \
  } while (0)

// The ways bf16 products can run on this CPU (kernels/cpu/bf16_products.h): amx where its tiles
// are usable; native where the CPU has AVX512-BF16 (oneDNN's bf16 kernels, else absent or
// emulated); widened everywhere.
inline std::vector<kernels::Bf16Products> bf16_ways_here() {
  std::vector<kernels::Bf16Products> ways;
  if (kernels::amx_bf16_usable()) ways.push_back(kernels::Bf16Products::amx);
  if (cpu_features().avx512_bf16) ways.push_back(kernels::Bf16Products::native);
  ways.push_back(kernels::Bf16Products::widened);
  return ways;
}

// Puts back, when it goes out of scope, the way bf16 products ran when it was made.
struct Bf16WayRestorer {
  kernels::Bf16Products chosen = kernels::bf16_products();
  ~Bf16WayRestorer() { kernels::set_bf16_products(chosen); }
};

// Runs fn once per way of bf16_ways_here() with that way set (named by a SCOPED_TRACE), then
// puts back the way the process had chosen: a test of bf16 arithmetic covers every kernel this
// machine can run, not only the one it picked.
template <class F>
void for_each_bf16_way(F fn) {
  const Bf16WayRestorer restore;
  for (const kernels::Bf16Products way : bf16_ways_here()) {
    SCOPED_TRACE(std::string("bf16 products: ") + kernels::bf16_products_name(way));
    kernels::set_bf16_products(way);
    fn();
  }
}

}  // namespace tandem::ops_test
