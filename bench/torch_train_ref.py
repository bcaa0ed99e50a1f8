#!/usr/bin/env python3
"""The PyTorch side of bench/compare: trains what a `tandem train` config describes, the way
`tandem train` does, and writes the same per-step JSONL (step, loss, lr, step_s, cpu_s).

  torch_train_ref.py --config configs/mlp_bf16.json [--steps N] [--nproc N] [--out FILE.jsonl]
                     [--eval-samples N]

Reads the Tandem config itself, so the recipe is the same by construction: model (mlp / cnn / gpt
from bench/torch_ddp_step.py and bench/torch_models_step.py), data (Fashion-MNIST IDX files
standardised with mean 0.2860 / std 0.3530, or byte windows of text files), optimizer (SGD / Adam /
AdamW with the config's params), DeepSpeed's schedules, bf16 = torch.autocast("cpu", bfloat16)
around forward and loss, train_batch_size split over --nproc processes (DistributedSampler's rule:
rank r takes every world-th index of the epoch's permutation). One thread per process
(torch.set_num_threads(1)); 2+ processes are DDP over gloo started with mp.spawn. Each step's loss
is all-reduced (as `tandem train` logs it). fp16, gradient accumulation and clipping are not
reproduced (bench/compare runs fp32 and bf16 only): the script refuses such configs.

Works with PyPI's torch 2.x and Debian's torch 1.13 (scaled_dot_product_attention is shimmed
there). A benchmark yardstick only: never used by tests or CI.
"""
import argparse
import gzip
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0 (Debian's 1.13)
    def _sdpa(q, k, v, is_causal=False):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if is_causal:
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return att.softmax(-1).to(v.dtype) @ v

    F.scaled_dot_product_attention = _sdpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_step import mlp  # noqa: E402  (W1)
from torch_models_step import CNN, GPT  # noqa: E402  (W2, W3)

FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # src/tandem/data/vision.h


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: the config's)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--out", default="", help="per-step JSONL (rank 0); default stdout")
    return p.parse_args()


def get(cfg, path, default=None):
    cur = cfg
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return default
        cur = cur[k]
    return cur


# ---- data: the whole split in memory; batches gathered by index ----
def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(*dims)


def fashion_mnist(root):
    def find(stem):
        for name in (stem + ".gz", stem):
            if os.path.exists(os.path.join(root, name)):
                return os.path.join(root, name)
        raise SystemExit(f"torch_train_ref.py: {root}/{stem}.gz not found (set data.path or TANDEM_DATA_DIR)")

    images = read_idx(find("train-images-idx3-ubyte"))
    labels = read_idx(find("train-labels-idx1-ubyte")).long()
    return images, labels


def text_bytes(path):
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Rank `rank`'s micro-batches of `micro` examples: each epoch a permutation of the examples
    (seed + epoch), rank r taking every world-th index after trimming to a multiple of world (as
    DistributedSampler with drop_last), the last partial micro-batch kept unless drop_last."""

    def __init__(self, n, micro, rank, world, seed, drop_last, fetch):
        self.n, self.micro, self.rank, self.world, self.seed = n, micro, rank, world, seed
        self.drop_last, self.fetch, self.epoch = drop_last, fetch, 0
        self._start_epoch()

    def _start_epoch(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        total = self.n - self.n % self.world
        share = torch.randperm(self.n, generator=g)[:total][self.rank::self.world]
        self.chunks = list(share.split(self.micro))
        if self.drop_last and len(self.chunks[-1]) < self.micro:
            self.chunks.pop()
        self.pos = 0

    def next(self):
        if self.pos == len(self.chunks):
            self.epoch += 1
            self._start_epoch()
        idx = self.chunks[self.pos]
        self.pos += 1
        return self.fetch(idx)


def make_data(cfg, rank, world, micro):
    name, seed = get(cfg, "data.name", "fashion_mnist"), int(get(cfg, "seed", 0))
    drop_last = bool(get(cfg, "data.drop_last", False))
    if name == "fashion_mnist":
        root = get(cfg, "data.path") or os.path.join(os.environ.get("TANDEM_DATA_DIR", "/usr/share/datasets"),
                                                     "fashion-mnist")
        images, labels = fashion_mnist(root)

        def fetch(idx):  # u8 -> standardised f32 per batch, as Tandem's FashionMNIST dataset
            x = (images[idx].float().unsqueeze(1) / 255.0 - FASHION_MEAN) / FASHION_STD
            return x, labels[idx]

        return Batches(len(labels), micro, rank, world, seed, drop_last, fetch), False
    if name == "text":
        corpus = text_bytes(get(cfg, "data.path") or "/usr/share/common-licenses")
        T = int(get(cfg, "model.context", 128))
        n = int(get(cfg, "data.samples_per_epoch", 0)) or (len(corpus) - 1) // T
        # Window i starts at a uniform position drawn from (seed, i) (Tandem: Philox; here torch's
        # generator — the same distribution, other draws).
        starts = torch.randint(0, len(corpus) - T, (n,), generator=torch.Generator().manual_seed(seed))
        offsets = torch.arange(T + 1)

        def fetch(idx):
            w = corpus[starts[idx].unsqueeze(1) + offsets]  # (B, T + 1)
            return w[:, :T].contiguous(), w[:, 1:].contiguous()

        return Batches(n, micro, rank, world, seed, drop_last, fetch), True
    raise SystemExit(f"torch_train_ref.py: data.name {name!r} not supported (fashion_mnist, text)")


def make_model(cfg):
    name = get(cfg, "model.name", "mlp")
    if name == "mlp":
        if get(cfg, "model.hidden", [1024, 1024]) != [1024, 1024]:
            raise SystemExit("torch_train_ref.py: the mlp is W1's, hidden [1024, 1024]")
        return mlp()
    if name == "cnn":
        return CNN()
    if name == "gpt":
        return GPT(vocab=int(get(cfg, "model.vocab_size", 256)), context=int(get(cfg, "model.context", 128)),
                   n_layer=int(get(cfg, "model.n_layer", 4)), d=int(get(cfg, "model.d_model", 256)),
                   n_head=int(get(cfg, "model.n_head", 4)))
    raise SystemExit(f"torch_train_ref.py: model.name {name!r} not supported (mlp, cnn, gpt)")


def make_optimizer(cfg, params):
    typ, p = get(cfg, "optimizer.type", "SGD"), get(cfg, "optimizer.params", {})
    lr = p.get("lr", 1e-3)
    if typ == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=p.get("momentum", 0.0), weight_decay=p.get("weight_decay", 0.0),
                               nesterov=p.get("nesterov", False))
    kw = dict(lr=lr, betas=tuple(p.get("betas", (0.9, 0.999))), eps=p.get("eps", 1e-8))
    if typ == "Adam":
        return torch.optim.Adam(params, weight_decay=p.get("weight_decay", 0.0), **kw)
    return torch.optim.AdamW(params, weight_decay=p.get("weight_decay", 1e-2), **kw)


def lr_factor(cfg, base, total):
    """DeepSpeed's schedules as Tandem's SchedulerConfig::lr_at, as a LambdaLR factor of base."""
    typ, p = get(cfg, "scheduler.type", ""), get(cfg, "scheduler.params", {})
    if not typ:
        return lambda step: 1.0
    warm, wtype = p.get("warmup_num_steps", 1000), p.get("warmup_type", "log")
    total = p.get("total_num_steps", 0) or total

    def gamma(s):
        if wtype == "log":
            return math.log(s + 1.0) / math.log(warm) if warm > 1 else 1.0
        return s / warm

    def f(s):
        if typ == "WarmupCosineLR":
            if s < warm:
                lo = p.get("warmup_min_ratio", 0.0)
                return lo + (1.0 - lo) * gamma(s)
            lo, t = p.get("cos_min_ratio", 1e-4), min(1.0, (s - warm) / max(1.0, total - warm))
            return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * t))
        lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base)
        if s < warm:
            return (lo + (hi - lo) * gamma(s)) / base
        if typ == "WarmupDecayLR":
            return hi * max(0.0, (total - s) / max(1.0, total - warm)) / base
        return hi / base

    return f


def make_ddp(cfg, model):
    """The config's ddp section and communication_data_type, as tandem train applies them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if get(cfg, "ddp.sync_batchnorm", False):
        # torch.nn.SyncBatchNorm raises "expected input tensor to be on GPU" for CPU tensors.
        raise SystemExit("torch_train_ref.py: ddp.sync_batchnorm has no PyTorch CPU counterpart "
                         "(torch.nn.SyncBatchNorm runs on GPU/XPU only); drop the key for the comparison")
    net = nn.parallel.DistributedDataParallel(
        model,
        bucket_cap_mb=get(cfg, "ddp.bucket_cap_mb", 25),
        broadcast_buffers=get(cfg, "ddp.broadcast_buffers", True),
        find_unused_parameters=get(cfg, "ddp.find_unused_parameters", False),
        gradient_as_bucket_view=get(cfg, "ddp.gradient_as_bucket_view", False),
        static_graph=get(cfg, "ddp.static_graph", False))
    wire = get(cfg, "ddp.comm_hook", "no")
    if wire != "power_sgd":
        wire = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}.get(get(cfg, "communication_data_type", ""), wire)
    if get(cfg, "amp.opt_level", "") not in ("O2", "O3") and wire in ("fp16", "bf16"):
        net.register_comm_hook(None, default_hooks.fp16_compress_hook if wire == "fp16" else default_hooks.bf16_compress_hook)
    if wire == "power_sgd":
        # torch's PowerSGD over gloo aborts once DDP has two buckets (../shared/BUILD-NOTES.md).
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        state = psgd.PowerSGDState(process_group=None, **get(cfg, "ddp.comm_state_option", {}))
        wrapper = {"fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}.get(get(cfg, "communication_data_type", ""),
                                                                        get(cfg, "ddp.comm_wrapper", "no"))
        hook = psgd.powerSGD_hook
        if wrapper in ("fp16", "bf16"):
            hook = getattr(default_hooks, f"{wrapper}_compress_wrapper")(hook)
        net.register_comm_hook(state, hook)
    return net


def worker(rank, args, cfg, port):
    torch.set_num_threads(1)
    world = args.nproc
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(int(get(cfg, "seed", 0)))
    global_batch = int(cfg["train_batch_size"])
    if global_batch % world:
        raise SystemExit(f"torch_train_ref.py: train_batch_size {global_batch} is not a multiple of {world} processes")
    batches, text = make_data(cfg, rank, world, global_batch // world)
    model = make_model(cfg)
    net = make_ddp(cfg, model) if world > 1 else model
    opt = make_optimizer(cfg, model.parameters())
    steps = args.steps or int(get(cfg, "train.steps", 0))
    if not steps:
        raise SystemExit("torch_train_ref.py: give --steps (the config trains by epochs)")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, opt.param_groups[0]["lr"], steps))
    bf16 = bool(get(cfg, "bf16.enabled", False))
    out = open(args.out, "w") if args.out and rank == 0 else sys.stdout
    for step in range(1, steps + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        x, y = batches.next()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) if text else F.cross_entropy(
                logits, y)
        loss.backward()
        opt.step()
        lr = opt.param_groups[0]["lr"]
        sched.step()
        mean = loss.detach().float().reshape(1)
        if world > 1:  # the logged loss: mean over ranks, as tandem train
            dist.all_reduce(mean)
            mean /= world
        step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        if rank == 0:
            print(json.dumps({"step": step, "loss": mean.item(), "lr": lr, "step_s": step_s, "cpu_s": cpu_s,
                              "samples": global_batch, "tokens_per_sample": x.shape[1] if text else 0}),
                  file=out, flush=True)
    if world > 1:
        dist.destroy_process_group()


def main():
    args = parse()
    with open(args.config) as f:
        cfg = json.load(f)
    for key in ("fp16.enabled", "gradient_clipping"):
        if get(cfg, key):
            raise SystemExit(f"torch_train_ref.py: {key} is not reproduced here")
    if get(cfg, "train_micro_batch_size_per_gpu") or get(cfg, "gradient_accumulation_steps", 1) != 1:
        raise SystemExit("torch_train_ref.py: only train_batch_size (no accumulation) is reproduced")
    if args.nproc == 1:
        worker(0, args, cfg, 0)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, cfg, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
