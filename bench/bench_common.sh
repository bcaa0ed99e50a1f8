# shellcheck shell=bash
# bench_common.sh: the driver parts bench/run_mlp_bench.sh and bench/run_models_bench.sh share.
# Sourced, not run. Each driver sets bench_name (its file name, for messages) before calling
# bench_defaults, parses its flags, then calls bench_check_torch, bench_build TARGET (sets
# bench_bin), bench_env and bench_print_machine.

# The PyTorch yardstick when neither --torch-python nor TORCH_PYTHON names one: the venv that
# bench/setup-torch.sh makes ($TANDEM_TORCH_VENV, else ~/.local/share/tandem/torch-venv, as
# bench/compare looks for it), else /work/torchvenv (where earlier sessions kept theirs).
bench_default_torch_python() {
  local venv="${TANDEM_TORCH_VENV:-$HOME/.local/share/tandem/torch-venv}"
  if [[ -x "$venv/bin/python" ]]; then echo "$venv/bin/python"; else echo /work/torchvenv/bin/python; fi
}

# The repository root and the defaults every driver starts from.
# shellcheck disable=SC2034  # used by the drivers
bench_defaults() {
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  torch_python="${TORCH_PYTHON:-$(bench_default_torch_python)}"
  build_dir="${TANDEM_BUILD_DIR:-build}"
  rounds=2
  seconds=3
  phases=0
  rebuild=0
}

# Makes build_dir absolute and checks that torch_python exists and imports torch.
# shellcheck disable=SC2154  # bench_name: set by the driver
bench_check_torch() {
  [[ "$build_dir" = /* ]] || build_dir="$repo/$build_dir"
  if [[ ! -x "$torch_python" ]]; then
    echo "$bench_name: no PyTorch python at '$torch_python'." >&2
    echo "  Make one with bench/setup-torch.sh (PyPI's torch in a venv outside the repository, where the" >&2
    echo "  benches look by default) or point --torch-python / TORCH_PYTHON at one." >&2
    exit 1
  fi
  if ! "$torch_python" -c 'import torch' 2>/dev/null; then
    echo "$bench_name: '$torch_python' cannot import torch (set --torch-python / TORCH_PYTHON)." >&2
    exit 1
  fi
}

# bench_build TARGET: sets bench_bin to build_dir/bench/TARGET, building it if missing (or with --rebuild).
bench_build() {
  local target="$1"
  bench_bin="$build_dir/bench/$target"
  if [[ ! -x "$bench_bin" || "$rebuild" = 1 ]]; then
    echo "building $target in $build_dir ..." >&2
    if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
      cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_BENCH=ON >/dev/null
    else
      cmake "$build_dir" -DTANDEM_BUILD_BENCH=ON >/dev/null
    fi
    cmake --build "$build_dir" --target "$target" >&2
  fi
}

# One thread everywhere; OpenBLAS (if torch were built on it) on its AVX-512 kernels.
bench_env() {
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TANDEM_NUM_THREADS=1 OPENBLAS_CORETYPE=SkylakeX
}

# Prints the cpu, flags, load average and torch lines. bench_print_machine 1 also notes a
# missing avx512_bf16 on the flags line.
bench_print_machine() {
  local note_avx512_bf16="${1:-0}"
  local cpu_model flags have=() f
  cpu_model="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  flags="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-)"
  for f in amx_bf16 amx_tile amx_int8 avx512_bf16 avx512_fp16 avx512f avx512_vnni avx_vnni; do
    if grep -qw "$f" <<<"$flags"; then have+=("$f"); fi
  done
  local notes
  notes="$(grep -qw amx_bf16 <<<"$flags" || echo '  [no AMX]')"
  if [[ "$note_avx512_bf16" = 1 ]]; then
    notes+="$(grep -qw avx512_bf16 <<<"$flags" || echo '  [no avx512_bf16]')"
  fi
  echo "cpu: $cpu_model ($(getconf _NPROCESSORS_ONLN) logical cores visible)"
  echo "flags: ${have[*]:-none of amx_bf16/avx512_bf16/avx512f}$notes"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "torch: $("$torch_python" -c 'import torch; print(torch.__version__, "capability", torch.backends.cpu.get_cpu_capability())')"
}
