// What the parallel tests share: running a test body on ranks forked over shm.
#pragma once

#include <chrono>
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

}  // namespace tandem::testing
