"""A byte corpus as token windows: each rank tokenises only its own shard of the text, where its loader is made.

    text_shard(data, shard, shards)                     this shard's bytes, cut at line breaks
    token_windows(tokens, context, batch, shard, seed)  next-token windows over one shard's token ids

The shards are byte ranges of the training text whose ends are moved to the next line break, so no line (and no
multi-byte character) is split between two ranks, and they are the same on every rank. Tokenising a shard costs
1/shards of tokenising the corpus, and nothing has to be shared between ranks. The loader is the byte LM's
`WindowLoader` (islands.data.loader) over the shard's ids, with the shard's own seeded permutations, so its
position `(epoch, cursor)` is checkpointed and resharded like the built-in task's.
"""

from __future__ import annotations

import numpy as np

from islands.data.loader import ShardSampler, WindowLoader, shard_bounds


def _cut(data: np.ndarray, at: int) -> int:
    """`at` moved forward to just after the next line break (or the end)."""
    if at <= 0 or at >= len(data):
        return max(0, min(at, len(data)))
    hits = np.flatnonzero(data[at:] == ord("\n"))
    return at + int(hits[0]) + 1 if len(hits) else len(data)


def text_shard(data: np.ndarray, shard: int, shards: int) -> bytes:
    """Bytes [cut(lo), cut(hi)) of `data` for shard `shard` of `shards` (the cuts fall after line breaks)."""
    lo, hi = shard_bounds(len(data), shard, shards)
    return bytes(data[_cut(data, lo) : _cut(data, hi)])


def token_windows(tokens: np.ndarray, context: int, batch: int, shard: int, seed: int) -> WindowLoader:
    """Windows of `context` ids (x) and the next ids (y) over one shard's tokens, in per-epoch permutations seeded
    by (seed, shard, epoch)."""
    if (len(tokens) - 1) // context < 1:
        raise ValueError(
            f"shard {shard} holds {len(tokens)} tokens, fewer than one window of context {context} + 1; "
            "use fewer workers, a shorter context or more text"
        )
    loader = WindowLoader(tokens, context, batch, 0, 1, seed)  # the array is this shard's already
    loader.sampler = ShardSampler(loader.sampler.n, seed, shard)
    return loader
