"""Documents tokenised once into a cache on disk, then read as windows that never load the whole corpus.

    cached = tokenise_once(source, tok, key)     CachedTokens: train and val as read-only np.memmap arrays
    ArrayWindows(cached.train, context, batch, shard, shards, seed)   one rank's loader
    fixed_val_windows(cached.val, context, batch, count)              the same validation batches everywhere

The cache is a directory `<root>/<key>/` (root: $ISLANDS_CACHE, else ~/.cache/islands/tokens) holding
`train.bin` and `val.bin` (token ids, uint16 when the vocabulary allows it, else uint32; each document followed by
the end-of-text id) and `meta.json`, written last: a directory without it is unfinished. `key` names what the
tokens depend on (the files with their sizes and modification times, the text column, the tokenizer), so changed
data or another tokenizer is a new entry. The first process to take the entry's lock (fcntl) tokenises, streaming
documents and appending ids to temporary files that are renamed when complete; every other process, rank or later
run waits for the lock and finds the entry done. No rank needs a collective for it, under torchrun on several
machines each machine fills its own cache.

`ArrayWindows` shards the training tokens by position (rank r of n reads [r/n, (r+1)/n) of them) and draws
non-overlapping windows in seeded per-epoch permutations (islands.data.loader.ShardSampler); its position
`(epoch, cursor)` is its state, so a restored loader yields exactly the next batch, and only the windows of a batch
are read from the memory map.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from islands.data.loader import ShardSampler, shard_bounds

BATCH_DOCS = 256  # documents tokenised together (tokenizers' encode_batch) while filling the cache


def cache_root() -> Path:
    return Path(os.environ.get("ISLANDS_CACHE") or Path.home() / ".cache" / "islands") / "tokens"


@dataclass
class CachedTokens:
    train: np.ndarray
    val: np.ndarray
    path: Path
    meta: dict


def _write(
    path: Path, docs: Iterable[str], encode: Callable[[list[str]], list[list[int]]], eos: int, dtype: np.dtype
) -> tuple[int, int]:
    """Append each document's ids and EOS to `path`; (documents, tokens)."""
    n_docs = n_tokens = 0
    with open(path, "wb") as f:
        batch: list[str] = []

        def flush() -> None:
            nonlocal n_tokens
            for ids in encode(batch):
                arr = np.asarray([*ids, eos], dtype=dtype)
                f.write(arr.tobytes())
                n_tokens += len(arr)
            batch.clear()

        for text in docs:
            batch.append(text)
            n_docs += 1
            if len(batch) >= BATCH_DOCS:
                flush()
        flush()
        f.flush()
        os.fsync(f.fileno())
    return n_docs, n_tokens


def _open(entry: Path, meta: dict) -> CachedTokens:
    dtype = np.dtype(meta["dtype"])

    def mm(name: str) -> np.ndarray:
        n = meta[name]["tokens"]
        return np.memmap(entry / f"{name}.bin", dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)

    return CachedTokens(mm("train"), mm("val"), entry, meta)


def tokenise_once(
    docs: Callable[[str], Iterable[str]],
    encode: Callable[[list[str]], list[list[int]]],
    eos: int,
    vocab: int,
    key: str,
    root: Path | None = None,
) -> CachedTokens:
    """The cached tokens of `docs(split)` for split "train" and "val" (module docstring); filled on first use."""
    entry = (root or cache_root()) / key
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (entry / "meta.json").is_file():
            return _open(entry, json.loads((entry / "meta.json").read_text()))
        entry.mkdir(exist_ok=True)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        meta = {"dtype": dtype.name, "key": key}
        for split in ("train", "val"):
            tmp = entry / f".{split}.bin.tmp"
            n_docs, n_tokens = _write(tmp, docs(split), encode, eos, dtype)
            os.replace(tmp, entry / f"{split}.bin")
            meta[split] = {"documents": n_docs, "tokens": n_tokens}
        tmp = entry / ".meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, entry / "meta.json")  # the entry is complete from here on
        return _open(entry, meta)


class ArrayWindows:
    """Next-token windows over one shard of a (memory-mapped) token array; only each batch's windows are read."""

    def __init__(self, tokens: np.ndarray, context: int, batch: int, shard: int, shards: int, seed: int):
        self.lo, hi = shard_bounds(len(tokens), shard, shards)
        windows = (hi - self.lo - 1) // context
        if windows < 1:
            raise ValueError(
                f"shard {shard} of {shards} holds {hi - self.lo} tokens, fewer than one window of "
                f"context {context} + 1; use fewer workers, a shorter context or more data"
            )
        self.tokens, self.context, self.batch = tokens, context, batch
        self.sampler = ShardSampler(windows, seed, shard)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.lo + self.sampler.take(self.batch) * self.context
        chunk = torch.from_numpy(
            np.stack([np.asarray(self.tokens[s : s + self.context + 1], dtype=np.int64) for s in starts])
        )
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def fixed_val_windows(
    tokens: np.ndarray, context: int, batch: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to batch * count evenly spaced windows of the validation tokens, in batches: the same on every rank."""
    windows = (len(tokens) - 1) // context
    want = min(windows, batch * count)
    if want < 1:
        raise ValueError(
            f"the validation split holds {len(tokens)} tokens, fewer than one window of context "
            f"{context} + 1; give more documents (one in twenty is held out) or a shorter context"
        )
    starts = np.linspace(0, windows - 1, want).astype(np.int64) * context
    chunk = torch.from_numpy(np.stack([np.asarray(tokens[s : s + context + 1], dtype=np.int64) for s in starts]))
    return [(chunk[i : i + batch, :-1], chunk[i : i + batch, 1:]) for i in range(0, want, batch)]
