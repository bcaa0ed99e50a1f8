#!/usr/bin/env bash
# Tandem vs PyTorch, side by side, on one thread: the W2 CNN training step (batch 64, AdamW) and
# the W3 GPT training step (batch 8 x context 128, AdamW), each in f32 and bf16 (autocast in
# PyTorch, its hand-built equivalent in Tandem). Prints the CPU, then a table.
#
#   bench/run_models_bench.sh [--torch-python PY] [--build-dir DIR] [--rounds R] [--seconds S]
#                             [--workload cnn|gpt] [--dtype f32|bf16] [--phases] [--rebuild]
#
#   --torch-python PY  python with PyPI's torch (default $TORCH_PYTHON, else bench/setup-torch.sh's venv)
#   --build-dir DIR    Tandem build folder (default $TANDEM_BUILD_DIR, else build); the
#                      models_step_bench target is built there if missing (or with --rebuild)
#   --rounds R         alternate Tandem and PyTorch R times and keep each one's best round (default 2)
#   --seconds S        timed seconds per workload per round (default 3, at least 10 steps)
#   --workload W       only cnn or only gpt (default both)
#   --dtype D          only f32 or only bf16 (default both)
#   --phases           also print each side's per-phase step breakdown and its time inside GEMM and
#                      convolution calls (Tandem: kernel timers; PyTorch: torch.profiler self time),
#                      and that time's rate against this core's measured peak (the "env" line's
#                      f32_fma_peak_gflops; for bf16 the rate of the way bf16 products run, its
#                      bf16_products: the FMA peak when widened, bf16_dot_peak_gflops when native)
#                      with the ratio the step would reach at it
#
# Every (workload, dtype, side) runs in a process of its own, so that the peak-RSS figure is that
# pair's alone. Columns: "wall" figures come from the median wall time per step; "cpu" figures
# from the median process CPU time per step, which on a busy shared machine is the steadier of
# the two (one thread: CPU time is the work, without the time other processes held the core).
# "peak tensors": live tensor bytes at the step's high-water mark, less the input-batch pool —
# Tandem's peak_allocated_bytes() over the timed steps, PyTorch's parameters + buffers +
# optimizer state plus the peak of its CPU allocator events (torch.profiler, profile_memory) over
# one step. "RSS delta": growth of the process's peak resident set (getrusage ru_maxrss) from the
# end of setup to the end of the run (first-step footprint + allocator caches, scratchpads, JIT
# code). Memory figures are the last round's. The PyTorch here is only a yardstick: tests and CI
# never use it.
set -euo pipefail

bench_name=run_models_bench.sh
# shellcheck source=bench/bench_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_defaults
workloads=(cnn gpt)
dtypes=(f32 bf16)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-python) torch_python="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --workload) workloads=("$2"); shift 2 ;;
    --dtype) dtypes=("$2"); shift 2 ;;
    --phases) phases=1; shift ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_models_bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
bench_check_torch
bench_build models_step_bench
bench_env
bench_print_machine 1
extra=()
[[ "$phases" = 1 ]] && extra+=(--phases)
echo "command: OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TANDEM_NUM_THREADS=1 OPENBLAS_CORETYPE=SkylakeX; for W in ${workloads[*]}; for D in ${dtypes[*]}: $bench_bin --threads 1 --seconds $seconds --workload \$W --dtype \$D ${extra[*]-}; $torch_python bench/torch_models_step.py --threads 1 --seconds $seconds --workload \$W --dtype \$D ${extra[*]-}; x$rounds rounds"
echo

out="$(mktemp)"
torch_log="$(mktemp)"
trap 'rm -f "$out" "$torch_log"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  for w in "${workloads[@]}"; do
    for d in "${dtypes[@]}"; do
      echo "round $r/$rounds: $w $d tandem ..." >&2
      "$bench_bin" --threads 1 --seconds "$seconds" --workload "$w" --dtype "$d" ${extra[@]+"${extra[@]}"} >>"$out"
      echo "round $r/$rounds: $w $d torch ..." >&2
      # torch.profiler (the memory figure) chats on stderr; keep it out of the table.
      if ! "$torch_python" "$repo/bench/torch_models_step.py" --threads 1 --seconds "$seconds" --workload "$w" \
          --dtype "$d" ${extra[@]+"${extra[@]}"} >>"$out" 2>"$torch_log"; then
        cat "$torch_log" >&2
        exit 1
      fi
    done
  done
done

"$torch_python" - "$out" <<'PY'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
best = {}  # (workload, impl) -> highest wall and cpu figures over rounds, last round's memory
for r in rows:
    if r["name"] not in ("cnn_step", "gpt_step"):
        continue
    key = (r["name"].replace("_step", ""), r["dtype"])
    k = (key, r["impl"])
    prev = best.get(k)
    best[k] = {"unit": r["unit"], "wall": max(r["per_s"], prev["wall"]) if prev else r["per_s"],
               "cpu": max(r["per_s_cpu"], prev["cpu"]) if prev else r["per_s_cpu"],
               "peak": r["peak_tensor_mb"], "rss": r["maxrss_delta_mb"],
               "shape": f"b={r['batch']}" + (f",T={r['context']}" if r["context"] else "")}

order = []
for (key, _impl) in best:
    if key not in order:
        order.append(key)
hdr = (f"{'workload':<16} {'dtype':<5} {'unit':<10} {'Tandem':>8} {'PyTorch':>8} {'T/P':>5}   "
       f"{'Tandem':>8} {'PyTorch':>8} {'T/P':>5}   {'Tandem':>7} {'PyTorch':>7}   {'Tandem':>7} {'PyTorch':>7}")
print(f"{'':<33} {'-------- cpu --------':>23}   {'-------- wall -------':>23}   "
      f"{'peak tensors MiB':>15}   {'RSS delta MiB':>15}")
print(hdr)
print("-" * len(hdr))
for key in order:
    t, p = best.get((key, "tandem")), best.get((key, "torch"))
    if not t or not p:
        continue
    name = f"{key[0]} ({t['shape']})"
    print(f"{name:<16} {key[1]:<5} {t['unit']:<10} {t['cpu']:>8.1f} {p['cpu']:>8.1f} {t['cpu'] / p['cpu']:>5.2f}   "
          f"{t['wall']:>8.1f} {p['wall']:>8.1f} {t['wall'] / p['wall']:>5.2f}   "
          f"{t['peak']:>7.1f} {p['peak']:>7.1f}   {t['rss']:>7.1f} {p['rss']:>7.1f}")

last = {}
for r in rows:
    if r["name"].endswith("_phases"):
        last[(r["name"].replace("_step_phases", ""), r["dtype"], r["impl"])] = r
if last:
    print("\nstep phases, ms/step (last round; process CPU time):")
    cols = ["zero_grad", "forward", "loss", "backward", "optimizer"]
    print(f"  {'workload':<8} {'dtype':<5} {'impl':<7} " + " ".join(f"{c:>10}" for c in cols) + f" {'allocs/step':>12}")
    for key in order:
        for impl in ("tandem", "torch"):
            r = last.get((key[0], key[1], impl))
            if r:
                allocs = f"{r['allocs_per_step']:.0f}" if "allocs_per_step" in r else "-"
                print(f"  {key[0]:<8} {key[1]:<5} {impl:<7} " + " ".join(f"{r[c + '_ms']:>10.3f}" for c in cols)
                      + f" {allocs:>12}")
    def env_peak(field):
        peaks = [r[field] for r in rows if r["name"] == "env" and r.get(field)]
        return max(peaks) if peaks else 0.0
    # bf16 runs at the rate of the way Tandem chose (the env line's bf16_products): widened to
    # f32 on the FMAs, native on VDPBF16PS, amx on tiles this does not measure (0).
    bf16_way = next((r["bf16_products"] for r in reversed(rows) if r["name"] == "env" and "bf16_products" in r), "native")
    peak_of = {"f32": env_peak("f32_fma_peak_gflops"),
               "bf16": {"widened": env_peak("f32_fma_peak_gflops"), "amx": 0.0}.get(bf16_way,
                                                                                  env_peak("bf16_dot_peak_gflops"))}
    print("\nmatrix products (GEMM + convolution calls) in the same phase runs, ms/step; \"ceiling\": PyTorch's"
          "\nbest median cpu step over Tandem's GEMM + convolution time, the ratio Tandem would reach if"
          "\neverything else took no time. \"%peak\": Tandem's GEMM + convolution rate over this core's measured"
          f"\npeak (f32: {peak_of['f32']:.1f} GFLOP/s, 12 chains of FMAs; bf16: {peak_of['bf16']:.1f} GFLOP/s, the"
          f"\nrate of the way bf16 products run here ({bf16_way}): FMAs when widened, 12 chains of VDPBF16PS when"
          "\nnative, 0 = not measured: AMX, whose tiles it does not measure);"
          "\n\"at peak\": the ratio if all of them ran at that peak and everything else took the time it takes now:")
    print(f"  {'workload':<8} {'dtype':<5} {'T gemm':>8} {'GF/s':>6} {'T conv':>8} {'GF/s':>6} {'P gemm':>8} {'P conv':>8}"
          f" {'ceiling':>8} {'%peak':>6} {'at peak':>8}")
    for key in order:
        t, p = last.get((key[0], key[1], "tandem")), last.get((key[0], key[1], "torch"))
        if not t or not p or "gemm_ms" not in t:
            continue
        p_step_ms = min(r["step_ms_cpu_median"] for r in rows if r["name"] == f"{key[0]}_step"
                        and r["impl"] == "torch" and r["dtype"] == key[1])
        tm = t["gemm_ms"] + t["conv_ms"]
        pct = at_peak = "-"
        peak = peak_of.get(key[1], 0.0)
        if peak > 0 and tm > 0:
            # GEMM and convolution together: both are multiply-adds on the same units (under bf16
            # autocast every GEMM and convolution of these models runs in bf16).
            t_step_ms = statistics.median(r["step_ms_cpu_median"] for r in rows if r["name"] == f"{key[0]}_step"
                                          and r["impl"] == "tandem" and r["dtype"] == key[1])
            gflop = (t["gemm_ms"] * t["gemm_gflops"] + t["conv_ms"] * t["conv_gflops"]) / 1e3
            at_peak_ms = 1e3 * gflop / peak
            pct = f"{100 * (1e3 * gflop / tm) / peak:.0f}%"
            at_peak = f"{p_step_ms / (t_step_ms - tm + at_peak_ms):.2f}x"
        print(f"  {key[0]:<8} {key[1]:<5} {t['gemm_ms']:>8.2f} {t['gemm_gflops']:>6.1f} {t['conv_ms']:>8.2f}"
              f" {t['conv_gflops']:>6.1f} {p['gemm_ms']:>8.2f} {p['conv_ms']:>8.2f} {p_step_ms / tm if tm else float('nan'):>7.2f}x"
              f" {pct:>6} {at_peak:>8}")

print("\nraw JSON lines:")
for r in rows:
    print(json.dumps(r))
PY
