// The "batch of cases" harness shared by ops_oracle_test.cc and models_oracle_test.cc: each case
// runs an op on given inputs; the harness draws fixed random weights w_k for every floating
// output, takes the gradients of sum_k sum(out_k * w_k) with respect to every input leaf, writes
// inputs and weights for a python oracle (protocol: tests/oracle/oracle_common.py), runs it once
// for the whole batch and compares every output ("<case>.out<k>") and input gradient
// ("<case>.g<i>") with all_close and an exact dtype check.
//
// Tolerances (|actual - expected| <= atol + rtol * |expected|): f32 rtol 1e-5, atol
// max(1e-6, 4 u n s) with u = 2^-24; f64 rtol 1e-12, atol max(1e-13, 4 u n s) with u = 2^-53;
// n = `acc`, the longest accumulation behind an element, and s = `scale`, the size of its terms.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "util/test_util.h"

namespace tandem::testing {

using OracleFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

struct OracleCase {
  std::string name;  // "<op>__<f32|f64>", the key the oracle looks up
  std::vector<Tensor> inputs;
  OracleFn fn;
  double rtol = 0, atol = 0;
  // Filled by OracleCases::run():
  std::vector<Tensor> outputs;
  std::vector<Tensor> grads;  // per input; undefined for constants
};

struct OracleOptions {
  uint64_t weight_seed;                  // seed of the generator of the weights w_k
  std::string script;                    // the oracle, run with args + {IN_DIR, OUT_DIR}
  std::vector<std::string> args = {};    // leading arguments (e.g. a mode)
  bool inputs_before_fn = false;         // save clones of the inputs before fn runs (fn may
                                         // update constants such as running stats) rather than
                                         // the inputs themselves after it
};

class OracleCases {
 public:
  explicit OracleCases(OracleOptions options) : options_(std::move(options)) {}

  // Adds a case. `acc` is the longest accumulation behind an output or gradient element and
  // `scale` the size of its terms (see the tolerances above).
  void add(const std::string& op, DType dt, std::vector<Tensor> inputs, OracleFn fn, double acc = 1,
           double scale = 1) {
    constexpr double kU32 = 0x1p-24;
    constexpr double kU64 = 0x1p-53;
    OracleCase c;
    c.name = op + (dt == kFloat64 ? "__f64" : "__f32");
    c.inputs = std::move(inputs);
    c.fn = std::move(fn);
    if (dt == kFloat64) {
      c.rtol = 1e-12;
      c.atol = std::max(1e-13, 4 * kU64 * acc * scale);
    } else {
      c.rtol = 1e-5;
      c.atol = std::max(1e-6, 4 * kU32 * acc * scale);
    }
    cases_.push_back(std::move(c));
  }

  // A leaf of `dt` with values uniform in [lo, hi), requiring grad; each call draws new values.
  Tensor x(const Shape& shape, DType dt, double lo = -1.0, double hi = 1.0) { return leaf(shape, lo, hi, seed_++, dt); }
  // The same without grad (a constant input).
  Tensor c(const Shape& shape, DType dt, double lo = -1.0, double hi = 1.0) { return x(shape, dt, lo, hi).detach(); }

  size_t size() const { return cases_.size(); }

  // Runs every case here and in the oracle and compares outputs and input gradients. Sets
  // *compared to the number of tensors compared; returns false if it stopped early (a case
  // threw, or the oracle failed).
  bool run(size_t* compared) {
    bool finished = false;
    run_impl(compared, &finished);
    return finished;
  }

 private:
  void run_impl(size_t* compared_out, bool* finished) {
    Generator wgen(options_.weight_seed);
    std::vector<std::pair<std::string, Tensor>> files;
    auto input_key = [](const OracleCase& c, size_t i) {
      return c.name + (c.inputs[i].requires_grad() ? ".x" : ".c") + std::to_string(i);
    };
    for (OracleCase& c : cases_) {
      SCOPED_TRACE(c.name);
      if (options_.inputs_before_fn)
        for (size_t i = 0; i < c.inputs.size(); ++i) files.emplace_back(input_key(c, i), c.inputs[i].detach().clone());
      try {
        c.outputs = c.fn(c.inputs);
      } catch (const Error& e) {
        FAIL() << c.name << ": " << e.what();
      }
      Tensor loss;
      for (size_t k = 0; k < c.outputs.size(); ++k) {
        const Tensor& o = c.outputs[k];
        if (!is_floating(o.dtype())) continue;
        const Tensor w = randn(o.shape(), o.dtype(), &wgen);
        files.emplace_back(c.name + ".w" + std::to_string(k), w);
        const Tensor term = ops::sum(ops::mul(o, w));
        loss = loss.defined() ? ops::add(loss, term) : term;
      }
      if (!options_.inputs_before_fn) {
        for (size_t i = 0; i < c.inputs.size(); ++i) files.emplace_back(input_key(c, i), c.inputs[i]);
      }
      c.grads = input_grads(loss, c.inputs);
    }
    TempDir in, out;
    save_tensors(in.path(), files);
    std::vector<std::string> args = options_.args;
    std::string what = options_.script;
    for (const std::string& a : options_.args) what += " " + a;
    args.push_back(in.path());
    args.push_back(out.path());
    ASSERT_EQ(run_oracle(options_.script, args), 0) << what << " failed";
    const auto expected = load_tensors(out.path());

    size_t compared = 0;
    for (const OracleCase& c : cases_) {
      auto check = [&](const Tensor& actual, const std::string& key) {
        SCOPED_TRACE(key);
        Tensor want;
        try {
          want = find_tensor(expected, key);
        } catch (const ValueError&) {
          ADD_FAILURE() << "the oracle wrote no " << key;
          return;
        }
        EXPECT_EQ(dtype_name(actual.dtype()), dtype_name(want.dtype())) << key;
        EXPECT_TRUE(all_close(actual, want, c.rtol, c.atol)) << key;
        ++compared;
      };
      for (size_t k = 0; k < c.outputs.size(); ++k) check(c.outputs[k], c.name + ".out" + std::to_string(k));
      for (size_t i = 0; i < c.grads.size(); ++i)
        if (c.grads[i].defined()) check(c.grads[i], c.name + ".g" + std::to_string(i));
    }
    // Nothing the oracle computed went unchecked (e.g. an output this side does not produce).
    EXPECT_EQ(compared, expected.size());
    *compared_out = compared;
    *finished = true;
  }

  OracleOptions options_;
  std::vector<OracleCase> cases_;
  uint64_t seed_ = 1;
};

}  // namespace tandem::testing
