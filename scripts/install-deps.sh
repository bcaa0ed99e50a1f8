#!/usr/bin/env bash
# Installs every Debian package Tandem's build and tests need, then the Python tools some tests
# use that Debian does not package, into the venv .venv-test (from PyPI). Idempotent: packages
# already installed are skipped, so a second run does nothing and needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++ pkg-config
  libdnnl-dev ocl-icd-opencl-dev   # oneDNN (GEMM, conv); its CMake config needs OpenCL
  zlib1g-dev                       # gzip'd IDX files
  libopenmpi-dev openmpi-bin       # the mpi process-group backend and mpirun (tests/dist)
  libgloo-dev                      # the gloo process-group backend (comparison)
  libgtest-dev libbenchmark-dev nlohmann-json3-dev libfmt-dev
  dataset-fashion-mnist            # real data: /usr/share/datasets/fashion-mnist
  python3-torch                    # the test oracle (/usr/bin/python3)
  python3-venv                     # .venv-test below
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q || echo "install-deps: apt-get update failed; trying the cached lists"
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# ---- Python tools from PyPI, in .venv-test ----
# safetensors (the reference reader/writer for tests/oracle/safetensors_oracle_test.cc). The venv
# sees the system site packages so that Debian's torch and numpy stay importable from it.
venv=.venv-test
if [[ ! -x $venv/bin/python ]]; then
  echo "install-deps: creating $venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
if "$venv/bin/python" -c 'import safetensors' 2>/dev/null; then
  echo "install-deps: $venv has safetensors"
else
  echo "install-deps: installing safetensors into $venv"
  "$venv/bin/pip" install -q safetensors
fi
# tensorboard: tests/train/metrics_test.cc reads Tandem's event files back with its reader.
if "$venv/bin/python" -c 'import tensorboard' 2>/dev/null; then
  echo "install-deps: $venv has tensorboard"
else
  echo "install-deps: installing tensorboard into $venv"
  "$venv/bin/pip" install -q tensorboard
fi
