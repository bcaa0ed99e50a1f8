#!/usr/bin/env bash
# Installs every Debian package Tandem's build and tests need. Idempotent: packages already
# installed are skipped, so a second run does nothing and needs no network.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libdnnl-dev ocl-icd-opencl-dev   # oneDNN (GEMM, conv); its CMake config needs OpenCL
  zlib1g-dev                       # gzip'd IDX files
  libgtest-dev libbenchmark-dev nlohmann-json3-dev libfmt-dev
  dataset-fashion-mnist            # real data: /usr/share/datasets/fashion-mnist
  python3-torch                    # the test oracle (/usr/bin/python3)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q || echo "install-deps: apt-get update failed; trying the cached lists"
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
