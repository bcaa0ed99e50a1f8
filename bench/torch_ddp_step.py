#!/usr/bin/env python3
"""The yardstick for bench/ddp_step.cc: PyTorch DDP over gloo on N local processes, one thread
and one core each, the same W1/W2/W3 steps. Rank 0 prints one JSON line with the same keys.

  torch_ddp_step.py [--workload w1|w2|w3] [--dtype f32|bf16] [--nproc N] [--batch B]
                    [--seconds S] [--min-steps N] [--warmup W]
                    [--comm-hook none|fp16|bf16|powersgd|localsgd] [--powersgd-rank R] [--bucket-cap-mb MB]
                    [--fused-optimizer]

W1: the MLP, SGD(lr 0.05, momentum 0.9), batch 128 per rank; W2: the CNN, AdamW(lr 1e-3), batch
64; W3: the GPT, AdamW(lr 1e-3), batch 8 x 128 tokens. "bf16" is torch.autocast("cpu",
torch.bfloat16) around forward and loss. --comm-hook registers torch's fp16_compress_hook,
bf16_compress_hook or powerSGD_hook (PowerSGDState with the given rank and start_powerSGD_iter 2,
the rest torch's defaults), as bench/ddp_step.cc does. --bucket-cap-mb passes bucket_cap_mb to
DDP, which in torch 2.x also makes the first bucket that large (ddp_step_bench's --bucket-cap-mb
and --first-bucket-mb). torch 2.15's powerSGD_hook over gloo aborts with a gloo size mismatch
here as soon as DDP has two buckets (the default layout of W1; also in a 20-line script without
this bench): use one bucket (--bucket-cap-mb 25) to compare it. --fused-optimizer steps the
optimizer inside backward with torch's DistributedDataParallel._register_fused_optim (the same
optimizer class and arguments; no opt.step()), as ddp_step_bench --fused-optimizer does with
register_fused_optimizer. Never used by tests or CI.
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models_step import CNN, GPT  # noqa: E402  (the W2/W3 definitions)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--min-steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd", "localsgd"], default="none")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--fused-optimizer", action="store_true")
    return p.parse_args()


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def run(rank, args, port):
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    torch.manual_seed(0)
    gpt = args.workload == "w3"
    if args.workload == "w1":
        B, model = args.batch or 128, mlp()
    elif args.workload == "w2":
        B, model = args.batch or 64, CNN()
    else:
        B, model = args.batch or 8, GPT()
    g = torch.Generator().manual_seed(100 + rank)
    xs, ys = [], []
    for _ in range(8):
        if gpt:
            t = torch.randint(0, 256, (B, 129), generator=g)
            xs.append(t[:, :128].contiguous())
            ys.append(t[:, 1:].reshape(-1).contiguous())
        else:
            xs.append(torch.randn(B, 1, 28, 28, generator=g))
            ys.append(torch.randint(0, 10, (B,), generator=g))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    if args.comm_hook in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if args.comm_hook == "fp16"
                               else default_hooks.bf16_compress_hook)
    elif args.comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        ddp.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank,
                                                  start_powerSGD_iter=2), psgd.powerSGD_hook)
    averager = None
    if args.comm_hook == "localsgd":
        # Post-local SGD: two plain DDP steps, then each rank's own gradients, the parameters
        # averaged every 4 optimizer steps. The subgroup is given (the default, new_subgroups(),
        # counts CUDA devices); without post-local gradient all-reduce it is never used.
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
        from torch.distributed.algorithms.model_averaging import averagers
        ddp.register_comm_hook(pl.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=2,
                                                    post_local_gradient_allreduce=False), pl.post_localSGD_hook)
        averager = averagers.PeriodicModelAverager(period=4, warmup_steps=2)
    if args.workload == "w1":
        opt_cls, opt_kwargs = torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    else:
        opt_cls, opt_kwargs = torch.optim.AdamW, {"lr": 1e-3}
    opt = opt_cls(model.parameters(), **opt_kwargs)
    if args.fused_optimizer:
        # torch's functional optimizer runs in the allreduce hook; opt only zeroes the gradients.
        ddp._register_fused_optim(opt_cls, **opt_kwargs)
    bf16 = args.dtype == "bf16"
    state = {"next": 0}

    def step():
        i = state["next"] % len(xs)
        state["next"] += 1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = ddp(xs[i])
            loss = F.cross_entropy(out.view(-1, out.size(-1)) if gpt else out, ys[i])
        loss.backward()
        if not args.fused_optimizer:
            opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())

    for _ in range(max(args.warmup, 3)):
        step()
    t = time.perf_counter()
    for _ in range(3):
        step()
    per_step = (time.perf_counter() - t) / 3
    n = torch.tensor([max(args.min_steps, int(args.seconds / per_step))])
    dist.broadcast(n, 0)
    n = int(n.item())
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        step()
    dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if rank == 0:
        samples = n * B * args.nproc
        print(json.dumps({"impl": "torch", "version": torch.__version__, "workload": args.workload,
                          "dtype": args.dtype, "nproc": args.nproc, "per_rank_batch": B, "steps": n,
                          "samples_per_s": samples / wall, "tokens_per_s": samples * 128 / wall if gpt else 0.0,
                          "step_ms": 1e3 * wall / n, "cpu_step_ms": 1e3 * cpu / n}), flush=True)
    dist.destroy_process_group()


def main():
    args = parse()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
