"""Sharded, resumable loaders. Each worker reads its own shard; position is (epoch, cursor).

The order within an epoch is a permutation drawn from a generator seeded by (seed, shard, epoch), so a
loader restored from its state_dict yields exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import numpy as np
import torch


class ShardSampler:
    """Index stream over `n` items of one shard, in seeded per-epoch permutations."""

    def __init__(self, n: int, seed: int, shard: int):
        if n < 1:
            raise ValueError(f"shard {shard} has no items; use fewer workers or more data")
        self.n, self.seed, self.shard = n, seed, shard
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.shard, self.epoch])
        return rng.permutation(self.n)

    def take(self, k: int) -> np.ndarray:
        out = []
        while k > 0:
            chunk = self._perm[self.cursor : self.cursor + k]
            out.append(chunk)
            k -= len(chunk)
            self.cursor += len(chunk)
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation()
        return np.concatenate(out)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation()


def shard_bounds(length: int, shard: int, shards: int) -> tuple[int, int]:
    return length * shard // shards, length * (shard + 1) // shards


class WindowLoader:
    """Byte windows for next-byte prediction: x = bytes[i:i+T], y = bytes[i+1:i+T+1]."""

    def __init__(self, data: np.ndarray, context: int, batch: int, shard: int, shards: int, seed: int):
        lo, hi = shard_bounds(len(data), shard, shards)
        self.data = torch.from_numpy(np.ascontiguousarray(data[lo:hi]).astype(np.int64))
        self.context, self.batch = context, batch
        windows = (len(self.data) - 1) // context  # non-overlapping window starts
        self.sampler = ShardSampler(windows, seed, shard)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.from_numpy(self.sampler.take(self.batch) * self.context)
        idx = starts[:, None] + torch.arange(self.context + 1)[None, :]
        chunk = self.data[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class ArrayLoader:
    """Minibatches of (x, y) rows from one shard of an in-memory data set."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, shard: int, shards: int, seed: int):
        lo, hi = shard_bounds(len(y), shard, shards)
        self.x, self.y = torch.from_numpy(x[lo:hi]), torch.from_numpy(y[lo:hi])
        self.batch = batch
        self.sampler = ShardSampler(hi - lo, seed, shard)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.from_numpy(self.sampler.take(self.batch))
        return self.x[i], self.y[i]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def fixed_val_batches_lm(
    val: np.ndarray, context: int, batch: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation batches on every rank and every run: evenly spaced windows."""
    data = torch.from_numpy(val.astype(np.int64))
    windows = (len(data) - 1) // context
    want = min(windows, batch * count)
    if want < 1:
        raise ValueError(f"validation text ({len(val)} bytes) is shorter than one context ({context})")
    starts = torch.linspace(0, windows - 1, want).long() * context
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = data[idx]
    return [(chunk[i : i + batch, :-1], chunk[i : i + batch, 1:]) for i in range(0, want, batch)]


def fixed_val_batches_array(x: np.ndarray, y: np.ndarray, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return [(xt[i : i + batch], yt[i : i + batch]) for i in range(0, len(yt), batch)]
