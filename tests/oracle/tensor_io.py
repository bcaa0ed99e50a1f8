"""Tensor files shared with the C++ tests (tests/util/test_util.h: save_tensors / load_tensors).

A directory holds manifest.json, mapping each tensor's name to
{"dtype": "float32" | "float64" | "int64" | ..., "shape": [...], "file": "<name>.bin"},
and one .bin per tensor with its contiguous little-endian elements. Only torch is needed.
"""

import json
import os
import sys

import torch

assert sys.byteorder == "little", "the tensor files are little-endian"

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def load(directory):
    """Returns {name: tensor} (in manifest order) for a directory written by save_tensors."""
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for name, entry in manifest.items():
        dtype = DTYPES[entry["dtype"]]
        shape = [int(s) for s in entry["shape"]]
        with open(os.path.join(directory, entry["file"]), "rb") as f:
            data = bytearray(f.read())  # writable, so frombuffer does not warn
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(data) != numel * itemsize:
            raise ValueError(f"{directory}/{entry['file']}: {len(data)} bytes, expected {numel * itemsize}")
        out[name] = torch.frombuffer(data, dtype=dtype).reshape(shape).clone()
    return out


def save(directory, tensors):
    """Writes {name: tensor} in the same format (tensors are detached and made contiguous)."""
    os.makedirs(directory, exist_ok=True)
    manifest = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in NAMES:
            raise ValueError(f"{name}: unsupported dtype {t.dtype}")
        file = name + ".bin"
        with open(os.path.join(directory, file), "wb") as f:
            if t.numel() > 0:
                # numpy has no bfloat16: write those bytes through an int16 view.
                raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
                f.write(raw.numpy().tobytes())
        manifest[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "file": file}
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
