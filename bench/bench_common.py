"""The harness bench/torch_mlp_step.py and bench/torch_models_step.py share: the timed loop with
medians, the per-phase split of a training step, the JSON-line printing and the "env" line.
"""
import json
import statistics
import time

import torch


class Timing:
    def __init__(self):
        self.t, self.cpu = [], []

    def median(self):
        return statistics.median(self.t)

    def cpu_median(self):
        return statistics.median(self.cpu)

    def mean(self):
        return sum(self.t) / len(self.t)

    def min(self):
        return min(self.t)


def time_loop(args, fn):
    """args.warmup untimed calls, then at least args.min_steps and args.seconds of timed ones."""
    for _ in range(args.warmup):
        fn()
    tm = Timing()
    start = time.perf_counter()
    while len(tm.t) < args.min_steps or time.perf_counter() - start < args.seconds:
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        tm.t.append(time.perf_counter() - t0)
        tm.cpu.append(time.process_time() - c0)
    return tm


def emit(d):
    print(json.dumps(d), flush=True)


def init_and_emit_env(args):
    """Sets the thread count, prints the "env" line; returns the dtypes to run."""
    torch.set_num_threads(args.threads)
    emit({"name": "env", "impl": "torch", "threads": torch.get_num_threads(), "version": torch.__version__,
          "cpu": torch.backends.cpu.get_cpu_capability(), "mkldnn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported()})
    return [args.dtype] if args.dtype else ["f32", "bf16"]


def time_phases(args, name, dtype, model, opt, xs, ys, state, loss_fn):
    """The training step split into zero_grad / forward / loss / backward / optimizer process CPU
    time (autocast to bf16 around forward and loss for dtype "bf16"); emits the "<name>" line."""
    bf16 = dtype == "bf16"
    ph = dict(zero_grad=0.0, forward=0.0, loss=0.0, backward=0.0, optimizer=0.0)
    steps = 0
    end = time.perf_counter() + args.seconds
    while steps < args.min_steps or time.perf_counter() < end:
        i = state["next"] % len(xs)
        state["next"] += 1
        t0 = time.process_time()
        opt.zero_grad()
        t1 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(xs[i])
            t2 = time.process_time()
            loss = loss_fn(logits, ys[i])
        t3 = time.process_time()
        loss.backward()
        t4 = time.process_time()
        opt.step()
        t5 = time.process_time()
        for k, dt in zip(ph, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            ph[k] += dt
        steps += 1
    gemm_ms, conv_ms = matmul_conv_ms(args, bf16, model, opt, xs, ys, state, loss_fn)
    emit({"name": name, "impl": "torch", "dtype": dtype, "steps": steps,
          **{f"{k}_ms": round(1e3 * v / steps, 3) for k, v in ph.items()},
          "gemm_ms": round(gemm_ms, 3), "conv_ms": round(conv_ms, 3)})


# The ATen ops that are one BLAS / oneDNN matrix-product or convolution call (self time: the
# kernel, without the ops they call). PyTorch's fused CPU attention is neither (Tandem counts its
# attention's tile products as GEMM).
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv"}
CONV_OPS = {"aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution"}


def matmul_conv_ms(args, bf16, model, opt, xs, ys, state, loss_fn, steps=3):
    """Self CPU ms per step inside GEMM and convolution ops, from torch.profiler over `steps`
    more steps (the profiler's per-op overhead is small next to these kernels)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            i = state["next"] % len(xs)
            state["next"] += 1
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(xs[i]), ys[i])
            loss.backward()
            opt.step()
    gemm = conv = 0.0
    for e in prof.key_averages():
        if e.key in GEMM_OPS:
            gemm += e.self_cpu_time_total
        elif e.key in CONV_OPS:
            conv += e.self_cpu_time_total
    return gemm / 1e3 / steps, conv / 1e3 / steps
