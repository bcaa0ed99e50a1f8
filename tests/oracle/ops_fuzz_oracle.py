"""PyTorch oracle for tests/oracle/ops_fuzz_oracle_test.cc: the seeded random sweep of conv2d,
the pools, the norms and the selection ops (where, masked_fill, tril, triu).

usage: ops_fuzz_oracle.py IN_DIR OUT_DIR

IN_DIR follows the case protocol of oracle_common.py (<case>.x<i>, <case>.c<i>, <case>.w<k>, case
names "<id>__<dtype>"), plus cases.json mapping every <id> to its spec:
  {"op": "conv2d" | "max_pool2d" | "avg_pool2d" | "adaptive_avg_pool2d" | "batch_norm" |
         "bn_module" | "group_norm" | "layer_norm" | "where" | "masked_fill" | "tril" | "triu",
   "views": ["" | "t" | "cl" | "s" | "n1", ...]  (one per input, see VIEWS),
   "out_t": true when the first output (if 2-d or more) is transposed before the loss, so that
            its gradient reaches the op non-contiguous,
   ...the op's arguments, named as in torch.nn.functional}
The C++ side stores every floating input and weight as float64 (exact for its f32/bf16 values),
so the reference is always computed in f64, whatever dtype Tandem computed in. An unknown op,
view or argument is an error (exit status 2), so the two sides cannot drift apart silently.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

import oracle_common

# The input views, applied to the stored tensor before the op (the same on the C++ side):
VIEWS = {
    "": lambda x: x,
    "t": lambda x: x.transpose(-2, -1),               # stored with the last two dims swapped
    "cl": lambda x: x.permute(0, 3, 1, 2),            # stored (N, H, W, C): channels-last strides
    "s": lambda x: x[..., ::2],                       # stored with twice the last dim, every 2nd
    "n1": lambda x: x.narrow(1, 1, x.shape[1] - 2),   # stored with 2 more in dim 1, the middle
}


def _pair(v):
    """A JSON [a, b] as a tuple; null (PyTorch's default, e.g. a pool's stride) as None."""
    return tuple(v) if isinstance(v, list) else v


def _conv2d(s):
    def f(x, w, b=None):
        return F.conv2d(x, w, b, stride=_pair(s["stride"]), padding=_pair(s["padding"]),
                        dilation=_pair(s["dilation"]), groups=s["groups"])
    return f


def _max_pool2d(s):
    return lambda x: F.max_pool2d(x, _pair(s["kernel_size"]), stride=_pair(s["stride"]),
                                  padding=_pair(s["padding"]), dilation=_pair(s["dilation"]),
                                  ceil_mode=s["ceil_mode"])


def _avg_pool2d(s):
    return lambda x: F.avg_pool2d(x, _pair(s["kernel_size"]), stride=_pair(s["stride"]),
                                  padding=_pair(s["padding"]), ceil_mode=s["ceil_mode"],
                                  count_include_pad=s["count_include_pad"])


def _adaptive_avg_pool2d(s):
    return lambda x: F.adaptive_avg_pool2d(x, _pair(s["output_size"]))


def _batch_norm(s):
    """Inputs: x, then running_mean and running_var when s["running"], then weight and bias when
    s["weight"] / s["bias"]. Outputs y (relu(y) when s["relu"]) and, with running stats, the
    running stats after the call (updated in place in training)."""
    def f(x, *rest):
        rest = list(rest)
        rm = rest.pop(0) if s["running"] else None
        rv = rest.pop(0) if s["running"] else None
        w = rest.pop(0) if s["weight"] else None
        b = rest.pop(0) if s["bias"] else None
        assert not rest, "batch_norm: unexpected inputs"
        y = F.batch_norm(x, rm, rv, w, b, training=s["training"], momentum=s["momentum"], eps=s["eps"])
        if s["relu"]:
            y = torch.relu(y)
        return (y, rm, rv) if s["running"] else y
    return f


def _bn_module(s):
    """nn.BatchNorm2d: two training steps, then eval; its weight and bias are the case's inputs."""
    def f(x0, x1, x2, *params):
        m = torch.nn.BatchNorm2d(x0.shape[1], eps=s["eps"], momentum=s["momentum"], affine=s["affine"],
                                 track_running_stats=s["track_running_stats"]).double()
        if s["affine"]:
            del m.weight, m.bias
            m.weight, m.bias = params
        out = [m(x0), m(x1)]
        m.eval()
        out.append(m(x2))
        if s["track_running_stats"]:
            out += [m.running_mean, m.running_var, m.num_batches_tracked]
        return tuple(out)
    return f


def _affine_inputs(s, rest):
    rest = list(rest)
    w = rest.pop(0) if s["weight"] else None
    b = rest.pop(0) if s["bias"] else None
    assert not rest, "unexpected inputs"
    return w, b


def _group_norm(s):
    def f(x, *rest):
        w, b = _affine_inputs(s, rest)
        if w is None and b is not None:
            # torch 1.13's group_norm backward fails ("tensor does not have a device") with a bias
            # and no weight; a constant weight of ones is the same function.
            w = torch.ones(x.shape[1], dtype=x.dtype)
        return F.group_norm(x, s["num_groups"], w, b, eps=s["eps"])
    return f


def _layer_norm(s):
    return lambda x, *rest: F.layer_norm(x, tuple(s["normalized_shape"]), *_affine_inputs(s, rest), eps=s["eps"])


def _where(s):
    return lambda cond, a, b: torch.where(cond, a, b)


def _masked_fill(s):
    return lambda x, mask: x.masked_fill(mask, float(s["value"]))


def _tril(s):
    return lambda x: torch.tril(x, s["diagonal"])


def _triu(s):
    return lambda x: torch.triu(x, s["diagonal"])


OPS = {
    "conv2d": _conv2d,
    "max_pool2d": _max_pool2d,
    "avg_pool2d": _avg_pool2d,
    "adaptive_avg_pool2d": _adaptive_avg_pool2d,
    "batch_norm": _batch_norm,
    "bn_module": _bn_module,
    "group_norm": _group_norm,
    "layer_norm": _layer_norm,
    "where": _where,
    "masked_fill": _masked_fill,
    "tril": _tril,
    "triu": _triu,
}


def _case(spec):
    op = OPS[spec["op"]](spec)
    views = [VIEWS[v] for v in spec["views"]]

    def f(*inputs):
        if len(inputs) != len(views):
            raise ValueError(f"{spec['op']}: {len(inputs)} inputs for {len(views)} views")
        out = op(*[v(x) for v, x in zip(views, inputs)])
        if spec["out_t"]:  # the first output reaches the loss transposed (see VIEWS["t"])
            if isinstance(out, tuple):
                first = out[0] if out[0].dim() < 2 else out[0].transpose(-2, -1)
                out = (first,) + out[1:]
            elif out.dim() >= 2:
                out = out.transpose(-2, -1)
        return out
    return f


def main():
    in_dir, out_dir = sys.argv[1], sys.argv[2]
    with open(os.path.join(in_dir, "cases.json")) as fh:
        specs = json.load(fh)
    cases = {}
    for case_id, spec in specs.items():
        if spec.get("op") not in OPS or any(v not in VIEWS for v in spec.get("views", [])):
            print(f"ops_fuzz_oracle.py: bad spec for {case_id!r}: {spec}", file=sys.stderr)
            return 2
        cases[case_id] = _case(spec)
    torch.set_default_dtype(torch.float64)
    return oracle_common.run_cases(in_dir, out_dir, cases, "ops_fuzz_oracle.py")


if __name__ == "__main__":
    sys.exit(main())
