// Shared by the examples: flag parsing, shuffling, the JSON summary. Examples are what a user
// writes; this header only keeps their boilerplate out of the way.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "tandem/tandem.h"

namespace examples {

// --name value flags with defaults; unknown flags and non-numbers are errors naming them.
class Flags {
 public:
  Flags(int argc, char** argv, std::map<std::string, std::string> defaults, const char* usage)
      : values_(std::move(defaults)) {
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (k == "--help" || k == "-h") {
        std::printf("usage: %s\n", usage);
        std::exit(0);
      }
      if (k.rfind("--", 0) != 0 || !values_.count(k.substr(2))) {
        throw tandem::ValueError(fmt::format("unknown argument \"{}\"; usage: {}", k, usage));
      }
      if (i + 1 >= argc) throw tandem::ValueError(fmt::format("{} needs a value", k));
      values_[k.substr(2)] = argv[++i];
    }
  }
  std::string str(const std::string& k) const { return values_.at(k); }
  double num(const std::string& k) const {
    const std::string& v = values_.at(k);
    try {
      size_t pos = 0;
      const double d = std::stod(v, &pos);
      if (pos == v.size()) return d;
    } catch (const std::exception&) {
    }
    throw tandem::ValueError(fmt::format("--{}: \"{}\" is not a number", k, v));
  }
  int64_t integer(const std::string& k, int64_t min = 0) const {
    const double d = num(k);
    if (d != static_cast<double>(static_cast<int64_t>(d)) || d < static_cast<double>(min)) {
      throw tandem::ValueError(fmt::format("--{}: expected an integer >= {}, got {}", k, min, values_.at(k)));
    }
    return static_cast<int64_t>(d);
  }

 private:
  std::map<std::string, std::string> values_;
};

// A Fisher-Yates permutation of [0, n) from a seeded Philox generator.
inline tandem::Tensor permutation(int64_t n, uint64_t seed) {
  tandem::Tensor idx = tandem::arange(static_cast<double>(n));
  auto* p = idx.data_ptr<int64_t>();
  tandem::Generator g(seed);
  const uint64_t base = g.reserve(static_cast<uint64_t>(n));
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(p[i], p[g.bits(base, static_cast<uint64_t>(i)) % static_cast<uint64_t>(i + 1)]);
  }
  return idx;
}

// Writes `j` to `path` atomically (temporary file, then rename).
inline void write_summary(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw tandem::IOError(fmt::format("cannot write {}", tmp));
    f << j.dump(2) << "\n";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw tandem::IOError(fmt::format("cannot rename {} to {}", tmp, path));
}

// Fashion-MNIST images (N, 28, 28) u8 -> f32 normalised with the training set's mean and std.
inline tandem::Tensor normalise_fashion(const tandem::Tensor& images) {
  tandem::Tensor x = images.to(tandem::kFloat32);
  return tandem::ops::mul(tandem::ops::add(tandem::ops::mul(x, 1.0 / 255.0), -0.2860), 1.0 / 0.3530);
}

// The image-classification loop W1 and W2 share: shuffled mini-batches (a fresh Philox
// permutation per epoch), zero_grad / forward / cross_entropy / backward / step, then test
// accuracy in eval mode.
struct ClassifierResult {
  double test_accuracy = 0, samples_per_s = 0, train_seconds = 0;
  int64_t steps = 0;
};

inline ClassifierResult train_classifier(tandem::nn::Module& model, tandem::optim::Optimizer& opt,
                                         const tandem::Tensor& x_train, const tandem::Tensor& y_train,
                                         const tandem::Tensor& x_test, const tandem::Tensor& y_test, int64_t epochs,
                                         int64_t batch_size, uint64_t seed) {
  namespace td = tandem;
  ClassifierResult r;
  const int64_t n = x_train.size(0);
  int64_t seen = 0;
  // ---- train ----
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    const td::Tensor order = permutation(n, seed * 1000003ULL + static_cast<uint64_t>(epoch));
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t start = 0; start < n; start += batch_size) {
      const td::Tensor idx = order.narrow(0, start, std::min(batch_size, n - start));
      const td::Tensor x = td::ops::index_select(x_train, 0, idx);
      const td::Tensor y = td::ops::index_select(y_train, 0, idx);
      opt.zero_grad();
      td::Tensor loss = td::ops::cross_entropy(model(x), y);
      loss.backward();
      opt.step();
      seen += idx.numel();
      if (++r.steps % 100 == 0) {
        std::printf("epoch %lld step %lld loss %.4f\n", static_cast<long long>(epoch), static_cast<long long>(r.steps),
                    loss.item());
      }
    }
    r.train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  r.samples_per_s = static_cast<double>(seen) / r.train_seconds;
  // ---- evaluate (BatchNorm on its running statistics) ----
  model.eval();
  int64_t correct = 0;
  {
    td::NoGradGuard no_grad;
    for (int64_t start = 0; start < x_test.size(0); start += 500) {
      const int64_t len = std::min<int64_t>(500, x_test.size(0) - start);
      const td::Tensor logits = model(x_test.narrow(0, start, len));
      correct += td::ops::count_equal(td::ops::argmax(logits, 1), y_test.narrow(0, start, len));
    }
  }
  r.test_accuracy = static_cast<double>(correct) / static_cast<double>(x_test.size(0));
  return r;
}

// Prints and writes the summary every classifier example reports.
inline void report_classifier(const ClassifierResult& r, const std::string& summary_path, int64_t epochs,
                              int64_t batch_size, int threads) {
  const int64_t peak = tandem::peak_allocated_bytes();
  std::printf("test_accuracy %.4f  samples_per_s %.1f  peak_bytes %lld  train_seconds %.2f\n", r.test_accuracy,
              r.samples_per_s, static_cast<long long>(peak), r.train_seconds);
  write_summary(summary_path, {{"test_accuracy", r.test_accuracy}, {"samples_per_s", r.samples_per_s},
                               {"peak_bytes", peak}, {"train_seconds", r.train_seconds}, {"epochs", epochs},
                               {"batch_size", batch_size}, {"threads", threads}, {"steps", r.steps}});
}

}  // namespace examples
