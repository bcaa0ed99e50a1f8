"""The case protocol shared by ops_oracle.py and nn_oracle.py ("ops" mode).

IN_DIR (written by the C++ test, tests/oracle/oracle_cases.h) holds, for every case
"<op>__<dtype>":
  <case>.x<i>  input i, a leaf that requires grad
  <case>.c<i>  input i, a constant (integer targets and indices, or floats without grad)
  <case>.w<k>  fixed random weights for floating output k
The inputs are passed to cases[<op>] in index order. For each case run_cases writes to OUT_DIR
  <case>.out<k>  output k of the op
  <case>.g<i>    d/d x<i> of sum_k sum(out<k> * w<k>)  (zeros when x<i> is unused)
An unknown case name is an error (exit status 2), so the two sides cannot drift apart silently.
"""

import re
import sys

import torch

import tensor_io

NAME = re.compile(r"^(?P<case>.+)\.(?P<kind>[xcw])(?P<index>\d+)$")


def run_cases(in_dir, out_dir, cases_by_op, prog, skip_loss_without_grad=False):
    """Runs every case of IN_DIR through cases_by_op[<op>] and writes the results to OUT_DIR.

    prog names the script in error messages. With skip_loss_without_grad, a case whose loss
    does not require grad gets no gradients (instead of torch.autograd.grad raising). Returns
    the exit status: 0, or 2 for an unexpected tensor name or an unknown case.
    """
    tensors = tensor_io.load(in_dir)
    cases = {}
    for name, t in tensors.items():
        m = NAME.match(name)
        if not m:
            print(f"{prog}: unexpected tensor name {name!r}", file=sys.stderr)
            return 2
        entry = cases.setdefault(m["case"], {"inputs": {}, "weights": {}})
        if m["kind"] == "w":
            entry["weights"][int(m["index"])] = t
        else:
            entry["inputs"][int(m["index"])] = (m["kind"], t)

    results = {}
    for case, entry in cases.items():
        op = case.split("__")[0]
        if op not in cases_by_op:
            print(f"{prog}: no oracle for case {case!r}", file=sys.stderr)
            return 2
        inputs, leaves = [], []
        for i in sorted(entry["inputs"]):
            kind, t = entry["inputs"][i]
            if kind == "x":
                t = t.clone().requires_grad_(True)
                leaves.append((i, t))
            inputs.append(t)
        outs = cases_by_op[op](*inputs)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        loss = None
        for k, o in enumerate(outs):
            results[f"{case}.out{k}"] = o
            if o.is_floating_point():
                term = (o * entry["weights"][k]).sum()
                loss = term if loss is None else loss + term
        if loss is not None and leaves and (loss.requires_grad or not skip_loss_without_grad):
            grads = torch.autograd.grad(loss, [t for _, t in leaves], allow_unused=True)
            for (i, t), g in zip(leaves, grads):
                results[f"{case}.g{i}"] = torch.zeros_like(t) if g is None else g
    tensor_io.save(out_dir, results)
    return 0
