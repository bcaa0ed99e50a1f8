#!/usr/bin/env bash
# Tandem DDP (shm backend) vs PyTorch DDP (gloo), side by side in one run: W1, W2, W3 x f32 and
# bf16 (autocast) x 1 and 2 processes, one thread and one core per process. Prints a table:
# global samples/s (tokens/s for W3), the Tandem/PyTorch ratio and each side's 2p/1p scaling,
# then the same from CPU time (rank 0's process CPU per step, all its threads), which is what
# to compare on a shared machine: "cpu ratio" = PyTorch cpu/step over Tandem's, "cpu 2p/1p" =
# N x cpu/step at 1p over cpu/step at N (the scaling if each rank had its core to itself).
#
#   bench/run_ddp_bench.sh [--torch-python PY] [--build-dir DIR] [--seconds S] [--rounds R]
#                          [--workload w1|w2|w3] [--dtype f32|bf16] [--nprocs "1 2"] [--rebuild] [--pair]
#                          [--comm-hook none|fp16|bf16|powersgd|localsgd] [--powersgd-rank R] [--bucket-cap-mb MB]
#                          [--fused-optimizer]
#
# --comm-hook registers the same communication hook on both sides (PowerSGD: the given rank,
# from the 3rd iteration on, error feedback and warm start; localsgd: post-local SGD from the 3rd
# iteration, each rank's own gradients, parameters averaged every 4 steps). --bucket-cap-mb sets both sides'
# bucket size, the first bucket's too (torch 2.x does so when bucket_cap_mb is given); torch's
# PowerSGD over gloo needs a single bucket (bench/torch_ddp_step.py). --fused-optimizer steps the
# optimizer inside backward on both sides (Tandem's register_fused_optimizer, torch's
# _register_fused_optim).
#
# --pair also runs, per side, two independent 1-process runs at once (one per core, no
# communication) and prints their CPU per step against a 1-process run alone: how much the two
# cores slow each other down (memory, caches, the host), which bounds 2p/1p whatever DDP does —
# through the slower of the two, since every DDP step waits for its slowest rank.
#
# Each configuration runs R times per side, alternating, keeping each side's best. The PyTorch
# here is only a yardstick (PyPI's torch in a venv outside the repo): tests and CI never use it.
set -euo pipefail

bench_name=run_ddp_bench.sh
# shellcheck source=bench/bench_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_defaults
rounds=1
workloads=(w1 w2 w3)
dtypes=(f32 bf16)
nprocs=(1 2)
pair=0
hook_args=()
tandem_args=()
torch_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-python) torch_python="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --workload) workloads=("$2"); shift 2 ;;
    --dtype) dtypes=("$2"); shift 2 ;;
    --nprocs) read -r -a nprocs <<<"$2"; shift 2 ;;
    --rebuild) rebuild=1; shift ;;
    --pair) pair=1; shift ;;
    --comm-hook) hook_args+=(--comm-hook "$2"); shift 2 ;;
    --powersgd-rank) hook_args+=(--powersgd-rank "$2"); shift 2 ;;
    --fused-optimizer) tandem_args+=(--fused-optimizer); torch_args+=(--fused-optimizer); shift ;;
    --bucket-cap-mb) tandem_args+=(--bucket-cap-mb "$2" --first-bucket-mb "$2"); torch_args+=(--bucket-cap-mb "$2"); shift 2 ;;
    -h|--help) sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_ddp_bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
bench_check_torch
bench_build ddp_step_bench
bench_env
bench_print_machine 1
echo "command: for W in ${workloads[*]}; for D in ${dtypes[*]}; for N in ${nprocs[*]}: $bench_bin --workload \$W --dtype \$D --nproc \$N --seconds $seconds ${hook_args[*]} ${tandem_args[*]}; $torch_python bench/torch_ddp_step.py --workload \$W --dtype \$D --nproc \$N --seconds $seconds ${hook_args[*]} ${torch_args[*]}; x$rounds rounds"
echo

out="$(mktemp)"
pairout="$(mktemp)"
torch_err="$(mktemp)"
trap 'rm -f "$out" "$pairout" "$pairout.0" "$pairout.1" "$torch_err"' EXIT
# One PyTorch run. torch_ddp_step.py picks a free port and closes it before gloo binds it, so
# another process can take it in between (seen once in a whole table): a failed run is retried
# once, and a second failure prints PyTorch's error and stops the table.
torch_run() {
  local attempt
  for attempt in 1 2; do
    if "$torch_python" "$repo/bench/torch_ddp_step.py" --workload "$1" --dtype "$2" --nproc "$3" \
         --seconds "$seconds" "${hook_args[@]}" "${torch_args[@]}" 2>"$torch_err"; then
      return 0
    fi
    echo "run_ddp_bench.sh: PyTorch $1 $2 ${3}p failed (attempt $attempt of 2):" >&2
    tail -n 5 "$torch_err" >&2
  done
  return 1
}
for ((r = 1; r <= rounds; ++r)); do
  for w in "${workloads[@]}"; do
    for d in "${dtypes[@]}"; do
      for n in "${nprocs[@]}"; do
        echo "round $r/$rounds: $w $d ${n}p tandem ..." >&2
        "$bench_bin" --workload "$w" --dtype "$d" --nproc "$n" --seconds "$seconds" "${hook_args[@]}" "${tandem_args[@]}" >>"$out"
        echo "round $r/$rounds: $w $d ${n}p torch ..." >&2
        torch_run "$w" "$d" "$n" >>"$out"
      done
      if [[ "$pair" = 1 ]]; then
        echo "round $r/$rounds: $w $d pair (two 1p runs at once) tandem, torch ..." >&2
        # Each run of a pair writes its own file: two processes appending to one file can
        # interleave their lines (seen once: two JSON objects on one line).
        for c in 0 1; do
          taskset -c "$c" "$bench_bin" --workload "$w" --dtype "$d" --nproc 1 --seconds "$seconds" >"$pairout.$c" &
        done
        wait
        cat "$pairout.0" "$pairout.1" >>"$pairout"
        for c in 0 1; do
          taskset -c "$c" "$torch_python" "$repo/bench/torch_ddp_step.py" --workload "$w" --dtype "$d" --nproc 1 \
            --seconds "$seconds" >"$pairout.$c" 2>/dev/null &
        done
        wait
        cat "$pairout.0" "$pairout.1" >>"$pairout"
      fi
    done
  done
done

python3 - "$out" "$pairout" <<'PY'
import json, sys
best, cpu = {}, {}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    key = (d["workload"], d["dtype"], d["nproc"], d["impl"])
    if key not in best or d["samples_per_s"] > best[key]["samples_per_s"]:
        best[key] = d
    if key not in cpu or d["cpu_step_ms"] < cpu[key]:
        cpu[key] = d["cpu_step_ms"]
names = {"w1": "W1 MLP", "w2": "W2 CNN", "w3": "W3 GPT"}
print(f"{'workload':8} {'dtype':5} {'procs':>5} {'Tandem':>12} {'PyTorch':>12} {'ratio':>6} {'T 2p/1p':>8} {'P 2p/1p':>8}")
for (w, dt, n, impl), d in sorted(best.items()):
    if impl != "tandem":
        continue
    t = d["samples_per_s"]
    p = best.get((w, dt, n, "torch"), {}).get("samples_per_s")
    unit = "samples/s" if w != "w3" else "samples/s"
    def scaling(which):
        one = best.get((w, dt, 1, which), {}).get("samples_per_s")
        cur = best.get((w, dt, n, which), {}).get("samples_per_s")
        return f"{cur / one:.2f}x" if (one and cur and n != 1) else ""
    ratio = f"{t / p:.2f}x" if p else "-"
    ps = f"{p:12.1f}" if p else f"{'-':>12}"
    print(f"{names[w]:8} {dt:5} {n:5d} {t:12.1f} {ps} {ratio:>6} {scaling('tandem'):>8} {scaling('torch'):>8}")
print("(samples/s of the global batch; W3 samples are 128-token sequences)")
print()
print(f"{'workload':8} {'dtype':5} {'procs':>5} {'T cpu ms':>9} {'P cpu ms':>9} {'cpu ratio':>9} {'T cpu 2p/1p':>11} {'P cpu 2p/1p':>11}")
for (w, dt, n, impl), c in sorted(cpu.items()):
    if impl != "tandem":
        continue
    p = cpu.get((w, dt, n, "torch"))
    def cpu_scaling(which):
        one, cur = cpu.get((w, dt, 1, which)), cpu.get((w, dt, n, which))
        return f"{n * one / cur:.2f}x" if (one and cur and n != 1) else ""
    ratio = f"{p / c:.2f}x" if p else "-"
    ps = f"{p:9.2f}" if p else f"{'-':>9}"
    print(f"{names[w]:8} {dt:5} {n:5d} {c:9.2f} {ps} {ratio:>9} {cpu_scaling('tandem'):>11} {cpu_scaling('torch'):>11}")
print("(CPU ms per step of rank 0's process, best of the rounds; same per-rank batch on both sides)")
pairs = {}
for line in open(sys.argv[2]):
    if line.startswith("{"):
        d = json.loads(line)
        pairs.setdefault((d["workload"], d["dtype"], d["impl"]), []).append(d["cpu_step_ms"])
if pairs:
    print()
    print(f"{'workload':8} {'dtype':5} {'impl':>6} {'alone ms':>9} {'paired ms':>9} {'slower ms':>9} {'slowdown':>8}"
          f" {'2p/1p ceiling':>13}")
    for (w, dt, impl), runs in sorted(pairs.items()):
        alone = cpu.get((w, dt, 1, impl))
        paired = sum(runs) / len(runs)
        # The two runs of one round are consecutive lines; DDP steps at the pace of its slower
        # rank, so the bound uses each round's slower run (the best such round).
        slower = min(max(runs[i:i + 2]) for i in range(0, len(runs) - 1, 2)) if len(runs) >= 2 else paired
        if alone:
            print(f"{names[w]:8} {dt:5} {impl:>6} {alone:9.2f} {paired:9.2f} {slower:9.2f} {slower / alone:7.2f}x"
                  f" {2 * alone / slower:12.2f}x")
    print("(two independent 1-process runs at once, one per core: CPU ms per step, the mean of all runs and the"
          "\n slower run of the best round; slowdown and ceiling = 2 x alone / slower use the slower run, since"
          "\n synchronous data parallelism waits for its slowest rank every step)")
PY
