#!/usr/bin/env bash
# Tandem vs PyTorch, side by side, on one thread: the W1 MLP training step (f32 and bf16
# autocast) and the 1024^3 linear GEMM (f32 and bf16). Prints the CPU, then a table.
#
#   bench/run_mlp_bench.sh [--torch-python PY] [--build-dir DIR] [--rounds R] [--seconds S]
#                          [--phases] [--rebuild]
#
#   --torch-python PY  python with PyPI's torch (default $TORCH_PYTHON, else bench/setup-torch.sh's venv)
#   --build-dir DIR    Tandem build folder (default $TANDEM_BUILD_DIR, else build); the
#                      mlp_step_bench target is built there if missing (or with --rebuild)
#   --rounds R         alternate Tandem and PyTorch R times and keep each one's best round (default 2)
#   --seconds S        timed seconds per workload per round (default 3)
#   --phases           also print each side's per-phase step breakdown, every GEMM of the
#                      step timed on its own, and the ceilings of the step's ratio: PyTorch's
#                      step over Tandem's GEMM time in the step, and over that time at this
#                      core's measured f32 FMA / bf16 VDPBF16PS peak (the "env" line)
#
# Columns: "wall" figures come from the median wall time per iteration; "cpu" figures from the
# median process CPU time per iteration, which on a busy shared machine is the steadier of the
# two (one thread: CPU time is the work, without the time other processes held the core).
# The PyTorch here is only a yardstick: tests and CI never use it.
set -euo pipefail

bench_name=run_mlp_bench.sh
# shellcheck source=bench/bench_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_defaults
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-python) torch_python="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --phases) phases=1; shift ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_mlp_bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
bench_check_torch
bench_build mlp_step_bench
bench_env
bench_print_machine 0
echo "command: OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TANDEM_NUM_THREADS=1 OPENBLAS_CORETYPE=SkylakeX; $bench_bin --threads 1 --seconds $seconds; $torch_python bench/torch_mlp_step.py --threads 1 --seconds $seconds; x$rounds rounds"
echo

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
extra=()
[[ "$phases" = 1 ]] && extra+=(--phases)
for ((r = 1; r <= rounds; ++r)); do
  echo "round $r/$rounds: tandem ..." >&2
  "$bench_bin" --threads 1 --seconds "$seconds" ${extra[@]+"${extra[@]}"} >>"$out"
  echo "round $r/$rounds: torch ..." >&2
  "$torch_python" "$repo/bench/torch_mlp_step.py" --threads 1 --seconds "$seconds" ${extra[@]+"${extra[@]}"} >>"$out"
done

"$torch_python" - "$out" <<'PY'
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
best = {}  # (workload, impl) -> record with the highest wall figure over rounds
for r in rows:
    if r["name"] == "mlp_step":
        key, wall, cpu, unit = f"mlp_step {r['dtype']} (b={r['batch']})", r["samples_per_s"], r["samples_per_s_cpu"], "samples/s"
    elif r["name"] == "gemm_1024":
        key, wall, cpu, unit = f"{r['variant']} 1024^3 {r['dtype']}", r["gflops"], r["gflops_cpu"], "GFLOP/s"
    else:
        continue
    k = (key, r["impl"])
    prev = best.get(k)
    best[k] = {"unit": unit, "wall": max(wall, prev["wall"]) if prev else wall,
               "cpu": max(cpu, prev["cpu"]) if prev else cpu}

order = []
for (key, _impl) in best:
    if key not in order:
        order.append(key)
hdr = f"{'workload':<26} {'unit':<9} {'Tandem':>9} {'PyTorch':>9} {'T/P':>6}   {'Tandem':>9} {'PyTorch':>9} {'T/P':>6}"
print(f"{'':<36} {'---------- wall ----------':>26}   {'---------- cpu -----------':>26}")
print(hdr)
print("-" * len(hdr))
for key in order:
    t, p = best.get((key, "tandem")), best.get((key, "torch"))
    if not t or not p:
        continue
    print(f"{key:<26} {t['unit']:<9} {t['wall']:>9.1f} {p['wall']:>9.1f} {t['wall'] / p['wall']:>6.2f}   "
          f"{t['cpu']:>9.1f} {p['cpu']:>9.1f} {t['cpu'] / p['cpu']:>6.2f}")

last = {}  # the last round's phase and per-GEMM lines
for r in rows:
    if r["name"] == "mlp_step_phases":
        last[("phases", r["dtype"], r["impl"])] = r
    elif r["name"] == "step_gemm":
        last[("gemm", r["dtype"], r["gemm"], r["impl"])] = r
if last:
    print("\nstep phases, ms/step (last round; process CPU time):")
    cols = ["zero_grad", "forward", "loss", "backward", "optimizer"]
    print(f"  {'dtype':<5} {'impl':<7} " + " ".join(f"{c:>10}" for c in cols) + f" {'allocs/step':>12}")
    for d in ("f32", "bf16"):
        for impl in ("tandem", "torch"):
            r = last.get(("phases", d, impl))
            if r:
                allocs = f"{r['allocs_per_step']:.0f}" if "allocs_per_step" in r else "-"
                print(f"  {d:<5} {impl:<7} " + " ".join(f"{r[c + '_ms']:>10.3f}" for c in cols) + f" {allocs:>12}")
    print("\neach GEMM of the step on its own, us (process CPU time, median):")
    print(f"  {'dtype':<5} {'gemm':<13} {'m x n x k':<16} {'Tandem':>8} {'PyTorch':>8} {'T/P time':>9}")
    for d in ("f32", "bf16"):
        tot_t = tot_p = 0.0
        for key, t in last.items():
            if key[0] != "gemm" or key[1] != d or key[3] != "tandem":
                continue
            p = last.get(("gemm", d, key[2], "torch"))
            if not p:
                continue
            tot_t += t["us_cpu_median"]
            tot_p += p["us_cpu_median"]
            shape = f"{t['m']}x{t['n']}x{t['k']}"
            print(f"  {d:<5} {key[2]:<13} {shape:<16} {t['us_cpu_median']:>8.1f} {p['us_cpu_median']:>8.1f} "
                  f"{t['us_cpu_median'] / p['us_cpu_median']:>9.2f}")
        if tot_p:
            print(f"  {d:<5} {'all 8':<13} {'':<16} {tot_t:>8.1f} {tot_p:>8.1f} {tot_t / tot_p:>9.2f}")
    # What the step's GEMMs allow: PyTorch's best median cpu step over Tandem's GEMM time as the
    # GEMMs run inside the step now ("gemm only", "gemm+rest") and at this core's measured peak
    # ("peak only", "peak+rest": the bound for any implementation doing these flops on these
    # units), first with nothing else taking any time, then with the rest of Tandem's step
    # (step - GEMM time) as it is now.
    def env_peak(field):
        peaks = [r[field] for r in rows if r["name"] == "env" and r.get(field)]
        return max(peaks) if peaks else 0.0
    # bf16 runs at the rate of the way Tandem chose (the env line's bf16_products): widened to
    # f32 on the FMAs, native on VDPBF16PS, amx on tiles this does not measure (0).
    bf16_way = next((r["bf16_products"] for r in reversed(rows) if r["name"] == "env" and "bf16_products" in r), "native")
    peak_of = {"f32": env_peak("f32_fma_peak_gflops"),
               "bf16": {"widened": env_peak("f32_fma_peak_gflops"), "amx": 0.0}.get(bf16_way,
                                                                                  env_peak("bf16_dot_peak_gflops"))}
    lines = []
    for d in ("f32", "bf16"):
        t = last.get(("phases", d, "tandem"))
        p_steps = [r["step_ms_cpu_median"] for r in rows if r["name"] == "mlp_step" and r["impl"] == "torch"
                   and r["dtype"] == d]
        t_steps = [r["step_ms_cpu_median"] for r in rows if r["name"] == "mlp_step" and r["impl"] == "tandem"
                   and r["dtype"] == d]
        if not t or not p_steps or not t_steps or not t.get("gemm_ms"):
            continue
        p_step, t_step, gemm = min(p_steps), min(t_steps), t["gemm_ms"]
        rest = max(0.0, t_step - gemm)
        peak = peak_of[d]
        cols = [f"{p_step / gemm:.2f}x", f"{p_step / (gemm + rest):.2f}x"]
        if peak > 0:
            at_peak = gemm * t["gemm_gflops"] / peak
            cols += [f"{p_step / at_peak:.2f}x", f"{p_step / (at_peak + rest):.2f}x", f"{100 * t['gemm_gflops'] / peak:.0f}%"]
        else:
            cols += ["-", "-", "-"]
        lines.append(f"  {d:<5} {p_step:>8.2f} {gemm:>8.2f} {rest:>8.2f} " + " ".join(f"{c:>10}" for c in cols))
    if lines:
        print(f"\nceilings of the step's T/P cpu ratio (ms; peaks: f32 FMA {peak_of['f32']:.1f}, bf16 ({bf16_way})"
              f" {peak_of['bf16']:.1f} GFLOP/s, 0 = not measured):")
        print(f"  {'dtype':<5} {'P step':>8} {'T gemm':>8} {'T rest':>8} " +
              " ".join(f"{c:>10}" for c in ["gemm only", "gemm+rest", "peak only", "peak+rest", "gemm %peak"]))
        print("\n".join(lines))

print("\nraw JSON lines:")
for r in rows:
    print(json.dumps(r))
PY
