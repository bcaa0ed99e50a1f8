#!/usr/bin/env python3
"""The yardstick for bench/models_step.cc: the same workloads in PyTorch, the same JSON lines.

Runs with a PyTorch from PyPI (bench/run_models_bench.sh passes --torch-python, by default the venv that
bench/setup-torch.sh makes). Never used by tests or CI.

  torch_models_step.py [--workload cnn|gpt] [--dtype f32|bf16|autocast] [--threads T] [--batch B]
                       [--context T] [--seconds S] [--min-steps N] [--warmup W] [--phases]

cnn_step: zero_grad, forward, cross_entropy, backward, AdamW(lr 1e-3) step of the W2 CNN
(src/tandem/nn/models/cnn.h) on (64, 1, 28, 28) randn inputs, 10 classes. gpt_step: the same
for the W3 GPT (src/tandem/nn/models/gpt.h; attention is F.scaled_dot_product_attention with
is_causal=True) on batch 8 x context 128 random tokens, cross_entropy over (B*T, 256), AdamW(lr
3e-4). "bf16" is torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss (f32
master weights). AdamW keeps PyTorch's CPU default implementation (the per-tensor for-loop).

Memory: "peak_tensor_mb" is the bytes of live tensors at the step's high-water mark, less the
pool of input batches: parameters, buffers and optimizer state (summed over their storages
after zero_grad) plus the peak of the running sum of the CPU allocator's allocation and free
events that torch.profiler(profile_memory=True) records over one further forward, loss,
backward and optimizer step (outside the timed loop). "maxrss_delta_mb" is the growth of the
process's peak resident set (resource.getrusage ru_maxrss) from the end of setup to the end of
the run: the first step's footprint plus glibc's retained heap, oneDNN scratchpads and JIT code;
it only means one (workload, dtype) when the process runs just that one.
"""
import argparse
import os
import resource
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import emit, init_and_emit_env, time_loop, time_phases  # noqa: E402

POOL_BATCHES = 16  # random batches, cycled (as in models_step.cc)
MIB = 1024.0 * 1024.0


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["cnn", "gpt"])
    p.add_argument("--dtype", choices=["f32", "bf16", "autocast"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="0: the workload's default (cnn 64, gpt 8)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--min-steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--phases", action="store_true", help="also split the step into phases")
    return p.parse_args()


def maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# ---- W2: the CNN of src/tandem/nn/models/cnn.h ----
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        block = lambda cin, cout, s: [nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        self.features = nn.Sequential(*block(1, 32, 1), *block(32, 64, 2), *block(64, 128, 2))
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


# ---- W3: the GPT of src/tandem/nn/models/gpt.h ----
class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        heads = lambda t: t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, context=128, n_layer=4, d=256, n_head=4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if "ln" in name:
                continue
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # head tied to the token embedding


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def profiled_peak_bytes(fn):
    """Peak of the running sum of CPU allocations minus frees recorded while fn() runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    mem = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    mem.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def flat_cross_entropy(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y)


def run(args, name, unit, model, opt, xs, ys, items, batch, context, dtype):
    state = {"next": 0}
    bf16 = dtype in ("bf16", "autocast")  # "autocast": the name Tandem's amp::autocast runs use

    def forward_loss(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return flat_cross_entropy(model(xs[i]), ys[i])

    def step():
        i = state["next"] % POOL_BATCHES
        state["next"] += 1
        opt.zero_grad()
        loss = forward_loss(i)
        loss.backward()
        opt.step()
        return loss

    rss0 = maxrss_mb()
    tm = time_loop(args, step)
    loss = step().item()

    # Peak tensor bytes of one more step: persistent state after zero_grad + the profiled peak.
    opt.zero_grad()
    persistent = storage_bytes(
        [*model.parameters(), *model.buffers(), *(v for s in opt.state.values() for v in s.values())])

    def rest_of_step():
        i = state["next"] % POOL_BATCHES
        state["next"] += 1
        forward_loss(i).backward()
        opt.step()

    peak = persistent + profiled_peak_bytes(rest_of_step)
    rss1 = maxrss_mb()
    med = tm.median()
    emit({"name": name, "impl": "torch", "dtype": dtype, "batch": batch, "context": context,
          "threads": torch.get_num_threads(), "steps": len(tm.t), "unit": f"{unit}/s",
          "per_s": round(items / med, 1), "per_s_cpu": round(items / tm.cpu_median(), 1),
          "per_s_mean": round(items / tm.mean(), 1), "step_ms_median": round(1e3 * med, 3),
          "step_ms_min": round(1e3 * tm.min(), 3), "step_ms_cpu_median": round(1e3 * tm.cpu_median(), 3),
          "loss": round(loss, 4), "peak_tensor_mb": round(peak / MIB, 2),
          "pool_mb": round(storage_bytes(xs + ys) / MIB, 2), "maxrss_delta_mb": round(rss1 - rss0, 1),
          "maxrss_mb": round(rss1, 1)})

    if not args.phases:
        return
    time_phases(args, f"{name}_phases", dtype, model, opt, xs, ys, state, flat_cross_entropy)


def bench_cnn(args, dtype):
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = args.batch or 64
    xs = [torch.randn(b, 1, 28, 28) for _ in range(POOL_BATCHES)]
    ys = [torch.randint(0, 10, (b,)) for _ in range(POOL_BATCHES)]
    run(args, "cnn_step", "samples", model, opt, xs, ys, b, b, 0, dtype)


def bench_gpt(args, dtype):
    torch.manual_seed(0)
    model = GPT(context=args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    b, t = args.batch or 8, args.context
    xs = [torch.randint(0, 256, (b, t)) for _ in range(POOL_BATCHES)]
    ys = [torch.randint(0, 256, (b * t,)) for _ in range(POOL_BATCHES)]
    run(args, "gpt_step", "tokens", model, opt, xs, ys, b * t, b, t, dtype)


def main():
    args = parse()
    dtypes = init_and_emit_env(args)
    if args.workload in (None, "cnn"):
        for d in dtypes:
            bench_cnn(args, d)
    if args.workload in (None, "gpt"):
        for d in dtypes:
            bench_gpt(args, d)


if __name__ == "__main__":
    main()
