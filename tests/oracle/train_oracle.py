"""PyTorch oracle for tests/oracle/train_oracle_test.cc.

usage:
  train_oracle.py train IN_DIR OUT_DIR RUN...
  train_oracle.py rules IN_DIR OUT_DIR RUN...
  train_oracle.py clip  IN_DIR OUT_DIR CASE...

A RUN is "<name>:<key>=<value>,..." with keys optimizer (sgd | adam | adamw), steps, lr,
momentum, dampening, weight_decay, nesterov, beta1, beta2, eps, amsgrad, maximize, clip (max grad norm,
0 = none).

train: an MLP nn.Sequential(Flatten, Linear, ReLU, ..., Linear) whose layer sizes come from
  IN_DIR's "<name>.init.<k>.weight" / ".bias" tensors is loaded with those values and trained
  for `steps` steps on the batches "data.x<i>" / "data.y<i>" (step s uses batch s mod count):
  zero_grad, loss = cross_entropy(model(x), y), backward, [clip_grad_norm_], step. Writes
  "<name>.losses" (f32, one per step, before the step's update), "<name>.grad0.<param>" (the
  first step's gradients) and "<name>.final.<param>".
rules: the optimizer alone: parameters "<name>.p<i>" get the gradients "<name>.g<t>.<i>" at step
  t; writes "<name>.final<i>" and each state tensor as "<name>.state<i>.<key>".
clip: a CASE is "<name>:max_norm=<v>,norm_type=<v|inf>": parameters "<name>.p<i>" with gradients
  "<name>.g<i>" (absent = no gradient); writes "<name>.norm" and the clipped "<name>.clipped<i>".
"""

import math
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tensor_io


def parse_run(spec):
    name, _, rest = spec.partition(":")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value
    return name, opts


def make_optimizer(params, o):
    kind = o["optimizer"]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=float(o["lr"]), momentum=float(o.get("momentum", 0)),
                               dampening=float(o.get("dampening", 0)),
                               weight_decay=float(o.get("weight_decay", 0)),
                               nesterov=o.get("nesterov", "0") == "1", maximize=o.get("maximize", "0") == "1",
                               foreach=False)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(params, lr=float(o["lr"]), betas=(float(o["beta1"]), float(o["beta2"])), eps=float(o["eps"]),
               weight_decay=float(o["weight_decay"]), amsgrad=o.get("amsgrad", "0") == "1", maximize=o.get("maximize", "0") == "1", foreach=False)


def build_mlp(state):
    layers = sorted({int(k.split(".")[0]) for k in state})
    modules = [nn.Flatten()]
    for n, idx in enumerate(layers):
        assert idx == len(modules), f"unexpected layer index {idx}"
        out_f, in_f = state[f"{idx}.weight"].shape
        modules.append(nn.Linear(in_f, out_f))
        if n + 1 < len(layers):
            modules.append(nn.ReLU())
    model = nn.Sequential(*modules)
    model.load_state_dict(state, strict=True)
    return model


def train(tensors, run_specs):
    out = {}
    xs = [tensors[f"data.x{i}"] for i in range(sum(1 for k in tensors if re.fullmatch(r"data\.x\d+", k)))]
    ys = [tensors[f"data.y{i}"] for i in range(len(xs))]
    for spec in run_specs:
        name, o = parse_run(spec)
        prefix = f"{name}.init."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        model = build_mlp(state)
        opt = make_optimizer(model.parameters(), o)
        clip = float(o.get("clip", 0))
        losses = []
        for step in range(int(o["steps"])):
            x, y = xs[step % len(xs)], ys[step % len(ys)]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if step == 0:
                for pname, p in model.named_parameters():
                    out[f"{name}.grad0.{pname}"] = p.grad.clone()
            opt.step()
            losses.append(loss.detach().reshape(1))
        out[f"{name}.losses"] = torch.cat(losses)
        for pname, p in model.named_parameters():
            out[f"{name}.final.{pname}"] = p.detach()
    return out


def rules(tensors, run_specs):
    out = {}
    for spec in run_specs:
        name, o = parse_run(spec)
        params = []
        while f"{name}.p{len(params)}" in tensors:
            params.append(tensors[f"{name}.p{len(params)}"].clone().requires_grad_(True))
        opt = make_optimizer(params, o)
        for t in range(int(o["steps"])):
            for i, p in enumerate(params):
                p.grad = tensors[f"{name}.g{t}.{i}"].clone()
            opt.step()
        for i, p in enumerate(params):
            out[f"{name}.final{i}"] = p.detach()
            for key, value in opt.state[p].items():
                if torch.is_tensor(value):
                    out[f"{name}.state{i}.{key}"] = value.to(torch.float64) if key == "step" else value
    return out


def clip(tensors, case_specs):
    out = {}
    for spec in case_specs:
        name, o = parse_run(spec)
        params = []
        while f"{name}.p{len(params)}" in tensors:
            i = len(params)
            p = tensors[f"{name}.p{i}"].clone().requires_grad_(True)
            if f"{name}.g{i}" in tensors:
                p.grad = tensors[f"{name}.g{i}"].clone()
            params.append(p)
        norm_type = math.inf if o["norm_type"] == "inf" else float(o["norm_type"])
        total = torch.nn.utils.clip_grad_norm_(params, float(o["max_norm"]), norm_type=norm_type)
        out[f"{name}.norm"] = total.detach().to(torch.float64).reshape(())
        for i, p in enumerate(params):
            if p.grad is not None:
                out[f"{name}.clipped{i}"] = p.grad
    return out


def main():
    mode, in_dir, out_dir, specs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    torch.set_num_threads(1)
    tensors = tensor_io.load(in_dir)
    fn = {"train": train, "rules": rules, "clip": clip}.get(mode)
    if fn is None:
        print(f"train_oracle.py: unknown mode {mode!r}", file=sys.stderr)
        return 2
    tensor_io.save(out_dir, fn(tensors, specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
