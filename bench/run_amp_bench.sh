#!/usr/bin/env bash
# Issue #5's closing benchmark: W1 (MLP step, batch 128, SGD), W2 (CNN step, batch 64, AdamW) and
# W3 (GPT step, batch 8 x context 128, AdamW) with bf16 autocast — Tandem's amp::autocast and
# torch.autocast("cpu", dtype=torch.bfloat16) — side by side in one run, one thread each, with
# the f32 step as a reference line. Prints items/s (median wall and CPU time per step) and the
# Tandem/PyTorch ratio.
#
#   bench/run_amp_bench.sh [--torch-python PY] [--build-dir DIR] [--rounds R] [--seconds S] [--rebuild]
#
# Defaults as in run_models_bench.sh (torch: $TORCH_PYTHON or bench/setup-torch.sh's venv; build
# dir: $TANDEM_BUILD_DIR or build). Each (workload, dtype, side) runs in its own process; the best
# of R rounds is kept. ONEDNN_VERBOSE=1 on a Tandem run shows which ISA the bf16 GEMMs use
# (avx512_core_amx on a CPU with AMX). The PyTorch here is a yardstick only; tests never use it.
set -euo pipefail

bench_name=run_amp_bench.sh
# shellcheck source=bench/bench_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_defaults
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-python) torch_python="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_amp_bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
bench_check_torch
bench_build mlp_step_bench
mlp_bin="$bench_bin"
bench_build models_step_bench
models_bin="$bench_bin"
bench_env
bench_print_machine 1
echo

out="$(mktemp)"
torch_log="$(mktemp)"
trap 'rm -f "$out" "$torch_log"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  for d in autocast f32; do
    echo "round $r/$rounds: W1 $d ..." >&2
    "$mlp_bin" --threads 1 --seconds "$seconds" --only mlp --dtype "$d" >>"$out"
    "$torch_python" "$repo/bench/torch_mlp_step.py" --threads 1 --seconds "$seconds" --only mlp --dtype "$d" >>"$out" 2>"$torch_log" || { cat "$torch_log" >&2; exit 1; }
    for w in cnn gpt; do
      echo "round $r/$rounds: $w $d ..." >&2
      "$models_bin" --threads 1 --seconds "$seconds" --workload "$w" --dtype "$d" >>"$out"
      "$torch_python" "$repo/bench/torch_models_step.py" --threads 1 --seconds "$seconds" --workload "$w" --dtype "$d" >>"$out" 2>"$torch_log" || { cat "$torch_log" >&2; exit 1; }
    done
  done
done

"$torch_python" - "$out" <<'PY'
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
best = {}
for r in rows:
    if r["name"] == "mlp_step":
        key, unit, wall, cpu = ("W1 mlp", r["dtype"]), "samples/s", r["samples_per_s"], r["samples_per_s_cpu"]
    elif r["name"] in ("cnn_step", "gpt_step"):
        key = ("W2 cnn" if r["name"] == "cnn_step" else "W3 gpt", r["dtype"])
        unit, wall, cpu = r["unit"], r["per_s"], r["per_s_cpu"]
    else:
        continue
    k = (key, r["impl"])
    prev = best.get(k)
    best[k] = {"unit": unit, "wall": max(wall, prev["wall"]) if prev else wall, "cpu": max(cpu, prev["cpu"]) if prev else cpu}
hdr = f"{'workload':<8} {'dtype':<9} {'unit':<10} {'Tandem':>9} {'PyTorch':>9} {'T/P':>5}   {'Tandem':>9} {'PyTorch':>9} {'T/P':>5}"
print(f"{'':<29} {'---------- wall -----------':>27}   {'----------- cpu -----------':>27}")
print(hdr)
print("-" * len(hdr))
for w in ("W1 mlp", "W2 cnn", "W3 gpt"):
    for d in ("autocast", "f32"):
        t, p = best.get(((w, d), "tandem")), best.get(((w, d), "torch"))
        if t and p:
            print(f"{w:<8} {d:<9} {t['unit']:<10} {t['wall']:>9.1f} {p['wall']:>9.1f} {t['wall'] / p['wall']:>5.2f}   "
                  f"{t['cpu']:>9.1f} {p['cpu']:>9.1f} {t['cpu'] / p['cpu']:>5.2f}")
print("\nraw JSON lines:")
for r in rows:
    print(json.dumps(r))
PY
