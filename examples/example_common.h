// Shared by the examples: flag parsing, shuffling, the JSON summary. Examples are what a user
// writes; this header only keeps their boilerplate out of the way.
#pragma once

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/tandem.h"

namespace examples {

// --name value flags with defaults; unknown flags and non-numbers are errors naming them.
class Flags {
 public:
  Flags(int argc, char** argv, std::map<std::string, std::string> defaults, const std::string& usage)
      : values_(std::move(defaults)) {
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (k == "--help" || k == "-h") {
        std::printf("usage: %s\n", usage.c_str());
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
  int64_t integer(const std::string& k, int64_t min = 0, int64_t max = INT64_MAX) const {
    const double d = num(k);
    // Range first: converting a double outside int64's range (1e300, 2^63) is undefined.
    if (!(d >= static_cast<double>(min) && d < 0x1p63 && d == std::floor(d)) || static_cast<int64_t>(d) > max) {
      throw tandem::ValueError(max == INT64_MAX
                                   ? fmt::format("--{}: expected an integer >= {}, got {}", k, min, values_.at(k))
                                   : fmt::format("--{}: expected an integer in [{}, {}], got {}", k, min, max, values_.at(k)));
    }
    return static_cast<int64_t>(d);
  }
  // A finite number >= min (a learning rate of inf or nan trains nothing but NaNs).
  double finite(const std::string& k, double min) const {
    const double d = num(k);
    if (!std::isfinite(d) || d < min) {
      throw tandem::ValueError(fmt::format("--{}: expected a finite number >= {}, got {}", k, min, values_.at(k)));
    }
    return d;
  }

 private:
  std::map<std::string, std::string> values_;
};

// --threads above this is a typo, not a machine (and would fail creating threads).
inline constexpr int64_t kMaxThreads = 1024;

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

// Fails early (before any training) when `path` cannot receive a summary: an existing directory,
// or a directory that cannot be written (write_summary creates path + ".tmp" there).
inline void check_summary_path(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw tandem::IOError(fmt::format("--summary-json: {} is a directory; give a file name", path));
  }
  const std::string tmp = path + ".tmp";
  const bool existed = std::filesystem::exists(tmp, ec);
  {
    std::ofstream f(tmp, std::ios::app);
    if (!f) throw tandem::IOError(fmt::format("--summary-json: cannot write {}: {}", tmp, std::strerror(errno)));
  }
  if (!existed) std::filesystem::remove(tmp, ec);
}

// Writes `j` to `path` atomically (temporary file, then rename): a reader sees the old file or
// the whole new one. A failed write (disk full, file size limit) removes the temporary file and
// throws IOError; `path` is never left half-written.
inline void write_summary(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  bool ok;
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) throw tandem::IOError(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
    f << j.dump(2) << "\n";
    f.close();
    ok = !f.fail();
  }
  std::error_code ec;
  if (!ok) {
    const int err = errno;
    std::filesystem::remove(tmp, ec);
    throw tandem::IOError(fmt::format("cannot write {}: {}", tmp, std::strerror(err)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::filesystem::remove(tmp, ec);
    throw tandem::IOError(fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(err)));
  }
}

// --precision fp32|bf16|f16|auto and --opt-level O0..O3 (usage text: kPrecisionUsage). Without
// an opt level, bf16 trains under autocast and f16 under autocast with a GradScaler; with one,
// amp::initialize sets the model and optimizer up (f32 masters at O2) and scale_loss scales.
inline constexpr const char* kPrecisionUsage = "[--precision fp32|bf16|f16|auto] [--opt-level O0|O1|O2|O3]";

class Precision {
 public:
  Precision(const Flags& flags, tandem::nn::Module& model, tandem::optim::Optimizer& opt)
      : name_(flags.str("precision")), opt_level_(flags.str("opt-level")) {
    namespace td = tandem;
    dtype_ = td::amp::parse_precision(name_);
    if (!opt_level_.empty()) {
      // O1..O3 need a low-precision dtype; with --precision fp32 they take the CPU's best.
      const td::DType low = dtype_ == td::kFloat32 ? td::amp::auto_precision() : dtype_;
      amp_ = td::amp::initialize(model, opt, {.opt_level = opt_level_, .dtype = low});
      dtype_ = amp_->opt_level() == td::amp::OptLevel::O0 ? td::kFloat32 : low;
    } else if (td::amp::needs_grad_scaler(dtype_)) {
      scaler_ = std::make_unique<td::amp::GradScaler>();
    }
  }
  // The guard the forward pass (training and evaluation) runs under.
  tandem::amp::autocast forward_guard() const {
    if (amp_) return amp_->forward_autocast();
    const bool low = dtype_ != tandem::kFloat32;
    return tandem::amp::autocast({.dtype = low ? dtype_ : tandem::kBFloat16, .enabled = low});
  }
  tandem::Tensor input(const tandem::Tensor& x) const { return amp_ ? amp_->cast_input(x) : x; }
  // backward + optimizer step, scaled as the setup requires; returns whether it stepped.
  bool backward_step(const tandem::Tensor& loss, tandem::optim::Optimizer& opt) {
    if (amp_) {
      bool overflow;
      {
        auto scaled = tandem::amp::scale_loss(loss, opt);
        scaled.backward();
        overflow = scaled.finish();
      }
      opt.step();  // a no-op after an overflow
      return !overflow;
    }
    if (scaler_) {
      scaler_->scale(loss).backward();
      const bool stepped = scaler_->step(opt);
      scaler_->update();
      return stepped;
    }
    loss.backward();
    opt.step();
    return true;
  }
  std::string describe() const {
    std::string s = std::string(tandem::dtype_name(dtype_));
    if (amp_) s += " amp " + opt_level_;
    if (scaler_) s += " + GradScaler";
    return s;
  }
  const std::string& name() const { return name_; }
  const std::string& opt_level() const { return opt_level_; }
  double loss_scale() const { return amp_ ? amp_->get_scale() : scaler_ ? scaler_->get_scale() : 1.0; }

 private:
  std::string name_, opt_level_;
  tandem::DType dtype_ = tandem::kFloat32;
  std::unique_ptr<tandem::amp::Amp> amp_;
  std::unique_ptr<tandem::amp::GradScaler> scaler_;
};

// Fashion-MNIST images (N, 28, 28) u8 -> f32 normalised with the training set's mean and std.
inline tandem::Tensor normalise_fashion(const tandem::Tensor& images) {
  tandem::Tensor x = images.to(tandem::kFloat32);
  return tandem::ops::mul(tandem::ops::add(tandem::ops::mul(x, 1.0 / 255.0), -0.2860), 1.0 / 0.3530);
}

// optim::update_bn (torch.optim.swa_utils.update_bn) on `batches` mini-batches of the training
// set, in the order the next epoch would draw them: every BatchNorm's running statistics are reset
// and recomputed with the final weights as the plain average over those batches, no gradients, no
// weight change. What eval mode then uses is the statistics of the trained network, not an
// exponential average that lags behind weights still moving at lr 1e-3 ("precise BN": Wu &
// Johnson, Rethinking "Batch" in BatchNorm, 2021). Training data only.
inline void update_bn(tandem::nn::Module& model, const Precision& precision, const tandem::Tensor& x_train,
                      int64_t batches, int64_t batch_size, uint64_t order_seed) {
  namespace td = tandem;
  if (batches <= 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = x_train.size(0);
  const td::Tensor order = permutation(n, order_seed);
  int64_t k = 0;
  auto autocast = precision.forward_guard();
  const int64_t ran = td::optim::update_bn(model, [&] {
    if (k >= batches || k * batch_size >= n) return td::Tensor();
    const td::Tensor idx = order.narrow(0, k * batch_size, std::min(batch_size, n - k * batch_size));
    ++k;
    return precision.input(td::ops::index_select(x_train, 0, idx));
  });
  if (ran == 0) return;
  std::printf("update_bn: BatchNorm statistics recomputed over %lld training batches in %.1f s\n",
              static_cast<long long>(ran), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// The image-classification loop W1 and W2 share: shuffled mini-batches (a fresh Philox
// permutation per epoch), zero_grad / forward / cross_entropy / backward / step, then test
// accuracy in eval mode (after update_bn over `update_bn_batches` training batches when > 0).
struct ClassifierResult {
  double test_accuracy = 0, samples_per_s = 0, train_seconds = 0;
  int64_t steps = 0;
};

inline ClassifierResult train_classifier(tandem::nn::Module& model, tandem::optim::Optimizer& opt, Precision& precision,
                                         const tandem::Tensor& x_train, const tandem::Tensor& y_train,
                                         const tandem::Tensor& x_test, const tandem::Tensor& y_test, int64_t epochs,
                                         int64_t batch_size, uint64_t seed,
                                         int64_t update_bn_batches = 0) {
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
      td::Tensor loss;
      {
        auto autocast = precision.forward_guard();
        loss = td::ops::cross_entropy(model(precision.input(x)), y);
      }
      precision.backward_step(loss, opt);
      seen += idx.numel();
      if (++r.steps % 100 == 0) {
        std::printf("epoch %lld step %lld loss %.4f\n", static_cast<long long>(epoch), static_cast<long long>(r.steps),
                    loss.item());
      }
    }
    r.train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  r.samples_per_s = static_cast<double>(seen) / r.train_seconds;
  update_bn(model, precision, x_train, update_bn_batches, batch_size, seed * 1000003ULL + static_cast<uint64_t>(epochs));
  // ---- evaluate (BatchNorm on its running statistics) ----
  model.eval();
  int64_t correct = 0;
  {
    td::NoGradGuard no_grad;
    auto autocast = precision.forward_guard();
    for (int64_t start = 0; start < x_test.size(0); start += 500) {
      const int64_t len = std::min<int64_t>(500, x_test.size(0) - start);
      const td::Tensor logits = model(precision.input(x_test.narrow(0, start, len)));
      correct += td::ops::count_equal(td::ops::argmax(logits, 1), y_test.narrow(0, start, len));
    }
  }
  r.test_accuracy = static_cast<double>(correct) / static_cast<double>(x_test.size(0));
  return r;
}

// Prints and writes the summary every classifier example reports.
inline void report_classifier(const ClassifierResult& r, const std::string& summary_path, int64_t epochs,
                              int64_t batch_size, int threads, const Precision& precision) {
  const int64_t peak = tandem::peak_allocated_bytes();
  std::printf("test_accuracy %.4f  samples_per_s %.1f  peak_bytes %lld  train_seconds %.2f  precision %s\n",
              r.test_accuracy, r.samples_per_s, static_cast<long long>(peak), r.train_seconds, precision.describe().c_str());
  write_summary(summary_path, {{"test_accuracy", r.test_accuracy}, {"samples_per_s", r.samples_per_s},
                               {"peak_bytes", peak}, {"train_seconds", r.train_seconds}, {"epochs", epochs},
                               {"batch_size", batch_size}, {"threads", threads}, {"steps", r.steps},
                               {"precision", precision.describe()}, {"loss_scale", precision.loss_scale()}});
}

}  // namespace examples
