"""PyTorch oracle for tests/amp and tests/oracle/amp_oracle_test.cc.

  amp_oracle.py policy OUT_DIR
      Runs every op of Tandem's autocast policy table (tandem/amp/policy.cc) under
      torch.autocast('cpu', dtype=torch.bfloat16) with float32 inputs, bfloat16 inputs and mixed
      (first input bfloat16, the rest float32), and writes OUT_DIR/policy.json:
      {op: {"f32": dtype, "bf16": dtype, "mixed": dtype, "category": c}} where c is the category
      torch's CPU autocast shows: "lower_precision" (f32 in -> bf16 out), "fp32" (bf16 in -> f32
      out), "promote" (mixed in -> f32 out) or "none" (no cast on CPU). A combination torch
      rejects is recorded as "error"; an op this torch lacks as {"missing": true}.

  amp_oracle.py deepspeed OUT_DIR STEPS SPEC HYSTERESIS CONSECUTIVE MIN_SCALE WINDOW INIT_POWER
      DeepSpeed's DynamicLossScaler rule (fp16 config: hysteresis, consecutive_hysteresis,
      min_loss_scale, loss_scale_window, initial_scale_power) over the same kind of SPEC
      (steps that overflow); writes OUT_DIR/deepspeed.json with the scale used and after each step.

  amp_oracle.py scaler OUT_DIR STEPS SPEC
      The GradScaler scale sequence: SPEC is a comma-separated list of step:kind with kind inf
      or nan, the gradient that step holds. Writes OUT_DIR/scaler.json with, per step, the
      scale used, whether the optimizer stepped, and the scale after update().
"""

import json
import math
import os
import sys

# torch is imported by the modes that use it (policy, scaler): the deepspeed mode is plain Python
# and starts in milliseconds.
torch = F = None


def import_torch():
    global torch, F
    import torch as _torch
    import torch.nn.functional as _F
    torch, F = _torch, _F


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
        # not in Tandem's table: no cast in either
        "relu": ((r(4, 8),), lambda x: F.relu(x)),
        "gelu": ((r(4, 8),), lambda x: F.gelu(x)),
        "add": ((r(4, 8), r(4, 8)), lambda a, b: a + b),
        "mul": ((r(4, 8), r(4, 8)), lambda a, b: a * b),
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


def deepspeed(out_dir, steps, spec, hysteresis, consecutive, min_scale, window, init_power):
    """DeepSpeed's documented dynamic loss scaling (runtime/fp16/loss_scaler.py,
    DynamicLossScaler.update_scale), written out here: an overflow either spends one unit of
    hysteresis or, when none is left beyond the last, divides the scale by 2 (never below
    min_loss_scale); a step without overflow doubles the scale when the number of iterations since
    the last overflow is a multiple of loss_scale_window, refilling the hysteresis then (or on
    every good step with consecutive_hysteresis)."""
    bad = {int(item.split(":")[0]) for item in filter(None, spec.split(","))}
    scale = float(2 ** init_power)
    cur_hysteresis = hysteresis
    last_overflow_iter = -1
    rows = []
    for it in range(steps):
        used = scale
        overflow = it in bad
        if overflow:
            if hysteresis == 1 or cur_hysteresis == 1:
                scale = max(scale / 2.0, min_scale)
            else:
                cur_hysteresis -= 1
            last_overflow_iter = it
        else:
            if consecutive:
                cur_hysteresis = hysteresis
            if (it - last_overflow_iter) % window == 0:
                if not consecutive:
                    cur_hysteresis = hysteresis
                scale *= 2.0
        rows.append({"step": it, "scale_used": used, "stepped": not overflow, "scale_after": scale})
    with open(os.path.join(out_dir, "deepspeed.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "policy":
        import_torch()
        return policy(out_dir)
    if mode == "deepspeed":
        a = sys.argv
        return deepspeed(out_dir, int(a[3]), a[4], int(a[5]), a[6] == "1", float(a[7]), int(a[8]), int(a[9]))
    if mode == "scaler":
        import_torch()
        return scaler(out_dir, int(sys.argv[3]), sys.argv[4])
    print(f"amp_oracle.py: unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
