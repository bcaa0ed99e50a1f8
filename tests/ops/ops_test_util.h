// Small helpers shared by the tests/ops suites (header-only, test code only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

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

}  // namespace tandem::ops_test
