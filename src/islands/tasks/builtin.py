"""The two built-in tasks as islands Tasks: a byte-level language model on text that needs no download
(the Python standard library's own source by default), and an MLP on scikit-learn's digits.

Their training data is a `Sharded` factory: the Trainer calls it with this rank's data shard and gets an
islands loader (islands.data.loader), whose position `(epoch, cursor)` is checkpointed and resharded.
The model is built right after `torch.manual_seed(seed)`, so every rank starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from islands.data import ArrayLoader, WindowLoader, load_digits, load_text
from islands.data.loader import fixed_val_batches_array, fixed_val_batches_lm
from islands.loop.task import Task
from islands.models import MLP, ByteTransformer, sequence_loss


class Sharded:
    """train_data for a Trainer: `make(shard, shards)` -> a loader with next() and state_dict()."""

    def __init__(self, make: Callable[[int, int], object]):
        self.make = make

    def __call__(self, shard: int, shards: int):
        return self.make(shard, shards)


def lm_task(
    data: str = "",
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    context: int = 128,
    batch_size: int = 8,
    eval_batches: int = 8,
    seed: int = 0,
) -> Task:
    """Causal byte-level transformer (vocabulary 256) on a text file or directory ("" = the stdlib's source)."""
    corpus = load_text(data)
    torch.manual_seed(seed)
    model = ByteTransformer(d_model, n_layers, n_heads, context)
    train = Sharded(lambda shard, shards: WindowLoader(corpus.train, context, batch_size, shard, shards, seed))
    val = fixed_val_batches_lm(corpus.val, context, batch_size, eval_batches)
    return Task(
        model,
        sequence_loss,
        train,
        val,
        batch_size=batch_size,
        tokens_per_sample=context,
        classes=256,
        name="lm",
        data_source=f"{corpus.source} ({corpus.files} files)",
    )


def digits_task(hidden: int = 128, batch_size: int = 8, seed: int = 0) -> Task:
    """An MLP (64 -> hidden -> 10) on scikit-learn's 8x8 digits (1,797 images, shipped with the package)."""
    digits = load_digits()
    torch.manual_seed(seed)
    model = MLP(64, hidden, 10)
    train = Sharded(lambda shard, shards: ArrayLoader(digits.x_train, digits.y_train, batch_size, shard, shards, seed))
    val = fixed_val_batches_array(digits.x_val, digits.y_val, 128)
    return Task(
        model,
        F.cross_entropy,
        train,
        val,
        batch_size=batch_size,
        tokens_per_sample=1,
        classes=10,
        name="digits",
        data_source="sklearn digits",
    )
