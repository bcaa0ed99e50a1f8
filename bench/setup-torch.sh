#!/usr/bin/env bash
# Makes the PyTorch that bench/compare measures against: a Python venv OUTSIDE the repository with
# PyPI's torch (the build PyTorch users install: MKL + oneDNN on CPU) and numpy. For benchmarks
# only — tests and CI use Debian's python3-torch (/usr/bin/python3), never this venv.
#
#   bench/setup-torch.sh [DIR]
#
# DIR defaults to $TANDEM_TORCH_VENV, else ~/.local/share/tandem/torch-venv — where bench/compare
# looks for it. Extra pip arguments can go in $PIP_ARGS (e.g. an --index-url for a mirror).
# Note: on x86-64 Linux PyPI's torch pulls its CUDA libraries too (a few GB), even on a CPU-only box.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-${TANDEM_TORCH_VENV:-$HOME/.local/share/tandem/torch-venv}}"
dir="$(realpath -m "$dir")"
case "$dir/" in
  "$repo"/*) echo "setup-torch.sh: $dir is inside the repository ($repo); pick a directory outside it" >&2; exit 2 ;;
esac
if [[ ! -x "$dir/bin/python" ]]; then
  echo "setup-torch.sh: creating the venv $dir" >&2
  mkdir -p "$(dirname "$dir")"
  python3 -m venv "$dir"
fi
# shellcheck disable=SC2086  # PIP_ARGS: words on purpose
"$dir/bin/pip" install --upgrade ${PIP_ARGS:-} torch numpy
"$dir/bin/python" -c 'import torch; print("torch", torch.__version__, "at", torch.__file__)'
echo "setup-torch.sh: done; bench/compare picks it up (or: bench/compare --torch-python $dir/bin/python)"
