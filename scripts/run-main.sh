#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, train the Fashion-MNIST MLP
# (one epoch, one thread) and write its summary to build/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
build_dir=${TANDEM_BUILD_DIR:-build}
"$build_dir/examples/fashion_mnist_mlp" --summary-json "$build_dir/summary.json" "$@"
cat "$build_dir/summary.json"
