"""PyTorch oracle for tests/oracle/models_oracle_test.cc (issue #4: conv, pools, norms, attention,
and the W2 CNN / W3 GPT models).

usage:
  nn_oracle.py ops IN_DIR OUT_DIR
  nn_oracle.py cnn IN_DIR OUT_DIR STEPS LR
  nn_oracle.py gpt IN_DIR OUT_DIR STEPS LR N_HEAD

ops: the protocol of ops_oracle.py. IN_DIR holds, for every case "<op>__<dtype>",
  <case>.x<i> (input i, a leaf requiring grad), <case>.c<i> (a constant input) and <case>.w<k>
  (weights for floating output k). CASES[<op>] gets the inputs in index order; the script writes
  <case>.out<k> and <case>.g<i> = d/d x<i> of sum_k sum(out<k> * w<k>) (zeros when unused).
  An unknown case is an error (exit status 2).

cnn / gpt: IN_DIR holds the Tandem model's initial state_dict as "init.<name>" and batches
  "data.x<i>" / "data.y<i>". The script builds the PyTorch model of the header
  (src/tandem/nn/models/cnn.h, gpt.h), writes its state_dict names and shapes to
  OUT_DIR/state_names.txt and its named_parameters to OUT_DIR/param_names.txt ("name d0,d1,..."
  per line, in PyTorch's order) before loading the Tandem values with strict=True (a mismatch
  exits with status 3), then trains STEPS steps of AdamW(lr=LR, weight_decay=0.01) on batch
  s mod count: zero_grad, loss = cross_entropy(model(x), y) (flattened over (B, T) for gpt),
  backward, step. Writes "losses" (f32, one per step, before the step's update), "grad0.<param>"
  (the first step's gradients), "final.<name>" (every state_dict entry after training) and
  cnn: "eval_logits" (model.eval() on data.x0 after training); gpt: "logits0" (the initial
  model on data.x0, before training).
"""

import math
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import oracle_common
import tensor_io


# ------------------------------------------------------------------------------------ ops

def _channels_last(x):
    return x.contiguous(memory_format=torch.channels_last)


def _conv(stride=1, padding=0, dilation=1, groups=1, channels_last=False):
    def f(x, w, b=None):
        if channels_last:
            x = _channels_last(x)
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    return f


def _max_pool(kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    return lambda x: F.max_pool2d(x, kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)


def _avg_pool(kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    return lambda x: F.avg_pool2d(x, kernel, stride=stride, padding=padding, ceil_mode=ceil_mode,
                                  count_include_pad=count_include_pad)


def _bn_train(channels_last=False):
    def f(x, w=None, b=None):
        if channels_last:
            x = _channels_last(x)
        return F.batch_norm(x, None, None, w, b, training=True)
    return f


def _bn_eval(channels_last=False):
    def f(x, rm, rv, w, b):
        if channels_last:
            x = _channels_last(x)
        return F.batch_norm(x, rm, rv, w, b, training=False)
    return f


def _bn_three_steps(x0, x1, x2, w, b):
    """Three training steps from running_mean 0 / running_var 1 (momentum 0.1): the last
    output and the running stats."""
    c = x0.shape[1]
    rm = torch.zeros(c, dtype=x0.dtype)
    rv = torch.ones(c, dtype=x0.dtype)
    y = None
    for x in (x0, x1, x2):
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)
    return y, rm, rv


def sdpa(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale + mask) v, mask -inf where key j > query i (top-left aligned), as
    torch 1.13 has no F.scaled_dot_product_attention."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        t, s = q.shape[-2], k.shape[-2]
        mask = torch.zeros(t, s, dtype=q.dtype)
        mask.masked_fill_(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


CASES = {
    # ---- conv2d ----
    "conv_plain": _conv(),
    "conv_plain_nobias": _conv(),
    "conv_s2p1": _conv(stride=2, padding=1),
    "conv_asym_dilation": _conv(stride=(1, 2), padding=(2, 1), dilation=(2, 1)),
    "conv_groups2": _conv(padding=1, groups=2),
    "conv_depthwise": _conv(stride=2, padding=1, groups=6),
    "conv_1x1": _conv(),
    "conv_channels_last_in": _conv(padding=1, channels_last=True),
    # ---- pools ----
    "maxpool_k2": _max_pool(2),
    "maxpool_k3s2p1": _max_pool(3, 2, 1),
    "maxpool_asym": _max_pool((3, 2), (2, 1), (1, 0)),
    "maxpool_dil_ceil": _max_pool(3, 2, 1, dilation=2, ceil_mode=True),
    "maxpool_ceil": _max_pool(3, 2, ceil_mode=True),
    "avgpool_k2": _avg_pool(2),
    "avgpool_k3s2p1_incl": _avg_pool(3, 2, 1),
    "avgpool_k3s2p1_excl": _avg_pool(3, 2, 1, count_include_pad=False),
    "avgpool_ceil_incl": _avg_pool(3, 2, 1, ceil_mode=True),
    "avgpool_ceil_excl": _avg_pool(3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avgpool_asym_excl": _avg_pool((2, 3), (1, 2), (1, 1), count_include_pad=False),
    "adaptive_3x2": lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
    "adaptive_4x5": lambda x: F.adaptive_avg_pool2d(x, (4, 5)),
    "adaptive_1x1": lambda x: F.adaptive_avg_pool2d(x, (1, 1)),
    # ---- norms ----
    "bn_train": _bn_train(),
    "bn_train_cl": _bn_train(channels_last=True),
    "bn_train_noaffine": _bn_train(),
    "bn_train_1d": _bn_train(),
    "bn_train_1d3": _bn_train(),
    "bn_eval": _bn_eval(),
    "bn_eval_cl": _bn_eval(channels_last=True),
    "bn_three_steps": _bn_three_steps,
    "ln_1": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
    "ln_2": lambda x, w, b: F.layer_norm(x, x.shape[-2:], w, b),
    "ln_noaffine": lambda x: F.layer_norm(x, x.shape[-1:]),
    "gn_1": lambda x, w, b: F.group_norm(x, 1, w, b),
    "gn_3": lambda x, w, b: F.group_norm(x, 3, w, b),
    "gn_6": lambda x, w, b: F.group_norm(x, 6, w, b),
    "gn_3d_noaffine": lambda x: F.group_norm(x, 2),
    # ---- attention ----
    "attn": lambda q, k, v: sdpa(q, k, v),
    "attn_causal": lambda q, k, v: sdpa(q, k, v, causal=True),
    "attn_cross": lambda q, k, v: sdpa(q, k, v),
    "attn_cross_causal": lambda q, k, v: sdpa(q, k, v, causal=True),
    "attn_long_q_causal": lambda q, k, v: sdpa(q, k, v, causal=True),
    "attn_scale": lambda q, k, v: sdpa(q, k, v, scale=0.3),
    "attn_scale_causal": lambda q, k, v: sdpa(q, k, v, causal=True, scale=1.7),
}


def ops(in_dir, out_dir):
    return oracle_common.run_cases(in_dir, out_dir, CASES, "nn_oracle.py", skip_loss_without_grad=True)


# ------------------------------------------------------------------------------------ models

class CNN(nn.Module):
    """W2, exactly as in src/tandem/nn/models/cnn.h."""

    def __init__(self):
        super().__init__()
        block = lambda cin, cout, s: [nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        self.features = nn.Sequential(*block(1, 32, 1), *block(32, 64, 2), *block(64, 128, 2))
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        heads = lambda z: z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        y = sdpa(heads(q), heads(k), heads(v), causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """W3, exactly as in src/tandem/nn/models/gpt.h (head tied to tok_emb)."""

    def __init__(self, vocab, ctx, n_layer, d, n_head):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def _write_names(path, named):
    with open(path, "w") as f:
        for name, t in named:
            f.write(f"{name} {','.join(str(s) for s in t.shape)}\n")


def _batches(tensors):
    n = sum(1 for k in tensors if re.fullmatch(r"data\.x\d+", k))
    return [tensors[f"data.x{i}"] for i in range(n)], [tensors[f"data.y{i}"] for i in range(n)]


def train_model(model, tensors, out_dir, steps, lr, flatten):
    init = {k[len("init."):]: v for k, v in tensors.items() if k.startswith("init.")}
    _write_names(f"{out_dir}/state_names.txt", model.state_dict().items())
    _write_names(f"{out_dir}/param_names.txt", model.named_parameters())
    try:
        model.load_state_dict(init, strict=True)
    except RuntimeError as e:
        print(f"nn_oracle.py: load_state_dict failed: {e}", file=sys.stderr)
        return None
    xs, ys = _batches(tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)
    out = {}
    losses = []
    for step in range(steps):
        x, y = xs[step % len(xs)], ys[step % len(ys)]
        opt.zero_grad()
        logits = model(x)
        if flatten:
            logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                out[f"grad0.{name}"] = p.grad.clone()
        opt.step()
        losses.append(loss.detach().reshape(1))
    out["losses"] = torch.cat(losses)
    for name, t in model.state_dict().items():
        out[f"final.{name}"] = t
    return out


def cnn(in_dir, out_dir, steps, lr):
    tensors = tensor_io.load(in_dir)
    model = CNN()
    out = train_model(model, tensors, out_dir, int(steps), float(lr), flatten=False)
    if out is None:
        return 3
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = model(tensors["data.x0"])
    tensor_io.save(out_dir, out)
    return 0


def gpt(in_dir, out_dir, steps, lr, n_head):
    tensors = tensor_io.load(in_dir)
    vocab, d = tensors["init.tok_emb.weight"].shape
    ctx = tensors["init.pos_emb.weight"].shape[0]
    n_layer = len({k.split(".")[2] for k in tensors if k.startswith("init.blocks.")})
    model = GPT(vocab, ctx, n_layer, d, int(n_head))
    init = {k[len("init."):]: v for k, v in tensors.items() if k.startswith("init.")}
    logits0 = None
    try:
        probe = GPT(vocab, ctx, n_layer, d, int(n_head))
        probe.load_state_dict(init, strict=True)
        with torch.no_grad():
            logits0 = probe(tensors["data.x0"])
    except RuntimeError:
        pass  # train_model reports the mismatch
    out = train_model(model, tensors, out_dir, int(steps), float(lr), flatten=True)
    if out is None:
        return 3
    out["logits0"] = logits0
    tensor_io.save(out_dir, out)
    return 0


def main():
    torch.set_num_threads(1)
    mode, args = sys.argv[1], sys.argv[2:]
    fn = {"ops": ops, "cnn": cnn, "gpt": gpt}.get(mode)
    if fn is None:
        print(f"nn_oracle.py: unknown mode {mode!r}", file=sys.stderr)
        return 2
    return fn(*args)


if __name__ == "__main__":
    sys.exit(main())
