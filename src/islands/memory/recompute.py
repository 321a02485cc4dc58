"""Activation checkpointing (SOTA-249, LIT-004): keep only segment inputs, recompute the rest in backward.

A stack of n layers split into k segments holds k segment inputs plus, during backward, the internals of
one segment while it is recomputed: about n/k layers' worth. k = sqrt(n) balances the two when every layer
holds as much as its input (the setting of LIT-004). A transformer block holds far more inside than at its
boundary (attention, the 4x MLP), so one segment per block is the smaller peak there; both cost one extra
forward pass. `memory-savers` measures both.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint


def sqrt_segments(n_layers: int) -> int:
    """The LIT-004 choice: about sqrt(n) segments."""
    return max(1, round(math.sqrt(n_layers)))


def split_segments(layers: Sequence, segments: int) -> list[list]:
    """Consecutive groups, sizes differing by at most one, earlier groups larger."""
    if not 1 <= segments <= len(layers):
        raise ValueError(f"segments must be in 1..{len(layers)} (the number of layers); got {segments}")
    base, extra = divmod(len(layers), segments)
    out, start = [], 0
    for i in range(segments):
        size = base + (1 if i < extra else 0)
        out.append(list(layers[start:start + size]))
        start += size
    return out


def _run(group, x: torch.Tensor) -> torch.Tensor:
    for layer in group:
        x = layer(x)
    return x


def run_checkpointed(layers: Sequence, x: torch.Tensor, segments: int) -> torch.Tensor:
    """x through `layers`, holding only each segment's input for backward.

    Reentrant form on purpose: its saved input and its recomputation pass through the caller's
    saved_tensors_hooks, so islands.memory.accounting sees every byte (the non-reentrant form hides them).
    It needs an input that requires grad, which a layer stack fed by an embedding always has.
    """
    for group in split_segments(layers, segments):
        x = checkpoint(_run, group, x, use_reentrant=True)
    return x
