"""Models and data islands did not write, as a user would bring them: the own-model and wrapper-overhead benches.

    cnn    a small CNN with BatchNorm on scikit-learn's 8x8 digits, (images, labels) batches, cross-entropy
    gpt2   a `transformers` GPT-2 built from a config (random initialisation, nothing downloaded) on the
           bytes of Python's own standard library, {"input_ids", "labels"} batches, the model's own loss

`make(kind, rank, size, batch)` gives (model, endless batch iterator for this rank's shard, validation
batches, loss_fn) with the model built under torch.manual_seed(0): every rank starts from the same weights.
Only the public API of islands is used by the benches around them.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2_CONTEXT = 64
STDLIB_PACKAGES = ("json", "email", "http", "logging", "unittest", "xml")  # ~1.5 MB of text, fixed for every run


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x = torch.tensor(d.images[order] / 16.0, dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(d.target[order])


def _stdlib_bytes() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for pkg in STDLIB_PACKAGES for p in sorted((root / pkg).rglob("*.py")))
    return torch.tensor(np.frombuffer(text, dtype=np.uint8).astype(np.int64))


def _endless(make_epoch):
    epoch = 0
    while True:
        yield from make_epoch(epoch)
        epoch += 1


def make(kind: str, rank: int, size: int, batch: int, data_seed: int = 0):
    """(model, batches of this rank's shard, validation batches, loss_fn or None). `data_seed` changes only the
    order the batches come in (the same weights, the same shards): two seeds measure run-to-run noise."""
    if kind == "cnn":
        x, y = _digits()
        tx, ty = x[:1500][rank::size], y[:1500][rank::size]

        def epoch(e):
            order = torch.randperm(
                len(ty), generator=torch.Generator().manual_seed(1000 * e + rank + 10**6 * data_seed)
            )
            for i in range(0, len(ty) - batch + 1, batch):
                yield tx[order[i : i + batch]], ty[order[i : i + batch]]

        torch.manual_seed(0)
        return DigitsCNN(), _endless(epoch), [(x[1500:], y[1500:])], F.cross_entropy
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        data = _stdlib_bytes()
        split = int(len(data) * 0.95)
        train, val = data[:split], data[split:]
        windows = (len(train) - 1) // GPT2_CONTEXT
        mine = torch.arange(windows)[rank::size]

        def epoch(e):
            order = mine[
                torch.randperm(len(mine), generator=torch.Generator().manual_seed(1000 * e + rank + 10**6 * data_seed))
            ]
            for i in range(0, len(order) - batch + 1, batch):
                ids = torch.stack([train[j * GPT2_CONTEXT : (j + 1) * GPT2_CONTEXT] for j in order[i : i + batch]])
                yield {"input_ids": ids, "labels": ids}

        starts = torch.linspace(0, len(val) - GPT2_CONTEXT - 1, 64).long()
        vids = torch.stack([val[s : s + GPT2_CONTEXT] for s in starts])
        val_batches = [{"input_ids": vids[i : i + 16], "labels": vids[i : i + 16]} for i in range(0, 64, 16)]
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=256, n_positions=GPT2_CONTEXT, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
        return GPT2LMHeadModel(config), _endless(epoch), val_batches, None
    raise ValueError(f"unknown model kind {kind!r}: cnn or gpt2")


def loss_of(model, batch, loss_fn):
    """One forward: (inputs, targets) through loss_fn, or a dict batch through the model's own loss."""
    if isinstance(batch, dict):
        return model(**batch).loss
    x, y = batch
    return loss_fn(model(x), y)
