"""Exact, deterministic memory accounting: bytes autograd holds for backward, and bytes of training state.

RSS and allocator statistics move with machine load and allocator caching; what a step *needs* does not.
`SavedTensorMeter` counts every tensor autograd saves for backward through
`torch.autograd.graph.saved_tensors_hooks`. Each saved tensor is wrapped in a small holder; when autograd
releases it (after its node ran backward, or when the graph is dropped) the holder dies and its bytes are
subtracted, so the meter knows the live total at every moment and its peak. Bytes are counted per storage,
once however many views of it are saved (q, k and v are views of one projection output), and parameter
storages are left out: they are state, counted by `state_bytes`, not activations.

Activation checkpointing must run with `use_reentrant=True` for this count to be complete: that form saves
each segment's input through `ctx.save_for_backward` (seen here) and recomputes under the same hooks during
backward (also seen here), where the non-reentrant form hides both behind its own hooks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr())


class _Held:
    """What autograd keeps instead of the tensor; its death means autograd let the tensor go."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Context manager: live and peak bytes saved for backward, while it is open.

    Keep it open across forward *and* backward, so recomputation (activation checkpointing) is counted.
    `exclude` lists tensors (normally the parameters) whose storages are not activations.
    """

    def __init__(self, exclude=()):
        self._excluded = {_storage_key(t) for t in exclude}
        self._refs: dict[tuple, int] = {}  # storage -> how many holders are alive
        self._sizes: dict[tuple, int] = {}
        self.live = 0
        self.peak = 0
        self.packed = 0  # holders created (saved tensors, views counted separately)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self._excluded or tensor.untyped_storage().nbytes() == 0:
            return tensor
        self.packed += 1
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = tensor.untyped_storage().nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Optimizer state per parameter byte when the optimizer has not stepped yet: Adam/AdamW keep two moments
# (exp_avg, exp_avg_sq), the family every optimizer here belongs to; 2 is the conservative default.
UNSTEPPED_STATE_RATIO = 2


def optimizer_bytes(optimizer: torch.optim.Optimizer | None, params_bytes: int) -> int:
    """Bytes of optimizer state: counted from its tensors once it has stepped, else estimated."""
    if optimizer is None:
        return 0
    tensors = [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    ]  # scalar step counters are noise
    if tensors:
        return tensor_bytes(tensors)
    return UNSTEPPED_STATE_RATIO * params_bytes


@dataclass(frozen=True)
class StateBytes:
    """What a worker holds between steps, independent of batch size."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Parameters, their gradients (same dtype and size, all trainable), and optimizer state."""
    params = [p for p in model.parameters()]
    p = tensor_bytes(params)
    g = tensor_bytes(q for q in params if q.requires_grad)
    return StateBytes(params=p, grads=g, optimizer=optimizer_bytes(optimizer, p))
