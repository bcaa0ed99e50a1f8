// Shared by the examples: flag parsing, shuffling, the JSON summary. Examples are what a user
// writes; this header only keeps their boilerplate out of the way.
#pragma once

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

}  // namespace examples
