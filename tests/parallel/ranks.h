// What the parallel tests share: running a test body on ranks forked over shm.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "tandem/core/error.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/spawn.h"

namespace tandem::testing {

using RankFn = std::function<void(std::shared_ptr<dist::ProcessGroup>)>;

// Runs fn(group) on n forked ranks over `backend` (shm unless given), one thread each; rethrows
// the first rank's failure. spawn_timeout bounds the whole run, group_timeout every collective.
inline void on_ranks(int n, const RankFn& fn, std::chrono::seconds spawn_timeout, std::chrono::seconds group_timeout,
                     const std::string& backend = "shm") {
  dist::SpawnOptions options;
  options.timeout = spawn_timeout;
  options.env["TANDEM_NUM_THREADS"] = "1";
  options.env["OMP_NUM_THREADS"] = "1";
  dist::spawn(
      n,
      [&](int) {
        auto group = dist::init_process_group({.backend = backend, .timeout = group_timeout});
        fn(group);
        dist::destroy_process_group();
      },
      options);
}

// A rank's failure, as an exception the spawner reports.
[[noreturn]] inline void fail(const std::string& what) { throw Error(what); }

// Norm-wise relative difference ||a - b|| / ||b|| (f64), the "rel" of the acceptance criteria.
inline double rel_diff(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(kFloat64).contiguous(), y = b.to(kFloat64).contiguous();
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = x.data_ptr<double>()[i] - y.data_ptr<double>()[i];
    num += d * d;
    den += y.data_ptr<double>()[i] * y.data_ptr<double>()[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Same shape and the same bytes.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  Tensor x = a.contiguous(), y = b.contiguous();
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.nbytes())) == 0;
}

// Whether `t` holds the same bytes on every rank of `group` (a collective).
inline bool same_everywhere(dist::ProcessGroup& group, const Tensor& t) {
  Tensor c = t.contiguous();
  Tensor all = empty({c.numel() * group.size()}, c.dtype());
  group.all_gather(dist::as_buffer(all), dist::as_buffer(c))->wait();
  const size_t bytes = static_cast<size_t>(c.nbytes());
  const auto* base = static_cast<const char*>(all.data_ptr());
  for (int r = 1; r < group.size(); ++r) {
    if (std::memcmp(base, base + r * bytes, bytes) != 0) return false;
  }
  return true;
}

}  // namespace tandem::testing
