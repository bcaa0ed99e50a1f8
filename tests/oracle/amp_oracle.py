"""PyTorch oracle for tests/amp and tests/oracle/amp_oracle_test.cc.

  amp_oracle.py policy OUT_DIR
      Runs every op of Tandem's autocast policy table (tandem/amp/policy.cc) under
      torch.autocast('cpu', dtype=torch.bfloat16) with float32 inputs, bfloat16 inputs and mixed
      (first input bfloat16, the rest float32), and writes OUT_DIR/policy.json:
      {op: {"f32": dtype, "bf16": dtype, "mixed": dtype, "category": c}} where c is the category
      torch's CPU autocast shows: "lower_precision" (f32 in -> bf16 out), "fp32" (bf16 in -> f32
      out), "promote" (mixed in -> f32 out) or "none" (no cast on CPU). A combination torch
      rejects is recorded as "error"; an op this torch lacks as {"missing": true}.

  amp_oracle.py scaler OUT_DIR STEPS SPEC
      The GradScaler scale sequence: SPEC is a comma-separated list of step:kind with kind inf
      or nan, the gradient that step holds. Writes OUT_DIR/scaler.json with, per step, the
      scale used, whether the optimizer stepped, and the scale after update().
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F


def policy_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    t = torch.randint(0, 8, (4,), generator=g)
    cond = r(4, 8) > 0
    return {
        "matmul": ((r(4, 8), r(8, 8)), lambda a, b: torch.matmul(a, b)),
        "linear": ((r(4, 8), r(6, 8), r(6)), lambda x, w, b: F.linear(x, w, b)),
        "conv2d": ((r(2, 3, 8, 8), r(4, 3, 3, 3), r(4)), lambda x, w, b: F.conv2d(x, w, b)),
        "scaled_dot_product_attention": ((r(2, 5, 8), r(2, 5, 8), r(2, 5, 8)),
                                         (lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
                                         if hasattr(F, "scaled_dot_product_attention") else None),
        "softmax": ((r(4, 8),), lambda x: F.softmax(x, 1)),
        "log_softmax": ((r(4, 8),), lambda x: F.log_softmax(x, 1)),
        "cross_entropy": ((r(4, 8),), lambda x: F.cross_entropy(x, t)),
        "nll_loss": ((r(4, 8),), lambda x: F.nll_loss(x, t)),
        "mse_loss": ((r(4, 8), r(4, 8)), lambda x, y: F.mse_loss(x, y)),
        "layer_norm": ((r(4, 8), r(8), r(8)), lambda x, w, b: F.layer_norm(x, (8,), w, b)),
        "group_norm": ((r(2, 4, 3, 3), r(4), r(4)), lambda x, w, b: F.group_norm(x, 2, w, b)),
        "batch_norm": ((r(4, 3, 5), r(3), r(3)),
                       lambda x, w, b: F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, training=True)),
        "sum": ((r(4, 8),), lambda x: torch.sum(x)),
        "mean": ((r(4, 8),), lambda x: torch.mean(x)),
        "exp": ((r(4, 8),), lambda x: torch.exp(x)),
        "log": ((r(4, 8).abs() + 1,), lambda x: torch.log(x)),
        "pow": ((r(4, 8),), lambda x: torch.pow(x, 2.0)),
        "cat": ((r(4, 8), r(4, 8)), lambda a, b: torch.cat([a, b])),
        "stack": ((r(4, 8), r(4, 8)), lambda a, b: torch.stack([a, b])),
        "where": ((r(4, 8), r(4, 8)), lambda a, b: torch.where(cond, a, b)),
    }


def dtype_name(d):
    return str(d).replace("torch.", "")


def policy(out_dir):
    table = {}
    for op, (inputs, fn) in policy_cases().items():
        if fn is None:
            table[op] = {"missing": True}
            continue
        row = {}
        for mode in ("f32", "bf16", "mixed"):
            if mode == "f32":
                args = inputs
            elif mode == "bf16":
                args = tuple(a.bfloat16() for a in inputs)
            else:
                args = (inputs[0].bfloat16(),) + tuple(inputs[1:])
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    row[mode] = dtype_name(fn(*args).dtype)
            except RuntimeError:
                row[mode] = "error"
        if row["f32"] == "bfloat16":
            row["category"] = "lower_precision"
        elif row["bf16"] == "float32":
            row["category"] = "fp32"
        elif row["mixed"] == "float32" and len(inputs) > 1:
            row["category"] = "promote"
        else:
            row["category"] = "none"
        table[op] = row
    with open(os.path.join(out_dir, "policy.json"), "w") as f:
        json.dump({"torch": torch.__version__, "ops": table}, f, indent=1)
    return 0


def scaler(out_dir, steps, spec):
    """torch 1.13's CPU build has no CPU kernel for torch._amp_update_scale_ nor
    _amp_foreach_non_finite_check_and_unscale_ (both CUDA-only there), so GradScaler cannot run
    on CPU tensors. This reimplements their rule line by line, in float32 as torch keeps the
    scale, with GradScaler's defaults and growth_interval 3:
      found_inf:  scale *= backoff_factor; growth_tracker = 0
      otherwise:  growth_tracker += 1; if it reaches growth_interval: the grown scale is kept
                  when finite, growth_tracker = 0
    The inputs are true float32 tensors and torch's own arithmetic, so the rounding is torch's."""
    bad = {}
    for item in filter(None, spec.split(",")):
        s, kind = item.split(":")
        bad[int(s)] = kind
    scale = torch.full((), 65536.0, dtype=torch.float32)
    growth = torch.tensor(2.0, dtype=torch.float32)
    backoff = torch.tensor(0.5, dtype=torch.float32)
    growth_interval, tracker = 3, 0
    rows = []
    for step in range(steps):
        grad = torch.full((5,), 0.25, dtype=torch.float32) * scale  # a scaled gradient
        if step in bad:
            grad[2] = float("inf") if bad[step] == "inf" else float("nan")
        inv_scale = scale.double().reciprocal().float()
        found_inf = bool((~torch.isfinite(grad)).any())
        grad = grad * inv_scale
        used = float(scale)
        if found_inf:
            scale = scale * backoff
            tracker = 0
        else:
            tracker += 1
            if tracker == growth_interval:
                grown = scale * growth
                if math.isfinite(float(grown)):
                    scale = grown
                tracker = 0
        rows.append({"step": step, "scale_used": used, "stepped": not found_inf, "scale_after": float(scale),
                     "unscaled_grad0": float(grad[0])})
    with open(os.path.join(out_dir, "scaler.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "policy":
        return policy(out_dir)
    if mode == "scaler":
        return scaler(out_dir, int(sys.argv[3]), sys.argv[4])
    print(f"amp_oracle.py: unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
