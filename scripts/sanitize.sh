#!/usr/bin/env bash
# Builds Tandem and its tests with a sanitizer into build-<kind>/ (RelWithDebInfo, no benchmarks,
# no CUDA/MPI/gloo backends) and runs CTest there; a sanitizer report fails the test.
#
#   scripts/sanitize.sh address [ctest arguments]   ASan + UBSan
#   scripts/sanitize.sh thread  [ctest arguments]   TSan
#
# Without ctest arguments it runs the threaded and multi-process suites (DDP, SyncBatchNorm, the
# process groups, the store, the data loader); e.g. `scripts/sanitize.sh address -L unit` runs
# every unit test (slow: tens of minutes on two cores). Not part of .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-}
case "$kind" in
  address) flags="address,undefined" ;;
  thread) flags="thread" ;;
  *)
    echo "usage: scripts/sanitize.sh address|thread [ctest arguments]; got '${kind}': address is ASan + UBSan, thread is TSan" >&2
    exit 2
    ;;
esac
shift
dir=build-$kind
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_SANITIZE="$flags" -DTANDEM_BUILD_BENCH=OFF \
  -DTANDEM_WITH_CUDA=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_GLOO=OFF >/dev/null
cmake --build "$dir" --parallel "$(nproc)"
# Leak checking is off: oneDNN keeps its JIT code and primitive caches until exit.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# TSan: oneDNN's OpenMP threads are suppressed (scripts/tsan.supp says why); die_after_fork=0
# lets the tests that fork a child from a threaded process (killed-during-save) run.
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:suppressions=$PWD/scripts/tsan.supp}
if [ $# -eq 0 ]; then
  # (Parameterised suites are named Prefix/Suite.Test: the optional prefix lets them match too.)
  set -- -R '^([A-Za-z]+/)?((DDP|DDPSemantics|DDPJoin|DDPPowerSGD|DDPFusedOptimizer|PostLocalSGD|PostLocalSGDOptimizer|PeriodicModelAverager|HierarchicalModelAverager|SyncBatchNorm|Shm[A-Za-z]*|Work|InitProcessGroup|PrefixStore|StoreContract|FileStore|TCPStore|Spawn|DataLoader)\.|Checkpoint\.Gathered)'
fi
ctest --test-dir "$dir" --output-on-failure "$@"
