"""PyTorch oracle for tests/oracle/ops_oracle_test.cc.

usage: ops_oracle.py IN_DIR OUT_DIR

IN_DIR (written by the C++ test) holds, for every case "<op>__<dtype>":
  <case>.x<i>  input i, a leaf that requires grad
  <case>.c<i>  input i, a constant (integer targets and indices, or floats without grad)
  <case>.w<k>  fixed random weights for floating output k
The inputs are passed to CASES[<op>] in index order. For each case the script writes to OUT_DIR
  <case>.out<k>  output k of the op
  <case>.g<i>    d/d x<i> of sum_k sum(out<k> * w<k>)  (zeros when x<i> is unused)
An unknown case name is an error (exit status 2), so the two sides cannot drift apart silently.
The protocol is implemented in oracle_common.py, shared with nn_oracle.py.
"""

import sys

import torch
import torch.nn.functional as F

import oracle_common


def _ce(reduction="mean", ignore_index=-100, label_smoothing=0.0):
    return lambda x, t: F.cross_entropy(
        x, t, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def _ce_w(reduction="mean", ignore_index=-100, label_smoothing=0.0):
    return lambda x, t, w: F.cross_entropy(
        x, t, weight=w, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def _nll(reduction="mean", ignore_index=-100):
    return lambda x, t: F.nll_loss(x, t, reduction=reduction, ignore_index=ignore_index)


CASES = {
    # ---- elementwise ----
    "add_bcast": lambda a, b: a + b,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2.5),
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=0.5),
    "mul_bcast": lambda a, b: a * b,
    "div_bcast": lambda a, b: a / b,
    "add_scalar": lambda a: a + 1.5,
    "mul_scalar": lambda a: a * -0.75,
    "div_scalar": lambda a: a / 3.0,
    "rsub_scalar": lambda a: 2.0 - a,
    "add_transposed": lambda a, b: a.t() + b,
    "reuse": lambda a: a * a + a,
    "neg": lambda a: -a,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "square": torch.square,
    "abs": torch.abs,
    "pow_3": lambda a: torch.pow(a, 3.0),
    "pow_half": lambda a: torch.pow(a, 0.5),
    "pow_neg": lambda a: torch.pow(a, -1.5),
    "pow_tensor": lambda a, b: torch.pow(a, b),
    "relu": torch.relu,
    "gelu_none": lambda a: F.gelu(a, approximate="none"),
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "clamp": lambda a: torch.clamp(a, -0.5, 0.5),
    "composite": lambda a, b: torch.tanh(a * b) + a / (1.0 + torch.exp(b)),
    # ---- reductions ----
    "sum_all": lambda a: a.sum(),
    "sum_dims_keepdim": lambda a: a.sum(dim=(0, 2), keepdim=True),
    "sum_last": lambda a: a.sum(dim=-1),
    "mean_all": lambda a: a.mean(),
    "mean_dim": lambda a: a.mean(dim=1),
    "mean_dims_keepdim": lambda a: a.mean(dim=(0, 2), keepdim=True),
    "max_dim": lambda a: tuple(torch.max(a, dim=1)),
    "max_dim_keepdim": lambda a: tuple(torch.max(a, dim=0, keepdim=True)),
    "max_all": lambda a: a.max(),
    "argmax": lambda a: torch.argmax(a, dim=-1),
    "min_dim": lambda a: tuple(torch.min(a, dim=1)),
    "min_dim_keepdim": lambda a: tuple(torch.min(a, dim=0, keepdim=True)),
    "min_all": lambda a: a.min(),
    "argmin": lambda a: torch.argmin(a, dim=-1),
    "var_all": lambda a: torch.var(a),
    "var_dims_keepdim": lambda a: torch.var(a, dim=(0, 2), keepdim=True),
    "var_correction0": lambda a: torch.var(a, dim=-1, unbiased=False),
    "std_dim": lambda a: torch.std(a, dim=1),
    "std_all_correction2": lambda a: torch.sqrt(((a - a.mean()) ** 2).sum() / (a.numel() - 2)),
    # ---- matmul / linear ----
    "mm": torch.matmul,
    "mm_transposed": lambda a, b: torch.matmul(a.t(), b),
    "bmm": torch.matmul,
    "matmul_bcast": torch.matmul,
    "matmul_3d_2d": torch.matmul,
    "dot": torch.matmul,
    "linear_bias": F.linear,
    "linear_nobias": F.linear,
    "linear_3d_bias": F.linear,
    # ---- softmax and losses ----
    "softmax_1": lambda a: torch.softmax(a, 1),
    "softmax_last": lambda a: torch.softmax(a, -1),
    "softmax_0": lambda a: torch.softmax(a, 0),
    "log_softmax_1": lambda a: torch.log_softmax(a, 1),
    "log_softmax_last": lambda a: torch.log_softmax(a, -1),
    "log_softmax_0": lambda a: torch.log_softmax(a, 0),
    "ce_mean": _ce(),
    "ce_sum": _ce("sum"),
    "ce_none": _ce("none"),
    "ce_ignore": _ce(),
    "ce_ignore_sum": _ce("sum"),
    "ce_ignore_custom": _ce(ignore_index=1),
    "ce_smooth": _ce(label_smoothing=0.1),
    "ce_smooth_sum": _ce("sum", label_smoothing=0.1),
    "ce_smooth_none": _ce("none", label_smoothing=0.1),
    "ce_smooth_ignore": _ce(label_smoothing=0.1),
    "ce_smooth_ignore_none": _ce("none", label_smoothing=0.1),
    "ce_4d_mean": _ce(),
    "ce_4d_none": _ce("none"),
    "ce_4d_smooth_ignore": _ce(label_smoothing=0.1),
    "ce_1d": _ce(),
    "ce_all_ignored": _ce(),
    "ce_weight_mean": _ce_w(),
    "ce_weight_sum": _ce_w("sum"),
    "ce_weight_none": _ce_w("none"),
    "ce_weight_smooth_ignore": _ce_w(label_smoothing=0.1),
    "ce_weight_4d_smooth_none": _ce_w("none", label_smoothing=0.2),
    "nll_mean": _nll(),
    "nll_sum": _nll("sum"),
    "nll_none": _nll("none"),
    "nll_ignore": _nll(),
    "nll_ignore_custom": _nll("sum", ignore_index=0),
    "mse_mean": lambda a, b: F.mse_loss(a, b),
    "mse_sum": lambda a, b: F.mse_loss(a, b, reduction="sum"),
    "mse_none": lambda a, b: F.mse_loss(a, b, reduction="none"),
    # ---- shape ops ----
    "cat_0": lambda a, b, c: torch.cat([a, b, c], 0),
    "cat_1": lambda a, b: torch.cat([a, b], 1),
    "cat_last": lambda a, b: torch.cat([a, b], -1),
    "stack_0": lambda a, b: torch.stack([a, b], 0),
    "stack_1": lambda a, b: torch.stack([a, b], 1),
    "split": lambda a: tuple(torch.split(a, 2, dim=1)),
    "split_sizes": lambda a: tuple(torch.split(a, [1, 3, 2], dim=0)),
    "chunk_3": lambda a: tuple(torch.chunk(a, 3, dim=1)),
    "chunk_uneven": lambda a: tuple(torch.chunk(a, 4, dim=0)),
    "index_select_0": lambda a, i: torch.index_select(a, 0, i),
    "index_select_1_i32": lambda a, i: torch.index_select(a, 1, i),
    "embedding": lambda w, i: F.embedding(i, w),
    "embedding_padding": lambda w, i: F.embedding(i, w, padding_idx=2),
    "views": lambda a: a.permute(2, 0, 1).reshape(4, 6).t()[1:5:2] * 2.0,
    "expand_select": lambda a: a.expand(3, 4, 5).select(1, 2) + a.narrow(0, 1, 2).sum(),
}


def main():
    return oracle_common.run_cases(sys.argv[1], sys.argv[2], CASES, "ops_oracle.py")


if __name__ == "__main__":
    sys.exit(main())
