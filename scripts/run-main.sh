#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, and run `tandem train` with no
# config — W1, the embedded default: the 784-1024-1024-10 MLP on Fashion-MNIST, one epoch on one
# thread, to >= 85% test accuracy. It draws a progress bar on a terminal (plain lines otherwise)
# and leaves in $build_dir/runs/default: metrics.jsonl, tensorboard/events.out.tfevents.*,
# checkpoints/step_N/ and summary.json; the summary is printed at the end (and copied to
# $build_dir/summary.json). Extra arguments go to `tandem train` (e.g. --set seed=1,
# --config configs/cnn_bf16.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
build_dir=${TANDEM_BUILD_DIR:-build}
out="$build_dir/runs/default"
rm -rf "$out"
"$build_dir/tools/tandem" train --out "$out" --summary-json "$build_dir/summary.json" "$@"
cat "$build_dir/summary.json"
