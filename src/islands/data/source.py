"""A user's training data as one rank's endless stream of batches, whose position is state.

`batch_source(data, shard, shards, batch_size, seed)` accepts:
  - an islands loader (anything with `next()` and `state_dict()`): used as it is;
  - a map-style `torch.utils.data.Dataset`: a DataLoader over this rank's shard (a DistributedSampler
    with `shards` replicas, shuffled per epoch from `seed`, last partial batch dropped), `batch_size`
    samples per batch (required);
  - a function `(shard, shards) -> iterable of batches`: the user shards;
  - any other iterable of batches (a DataLoader, a list): taken as this rank's own, re-iterated each
    epoch. A one-shot iterator that runs out is an error, not a silent end of training.
The position `{"epoch", "consumed"}` is saved and restored by replaying: a restored source yields exactly
the batches the uninterrupted one would have, provided the data itself is deterministic per epoch
(DistributedSampler's shuffle is, from its seed and epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DataExhausted(RuntimeError):
    """A one-shot iterator of batches ran out before training did."""


class IterableSource:
    def __init__(self, make: Callable[[int], Iterable], reiterable: bool, items: int = -1):
        self._make, self.reiterable = make, reiterable
        self.shard_items = items  # samples in this rank's shard when known (resharding a resume uses it)
        self.epoch, self.consumed = 0, 0
        self._it = iter(make(0))

    def next(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            if not self.reiterable or self.consumed == 0:
                raise DataExhausted(
                    f"the training data ran out after {self.consumed} batches of epoch {self.epoch}; "
                    "give a re-iterable (a list, a Dataset, a DataLoader, or a function "
                    "(shard, shards) -> batches) or train for fewer steps"
                ) from None
            self.epoch, self.consumed = self.epoch + 1, 0
            self._it = iter(self._make(self.epoch))
            batch = next(self._it)
        self.consumed += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if not self.reiterable:
            raise ValueError(
                "cannot restore the position of a one-shot iterator of batches: pass a re-iterable "
                "(a list, a Dataset, a DataLoader, or a function (shard, shards) -> batches)"
            )
        self.epoch, self.consumed = int(state["epoch"]), 0
        self._it = iter(self._make(self.epoch))
        for _ in range(int(state["consumed"])):  # replay: the same batches, not stored ones
            next(self._it)
            self.consumed += 1


def _with_epoch(loader: DataLoader) -> Callable[[int], Iterable]:
    def make(epoch: int) -> Iterable:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        return loader

    return make


def batch_source(data: Any, shard: int = 0, shards: int = 1, batch_size: int | None = None, seed: int = 0):
    """This rank's stream of batches from `data` (module docstring); TypeError/ValueError say what fits."""
    if hasattr(data, "next") and hasattr(data, "state_dict"):
        return data
    if isinstance(data, Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        if batch_size is None or batch_size < 1:
            raise ValueError("train_data is a Dataset: give batch_size= (samples per batch on each worker)")
        sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=shards, rank=shard, shuffle=True, seed=seed, drop_last=True
        )
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
        if len(loader) == 0:  # (a map-style Dataset has a len(): the sampler has just taken it)
            raise ValueError(
                f"train_data has {len(cast(Sized, data))} samples: too few for {shards} worker(s) at batch_size="
                f"{batch_size}; use a smaller batch or more data"
            )
        return IterableSource(_with_epoch(loader), reiterable=True, items=len(sampler))
    if callable(data) and not isinstance(data, Iterable):
        made = data(shard, shards)
        if hasattr(made, "next") and hasattr(made, "state_dict"):
            return made  # an islands loader for this shard (the built-in tasks)
        if not isinstance(made, Iterable):
            raise TypeError(f"train_data(shard, shards) must return an iterable of batches; got {type(made).__name__}")
        return IterableSource(lambda epoch: data(shard, shards), reiterable=True)  # called afresh each epoch
    if isinstance(data, DataLoader):
        return IterableSource(_with_epoch(data), reiterable=True)
    if isinstance(data, Iterable):
        return IterableSource(lambda epoch: data, reiterable=iter(data) is not data)
    raise TypeError(
        f"train_data must be a Dataset, a DataLoader, an iterable of batches or a function "
        f"(shard, shards) -> batches; got {type(data).__name__}"
    )


def val_batches(data: Any, batch_size: int | None = None) -> list | Iterable | None:
    """Validation data as something iterated afresh at every evaluation (the same batches on every rank)."""
    if data is None:
        return None
    if isinstance(data, Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        if batch_size is None:
            raise ValueError("val_data is a Dataset: give batch_size=")
        return DataLoader(data, batch_size=batch_size, shuffle=False)
    if isinstance(data, Iterable):
        if iter(data) is data:
            return list(data)  # a one-shot iterator: kept, so every evaluation sees the same batches
        return data
    raise TypeError(f"val_data must be a Dataset, a DataLoader or an iterable of batches; got {type(data).__name__}")
