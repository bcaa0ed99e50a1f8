// Errors thrown by Tandem. Every message names the offending value, what was expected and
// where; library code throws, only a tool's or example's main() turns an error into an exit code.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace tandem {

// Base of every Tandem error.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A tensor's shape does not fit the operation.
class ShapeError : public Error { using Error::Error; };
// A tensor's dtype does not fit the operation.
class DTypeError : public Error { using Error::Error; };
// An argument value is out of range or otherwise invalid.
class ValueError : public Error { using Error::Error; };
// A file could not be read or is malformed.
class IOError : public Error { using Error::Error; };
// Misuse of autograd (backward through a freed graph, in-place on a leaf, ...).
class AutogradError : public Error { using Error::Error; };

// Prints the error and returns the process exit code; for main() of tools and examples only.
int report(const std::exception& e);

}  // namespace tandem

// Throws `Type` with a fmt-formatted message when `cond` is false.
#define TANDEM_CHECK(cond, Type, ...)                      \
  do {                                                     \
    if (!(cond)) [[unlikely]] {                            \
      throw Type(fmt::format(__VA_ARGS__));                \
    }                                                      \
  } while (0)
