"""Python's safetensors as the oracle for tests/oracle/safetensors_oracle_test.cc.

Runs with the venv Python (.venv-test/bin/python, made by scripts/install-deps.sh), which has
safetensors from PyPI and sees Debian's torch and numpy.

usage:
  safetensors_roundtrip.py check FILE EXPECT_DIR META_JSON
      FILE was written by Tandem. Loads it with safetensors.torch.load_file and, tensor by tensor,
      with safetensors.numpy (numpy has no bfloat16: those are checked through torch only), and
      compares names, dtypes, shapes and bits with EXPECT_DIR (tensor_io format) and the metadata
      with the JSON object in META_JSON.
  safetensors_roundtrip.py rewrite FILE OUT
      Loads FILE with safetensors.numpy and writes the same tensors and metadata to OUT with
      safetensors.numpy.save_file (the test compares the two files byte for byte).
  safetensors_roundtrip.py write FILE EXPECT_DIR
      Writes tensors of every dtype (bfloat16 and float16 included, a 0-d and an empty tensor)
      with safetensors.torch.save_file and metadata {"source": "torch", "seed": "7"} to FILE, and
      the same tensors to EXPECT_DIR in tensor_io format.
  safetensors_roundtrip.py mlp FILE IN_DIR OUT_DIR
      Builds nn.Sequential(Flatten, Linear(784,1024), ReLU, Linear(1024,1024), ReLU,
      Linear(1024,10)), loads FILE into it with load_state_dict(strict=True), runs it on IN_DIR's
      "x" and writes "logits" to OUT_DIR.
  safetensors_roundtrip.py models GPT_FILE TIED_FILE N_HEAD OUT_DIR
      GPT_FILE is the W3 GPT's state dict saved by Tandem: loads it with load_file +
      load_state_dict(strict=True) into nn_oracle.GPT (sizes from the file) and writes the loaded
      state dict to OUT_DIR/gpt_loaded; writes a fresh seeded GPT with save_file to
      OUT_DIR/torch_gpt.safetensors and its state dict to OUT_DIR/torch_gpt_expect. TIED_FILE is a
      Tandem module with "emb.weight" and "head.weight" sharing one tensor (stored under both
      names): loads it into Tied (the same two modules, head.weight = emb.weight) strictly, checks
      that the two are still one tensor, and writes it to OUT_DIR/tied_loaded; writes a fresh Tied
      with save_model (which stores the shared tensor once) to OUT_DIR/torch_tied.safetensors and
      its weight to OUT_DIR/torch_tied_expect.
Exit status 0 when everything matched, 1 (with the differences printed) otherwise.
"""

import json
import sys

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open
import safetensors.numpy
import safetensors.torch

import tensor_io

# Same-width integer dtypes for comparing bits (NaN payloads and -0 included).
BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def bits(t):
    t = t.contiguous()
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


def same(a, b):
    """True when a and b have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def check(path, expect_dir, meta_json):
    expected = tensor_io.load(expect_dir)
    with open(meta_json) as f:
        expected_meta = json.load(f)
    problems = []

    got = safetensors.torch.load_file(path)
    if set(got) != set(expected):
        problems.append(f"torch: names {sorted(got)} != expected {sorted(expected)}")
    for name, want in expected.items():
        if name in got and not same(got[name], want):
            problems.append(f"torch: {name}: got {got[name].dtype} {list(got[name].shape)} {got[name]}, "
                            f"expected {want.dtype} {list(want.shape)} {want}")

    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
        if meta != expected_meta:
            problems.append(f"metadata {meta} != expected {expected_meta}")
        for name, want in expected.items():
            if want.dtype == torch.bfloat16:
                continue
            arr = f.get_tensor(name)
            as_torch = torch.from_numpy(arr.copy(order="C"))  # writable; 0-d stays 0-d
            if not same(as_torch, want):
                problems.append(f"numpy: {name}: got {arr.dtype} {arr.shape} {arr}, expected {want}")
    # load_file of a bfloat16-free file through numpy, too.
    if not any(t.dtype == torch.bfloat16 for t in expected.values()):
        arrays = safetensors.numpy.load_file(path)
        if set(arrays) != set(expected):
            problems.append(f"numpy.load_file: names {sorted(arrays)}")
    return problems


def rewrite(path, out):
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
    safetensors.numpy.save_file(safetensors.numpy.load_file(path), out, metadata=meta)
    return []


def write(path, expect_dir):
    g = torch.Generator().manual_seed(7)
    tensors = {
        "w_bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "w_f16": torch.randn(5, generator=g).to(torch.float16),
        "special_bf16": torch.tensor([float("inf"), -0.0, 1e-40, 3.0e38], dtype=torch.bfloat16),
        "special_f16": torch.tensor([65504.0, -6e-8, float("-inf"), 0.1], dtype=torch.float16),
        "f32": torch.randn(2, 3, 2, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 5]),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "mask": torch.tensor([[True, False, True]]),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 7, dtype=torch.float16),
    }
    safetensors.torch.save_file(tensors, path, metadata={"source": "torch", "seed": "7"})
    tensor_io.save(expect_dir, tensors)
    return []


def mlp(path, in_dir, out_dir):
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    model.load_state_dict(safetensors.torch.load_file(path), strict=True)
    x = tensor_io.load(in_dir)["x"]
    with torch.no_grad():
        logits = model(x)
    tensor_io.save(out_dir, {"logits": logits})
    return []


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def models(gpt_file, tied_file, n_head, out_dir):
    import nn_oracle  # the W3 definition the models oracle test compares against

    problems = []
    state = safetensors.torch.load_file(gpt_file)
    vocab, d = state["tok_emb.weight"].shape
    ctx = state["pos_emb.weight"].shape[0]
    n_layer = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    gpt = nn_oracle.GPT(vocab, ctx, n_layer, d, int(n_head))
    gpt.load_state_dict(state, strict=True)
    tensor_io.save(f"{out_dir}/gpt_loaded", gpt.state_dict())
    torch.manual_seed(5)
    fresh = nn_oracle.GPT(vocab, ctx, n_layer, d, int(n_head))
    safetensors.torch.save_file(fresh.state_dict(), f"{out_dir}/torch_gpt.safetensors")
    tensor_io.save(f"{out_dir}/torch_gpt_expect", fresh.state_dict())

    tied = Tied()
    tied.load_state_dict(safetensors.torch.load_file(tied_file), strict=True)
    if tied.head.weight is not tied.emb.weight:
        problems.append("Tied: head.weight and emb.weight are no longer one tensor")
    tensor_io.save(f"{out_dir}/tied_loaded", {"emb.weight": tied.emb.weight.detach()})
    torch.manual_seed(6)
    fresh_tied = Tied()
    safetensors.torch.save_model(fresh_tied, f"{out_dir}/torch_tied.safetensors")
    tensor_io.save(f"{out_dir}/torch_tied_expect", {"emb.weight": fresh_tied.emb.weight.detach()})
    return problems


def main(argv):
    modes = {"check": check, "rewrite": rewrite, "write": write, "mlp": mlp, "models": models}
    if len(argv) < 2 or argv[1] not in modes:
        print(__doc__)
        return 2
    problems = modes[argv[1]](*argv[2:])
    for p in problems:
        print("safetensors_roundtrip.py:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
