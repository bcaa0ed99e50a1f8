"""PyTorch oracle for tests/oracle/nn_semantics_oracle_test.cc: how torch 1.13's nn.Module lists,
names and prints the reference models and a model with tied weights and a shared submodule.

usage:
  nn_semantics_oracle.py describe OUT_DIR
  nn_semantics_oracle.py load CASE_FILE OUT_FILE
  nn_semantics_oracle.py resnet IN_DIR OUT_DIR

describe: for each model M of MODELS writes OUT_DIR/M.txt, one section after another:
  [named_parameters] / [named_buffers] / [state_dict]: "name d0,d1,..." per entry, in order
  [named_modules] / [named_children]: "name Type" per entry ("" is written as "-")
  [apply]: the type names Module.apply visits, in order
  [repr]: repr(model)
load: CASE_FILE holds "name d0,d1,..." lines; a state dict of zeros with those names and shapes
  is loaded into Tied() with strict=False, and OUT_FILE gets "missing <key>" and
  "unexpected <key>" lines in the order PyTorch reports them; a RuntimeError (size mismatch)
  writes "error" instead.
resnet: IN_DIR holds Tandem's ResNet-18 state_dict as "init.<name>", an input batch "x" and
  weights "w" for the logits. The state loads strictly into ResNet() below; OUT_DIR gets
  "train_logits" (training mode), "grad.<param>" (gradients of sum(train_logits * w)),
  "running.<name>" (every BatchNorm buffer after that forward), "eval_logits" (eval mode) and
  "grad64.<param>" (the same gradients computed in float64).
"""

import sys

import torch
import torch.nn as nn

import tensor_io
from nn_oracle import CNN, GPT


def mlp():
    """W1, as in src/tandem/nn/models/mlp.h."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


# ---- the CIFAR ResNet-18 with torchvision's names (torchvision.models.resnet18 with a 3x3 stride-1
# stem and no max-pool, the usual CIFAR change); written here because torchvision is not installed.

def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, cin, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = conv3x3(3, 64)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        cin = 64
        for i, (planes, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)]):
            down = None
            if stride != 1 or cin != planes:
                down = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, planes, stride, down), BasicBlock(planes, planes)))
            cin = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Tied(nn.Module):
    """A tied weight (head.weight is emb.weight), a submodule under two names (shared is body[0]),
    a persistent and a non-persistent buffer; mirrored in nn_semantics_oracle_test.cc."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.emb = nn.Embedding(5, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.shared = self.body[0]


MODELS = {
    "mlp": mlp,
    "cnn": CNN,
    "gpt": lambda: GPT(256, 128, 4, 256, 4),
    "resnet18": ResNet,
    "tied": Tied,
}


def shape(t):
    return ",".join(str(s) for s in t.shape)


def describe(out_dir):
    for name, make in MODELS.items():
        model = make()
        lines = ["[named_parameters]"] + [f"{n} {shape(t)}" for n, t in model.named_parameters()]
        lines += ["[named_buffers]"] + [f"{n} {shape(t)}" for n, t in model.named_buffers()]
        lines += ["[state_dict]"] + [f"{n} {shape(t)}" for n, t in model.state_dict().items()]
        lines += ["[named_modules]"] + [f"{n or '-'} {type(m).__name__}" for n, m in model.named_modules()]
        lines += ["[named_children]"] + [f"{n} {type(m).__name__}" for n, m in model.named_children()]
        visited = []
        model.apply(lambda m: visited.append(type(m).__name__))
        lines += ["[apply]"] + visited
        lines += ["[repr]", repr(model)]
        with open(f"{out_dir}/{name}.txt", "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def load(case_file, out_file):
    state = {}
    with open(case_file) as f:
        for line in f.read().splitlines():
            name, dims = line.split(" ")
            state[name] = torch.zeros([int(d) for d in dims.split(",") if d])
    try:
        result = Tied().load_state_dict(state, strict=False)
        lines = [f"missing {k}" for k in result.missing_keys] + [f"unexpected {k}" for k in result.unexpected_keys]
    except RuntimeError:
        lines = ["error"]
    with open(out_file, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return 0


def resnet(in_dir, out_dir):
    tensors = tensor_io.load(in_dir)
    model = ResNet()
    model.load_state_dict({k[len("init."):]: v for k, v in tensors.items() if k.startswith("init.")}, strict=True)
    out = {}
    logits = model(tensors["x"])
    (logits * tensors["w"]).sum().backward()
    out["train_logits"] = logits.detach()
    for name, p in model.named_parameters():
        out[f"grad.{name}"] = p.grad
    for name, b in model.named_buffers():
        out[f"running.{name}"] = b
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = model(tensors["x"])
    # The same in float64: how far float32 itself is from the exact gradients.
    m64 = ResNet().double()
    m64.load_state_dict({k[len("init."):]: v.double() if v.is_floating_point() else v
                         for k, v in tensors.items() if k.startswith("init.")}, strict=True)
    (m64(tensors["x"].double()) * tensors["w"].double()).sum().backward()
    for name, p in m64.named_parameters():
        out[f"grad64.{name}"] = p.grad
    tensor_io.save(out_dir, out)
    return 0


def main():
    torch.set_num_threads(1)
    modes = {"describe": describe, "load": load, "resnet": resnet}
    if len(sys.argv) < 2 or sys.argv[1] not in modes:
        print(f"nn_semantics_oracle.py: expected a mode ({', '.join(modes)})", file=sys.stderr)
        return 2
    return modes[sys.argv[1]](*sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
