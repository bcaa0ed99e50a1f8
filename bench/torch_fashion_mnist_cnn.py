#!/usr/bin/env python3
"""The PyTorch reproduction of examples/fashion_mnist_cnn (issue #4's "PyTorch: 83.8% with this
recipe"): the W2 CNN, AdamW(lr 1e-3, torch's default weight_decay 0.01), batch 64, one epoch,
one thread, test accuracy in eval mode (BatchNorm on its running statistics).

Everything is PyTorch's default: Conv2d/Linear/BatchNorm2d default init, a DataLoader-style
reshuffle per epoch from torch.manual_seed(seed) (torch.randperm, the last short batch kept),
inputs as torchvision's ToTensor() gives them ([0, 1] pixels) or, with --normalize, standardised
with the training set's mean/std (0.2860, 0.3530) as the Tandem example does by default.

  torch_fashion_mnist_cnn.py [--seed S] [--normalize] [--epochs E] [--threads T] [--data-dir DIR]

Prints one JSON line (seed, normalize, test_accuracy, test_accuracy_batch_stats, seconds). Reads the IDX .gz files with
numpy (no torchvision needed). A yardstick only: tests never run it.
"""
import argparse
import gzip
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


class Cnn(nn.Module):
    """src/tandem/nn/models/cnn.h: 3 x [Conv3x3 (no bias), BatchNorm2d, ReLU], mean over H, W, fc."""

    def __init__(self):
        super().__init__()
        layers = []
        chans, strides = [1, 32, 64, 128], [1, 2, 2]
        for i in range(3):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, stride=strides[i], padding=1, bias=False),
                       nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--normalize", action="store_true", help="standardise inputs (else ToTensor's [0, 1])")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=os.path.join(os.environ.get("TANDEM_DATA_DIR", "/usr/share/datasets"),
                                                      "fashion-mnist"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    def images(name):
        x = torch.from_numpy(read_idx(os.path.join(a.data_dir, name)).astype(np.float32) / 255.0).unsqueeze(1)
        return (x - 0.2860) / 0.3530 if a.normalize else x

    x_train, x_test = images("train-images-idx3-ubyte.gz"), images("t10k-images-idx3-ubyte.gz")
    y_train = torch.from_numpy(read_idx(os.path.join(a.data_dir, "train-labels-idx1-ubyte.gz")).astype(np.int64))
    y_test = torch.from_numpy(read_idx(os.path.join(a.data_dir, "t10k-labels-idx1-ubyte.gz")).astype(np.int64))

    model = Cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # weight_decay 0.01 (the default)
    t0 = time.time()
    n = x_train.shape[0]
    for _ in range(a.epochs):
        model.train()
        order = torch.randperm(n)  # what DataLoader(shuffle=True) draws per epoch
        for s in range(0, n, 64):
            idx = order[s:s + 64]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
    seconds = time.time() - t0
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x_test[s:s + 500]).argmax(1) == y_test[s:s + 500]).sum())
                      for s in range(0, x_test.shape[0], 500))
    # The same weights evaluated in training mode (BatchNorm on each test batch's own statistics,
    # batches of 500): what a recipe that forgets model.eval() reports. Not the recipe's figure.
    model.train()
    with torch.no_grad():
        correct_bs = sum(int((model(x_test[s:s + 500]).argmax(1) == y_test[s:s + 500]).sum())
                         for s in range(0, x_test.shape[0], 500))
    print(json.dumps({"seed": a.seed, "normalize": a.normalize, "epochs": a.epochs,
                      "test_accuracy": correct / x_test.shape[0],
                      "test_accuracy_batch_stats": correct_bs / x_test.shape[0], "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
