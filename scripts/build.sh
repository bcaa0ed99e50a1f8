#!/usr/bin/env bash
# Configures and builds Tandem (Release, Ninja) into ./build, or $TANDEM_BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${TANDEM_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" --parallel "$(nproc)"
