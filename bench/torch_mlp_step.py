#!/usr/bin/env python3
"""The yardstick for bench/mlp_step.cc: the same workloads in PyTorch, the same JSON lines.

Runs with a PyTorch from PyPI (bench/run_mlp_bench.sh passes --torch-python, by default the venv that
bench/setup-torch.sh makes). Never used by tests or CI.

  torch_mlp_step.py [--threads T] [--batch B] [--seconds S] [--min-steps N] [--warmup W]
                    [--only mlp|gemm] [--dtype f32|bf16|autocast] [--phases]

mlp_step: zero_grad, forward, cross_entropy, backward, SGD(lr 0.05, momentum 0.9) step of
nn.Sequential(Flatten, Linear(784,1024), ReLU, Linear(1024,1024), ReLU, Linear(1024,10)) at
batch 128; "bf16" is torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss (f32
master weights). gemm_1024: F.linear(x, w) at M = N = K = 1024 in f32 and in bf16 tensors.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import emit, init_and_emit_env, time_loop, time_phases  # noqa: E402

POOL_BATCHES = 64  # random batches, cycled (as in mlp_step.cc)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--min-steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--only", choices=["mlp", "gemm"])
    p.add_argument("--dtype", choices=["f32", "bf16", "autocast"])
    p.add_argument("--phases", action="store_true",
                   help="also split the step into phases and time each GEMM of the step on its own")
    return p.parse_args()


def mlp():
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def bench_mlp(args, dtype):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs = [torch.randn(args.batch, 784) for _ in range(POOL_BATCHES)]
    ys = [torch.randint(0, 10, (args.batch,)) for _ in range(POOL_BATCHES)]
    state = {"next": 0}
    bf16 = dtype in ("bf16", "autocast")  # "autocast": the name Tandem's amp::autocast runs use

    def step():
        i = state["next"] % POOL_BATCHES
        state["next"] += 1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        return loss

    tm = time_loop(args, step)
    loss = step().item()
    med = tm.median()
    emit({"name": "mlp_step", "impl": "torch", "dtype": dtype, "batch": args.batch, "threads": torch.get_num_threads(),
          "steps": len(tm.t), "samples_per_s": round(args.batch / med, 1),
          "samples_per_s_cpu": round(args.batch / tm.cpu_median(), 1),
          "samples_per_s_mean": round(args.batch / tm.mean(), 1), "step_ms_median": round(1e3 * med, 3),
          "step_ms_min": round(1e3 * tm.min(), 3), "step_ms_cpu_median": round(1e3 * tm.cpu_median(), 3),
          "loss": round(loss, 4)})

    if not args.phases:
        return
    time_phases(args, "mlp_step_phases", dtype, model, opt, xs, ys, state, F.cross_entropy)


def bench_step_gemms(args, dtype):
    """The eight GEMMs of one step, each on its own (what autocast runs them in)."""
    dt = torch.bfloat16 if dtype in ("bf16", "autocast") else torch.float32
    b = args.batch
    torch.manual_seed(0)
    r = lambda *s: torch.randn(*s).to(dt)
    x1, h, g1024, g10 = r(b, 784), r(b, 1024), r(b, 1024), r(b, 10)
    w1, w2, w3, b1024, b10 = r(1024, 784), r(1024, 1024), r(10, 1024), r(1024), r(10)
    cases = [
        ("fwd1 x@W1^T", b, 1024, 784, lambda: F.linear(x1, w1, b1024)),
        ("fwd2 h@W2^T", b, 1024, 1024, lambda: F.linear(h, w2, b1024)),
        ("fwd3 h@W3^T", b, 10, 1024, lambda: F.linear(h, w3, b10)),
        ("dX3 g@W3", b, 1024, 10, lambda: torch.mm(g10, w3)),
        ("dX2 g@W2", b, 1024, 1024, lambda: torch.mm(g1024, w2)),
        ("dW3 g^T@h", 10, 1024, b, lambda: torch.mm(g10.t(), h)),
        ("dW2 g^T@h", 1024, 1024, b, lambda: torch.mm(g1024.t(), h)),
        ("dW1 g^T@x", 1024, 784, b, lambda: torch.mm(g1024.t(), x1)),
    ]
    quick = argparse.Namespace(**vars(args))
    quick.seconds = min(args.seconds, 0.5)
    with torch.no_grad():
        for name, m, n, k, fn in cases:
            tm = time_loop(quick, fn)
            emit({"name": "step_gemm", "impl": "torch", "dtype": dtype, "gemm": name, "m": m, "n": n, "k": k,
                  "us_median": round(1e6 * tm.median(), 1), "us_cpu_median": round(1e6 * tm.cpu_median(), 1),
                  "gflops_cpu": round(2.0 * m * n * k / tm.cpu_median() * 1e-9, 1)})


def bench_gemm(args, dtype):
    m = n = k = 1024
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(m, k).to(dt)
    w = torch.randn(n, k).to(dt)
    flop = 2.0 * m * n * k
    with torch.no_grad():
        lin = time_loop(args, lambda: F.linear(x, w))
        # The kernel alone, into a preallocated output (as tandem's gemm_into).
        c = torch.empty(m, n, dtype=dt)
        wt = w.t()
        kern = time_loop(args, lambda: torch.mm(x, wt, out=c))
    for variant, tm in (("linear", lin), ("gemm_into", kern)):
        emit({"name": "gemm_1024", "variant": variant, "impl": "torch", "dtype": dtype,
              "threads": torch.get_num_threads(), "iters": len(tm.t), "gflops": round(flop / tm.median() * 1e-9, 2),
              "gflops_cpu": round(flop / tm.cpu_median() * 1e-9, 2), "gflops_best": round(flop / tm.min() * 1e-9, 2),
              "ms_median": round(1e3 * tm.median(), 3)})


def main():
    args = parse()
    dtypes = init_and_emit_env(args)
    if args.only in (None, "mlp"):
        for d in dtypes:
            bench_mlp(args, d)
    if args.only in (None, "gemm"):
        for d in dtypes:
            bench_gemm(args, d)
    if args.phases:
        for d in dtypes:
            bench_step_gemms(args, d)


if __name__ == "__main__":
    main()
