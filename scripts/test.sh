#!/usr/bin/env bash
# All tests on a fresh machine: install dependencies, build, run every CTest suite (unit and
# PyTorch-oracle tests). Extra arguments go to ctest (e.g. -L unit, -R Autograd).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
build_dir=${TANDEM_BUILD_DIR:-build}
# One thread per test process: the machine has two cores and ctest runs two tests at a time.
export TANDEM_NUM_THREADS=${TANDEM_NUM_THREADS:-1}
ctest --test-dir "$build_dir" --output-on-failure --timeout 900 -j "$(nproc)" "$@"
