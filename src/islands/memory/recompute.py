"""Activation checkpointing (SOTA-249, LIT-004): keep only segment inputs, recompute the rest in backward.

A stack of n layers split into k segments holds k segment inputs plus, during backward, the internals of
one segment while it is recomputed: about n/k layers' worth. k = sqrt(n) balances the two when every layer
holds as much as its input (the setting of LIT-004). A transformer block holds far more inside than at its
boundary (attention, the 4x MLP), so one segment per block is the smaller peak there; both cost one extra
forward pass. `memory-savers` measures both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def sqrt_segments(n_layers: int) -> int:
    """The LIT-004 choice: about sqrt(n) segments."""
    return max(1, round(math.sqrt(n_layers)))


def split_segments(layers: Sequence | torch.nn.ModuleList, segments: int) -> list[list]:
    """Consecutive groups, sizes differing by at most one, earlier groups larger."""
    if not 1 <= segments <= len(layers):
        raise ValueError(f"segments must be in 1..{len(layers)} (the number of layers); got {segments}")
    base, extra = divmod(len(layers), segments)
    out, start = [], 0
    for i in range(segments):
        size = base + (1 if i < extra else 0)
        out.append(list(layers[start : start + size]))
        start += size
    return out


def _run(group, x: torch.Tensor) -> torch.Tensor:
    for layer in group:
        x = layer(x)
    return x


def run_checkpointed(layers: Sequence | torch.nn.ModuleList, x: torch.Tensor, segments: int) -> torch.Tensor:
    """x through `layers`, holding only each segment's input for backward.

    Reentrant form on purpose: its saved input and its recomputation pass through the caller's
    saved_tensors_hooks, so islands.memory.accounting sees every byte (the non-reentrant form hides them).
    It needs an input that requires grad, which a layer stack fed by an embedding always has.
    """
    for group in split_segments(layers, segments):
        x = checkpoint(_run, group, x, use_reentrant=True)
    return x


def enable_activation_checkpointing(model: torch.nn.Module) -> str:
    """Switch activation checkpointing on for `model`; returns how: "islands" or "transformers".

    islands' own models (`set_activation_checkpointing`): one segment per block. A transformers PreTrainedModel
    that supports it: its own `gradient_checkpointing_enable` (`activation_checkpointing_enable` from transformers 5
    on), which checkpoints each decoder layer where the model knows its layer boundaries and arguments (attention
    masks, position ids, caches), in the NON-reentrant form: it needs no input that requires grad (the reentrant
    form does, so transformers then forces the embedding's output to require one), it passes keyword arguments
    through, and it works inside DDP's no_sync and with parameters a step leaves unused (the reentrant form
    runs its own backward, which DDP's hooks do not expect). Its saved tensors are hidden from an outer
    saved_tensors_hooks, so islands.memory.accounting sees the segment inputs only, not the recomputation. The
    model's KV cache is switched off (`config.use_cache = False`): a cache is incompatible with recomputation and
    training never reads it. Anything else is a ValueError naming what would work."""
    m: Any = model  # duck-typed: the methods below are islands' or transformers', found by hasattr
    if hasattr(model, "set_activation_checkpointing") and hasattr(model, "blocks"):
        m.set_activation_checkpointing(len(m.blocks))
        return "islands"
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5 on (the old one warns)
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if getattr(model, "config", None) is not None:
            m.config.use_cache = False
        return "transformers"
    if hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(
            f"activation_checkpointing: {type(model).__name__} is a transformers model whose class "
            "does not support gradient checkpointing (supports_gradient_checkpointing is False)"
        )
    raise ValueError(
        f"activation_checkpointing: {type(model).__name__} has neither islands' "
        "set_activation_checkpointing nor transformers' gradient_checkpointing_enable; wrap its blocks "
        "with torch.utils.checkpoint yourself, or turn activation_checkpointing off"
    )
