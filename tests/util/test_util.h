// Shared helpers for Tandem's tests: closeness assertions, a finite-difference gradient
// checker, and the bridge to the PyTorch oracle (tensor files + running /usr/bin/python3).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/tandem.h"

namespace tandem::testing {

// Every element: |a - b| <= atol + rtol * |b| (NaNs must match). Reports the worst element.
::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double rtol, double atol);
#define EXPECT_ALL_CLOSE(a, b, rtol, atol) EXPECT_TRUE(::tandem::testing::all_close((a), (b), (rtol), (atol)))

// Checks the analytic gradient of `fn` against central finite differences. Inputs must be f64
// leaves; the output is reduced to a scalar with fixed random weights so that every output
// element's gradient is exercised. Returns the worst |analytic - numeric| seen.
struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
};
::testing::AssertionResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs, const GradcheckOptions& options = {});

// A leaf f64 tensor with values uniform in [lo, hi), requiring grad.
Tensor leaf(const Shape& shape, double lo = -1.0, double hi = 1.0, uint64_t seed = 0, DType dtype = kFloat64);

// ---- PyTorch oracle ----
// "/usr/bin/python3" (or $TANDEM_TORCH_PYTHON) when it can import torch, else "".
const std::string& torch_python();
#define TANDEM_REQUIRE_TORCH()                                                                         \
  do {                                                                                                 \
    if (::tandem::testing::torch_python().empty())                                                     \
      GTEST_SKIP() << "needs PyTorch as the oracle: install python3-torch (scripts/install-deps.sh)";  \
  } while (0)

// A fresh empty directory under the system temp dir, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Tensor files shared with tests/oracle/tensor_io.py: `dir/manifest.json` maps each name to
// {"dtype": "float32"|"float64"|"int64"|..., "shape": [...], "file": "<name>.bin"}, the .bin
// holding the contiguous little-endian elements.
void save_tensors(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors);
std::vector<std::pair<std::string, Tensor>> load_tensors(const std::string& dir);
Tensor find_tensor(const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& name);

// Runs `python script args...` with the torch Python, from the source tree's tests/oracle dir.
// Returns the exit status; output goes to the test log.
int run_oracle(const std::string& script, const std::vector<std::string>& args);

// d loss / d inputs[i] for each input that requires grad (zeros where loss does not reach it),
// undefined for the others; all undefined when loss is undefined or no input requires grad.
std::vector<Tensor> input_grads(const Tensor& loss, const std::vector<Tensor>& inputs);

// The names of a named_parameters() / named_buffers() / state_dict() list, in order.
std::vector<std::string> names(const std::vector<std::pair<std::string, Tensor>>& named);

// |actual - expected| <= bound elementwise (bound: a tensor of the same shape; NaN fails).
// Prints the worst |error| / bound on success, so a loose bound shows in the log.
::testing::AssertionResult within(const Tensor& actual, const Tensor& expected, const Tensor& bound);

// bf16 bit patterns (core/half.h's round-to-nearest-even), for tests that feed raw kernels.
inline uint16_t bf16_bits(float f) { return bfloat16(f).bits; }
inline float bf16_value(uint16_t bits) { return bfloat16::from_bits(bits); }
// n bf16 bit patterns of values uniform in [lo, hi) from Generator(seed) (element i from its
// counter i, so a prefix does not depend on n); at least one element, for n = 0 operands.
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f);

// How far bf16 attention may be from f32 attention on the same bf16-representable values
// (derivation in test_util.cc): elementwise bounds for the output and the three gradients.
struct AttentionBounds {
  Tensor y, dq, dk, dv;
};
AttentionBounds attention_bf16_bounds(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gy, bool causal,
                                      const Tensor& y, const std::vector<Tensor>& grads);

// Path of a file in the source tree.
std::string source_path(const std::string& relative);

// A loopback TCP port that was free a moment ago (bound to port 0, then closed): nothing listens
// there now, and a test may bind it.
uint16_t unused_port();

}  // namespace tandem::testing
