"""Exact bytes autograd holds for backward, per micro-batch, from saved-tensor hooks (SOTA-019).

Every tensor autograd saves during a forward passes through the pack hook; we count the bytes of its
storage once per micro-batch (a tensor saved by two ops, or a view of one, holds one storage), and skip
parameter storages, which live whether or not a micro-batch is in flight. A micro-batch's bytes are held
from its forward until its backward has run. This counts what the graph keeps alive, not RSS, so it is
deterministic and the same on every machine.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedTensorMeter:
    def __init__(self, parameters):
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.per_microbatch: dict[int, int] = {}  # micro-batch -> bytes held while it is in flight
        self.live = 0
        self.peak = 0
        self._seen: dict[int, set[int]] = {}
        self.released: dict[int, int] = {}  # micro-batch -> bytes it held, once its backward ran

    @contextlib.contextmanager
    def forward_of(self, microbatch: int):
        """Count what autograd saves while the forward of `microbatch` runs inside this block."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.hold(microbatch, t)
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            yield

    def hold(self, microbatch: int, t: torch.Tensor) -> None:
        """Count a tensor kept for `microbatch`'s backward outside autograd too (the stage's output and
        the received input, which the runner keeps to start and pass on the backward)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        seen = self._seen.setdefault(microbatch, set())
        if ptr and ptr not in seen and ptr not in self._param_storages:
            seen.add(ptr)
            self.per_microbatch[microbatch] = self.per_microbatch.get(microbatch, 0) + storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)

    def release(self, microbatch: int) -> None:
        """The backward of `microbatch` ran: autograd and the runner have let go of its tensors."""
        self.released[microbatch] = self.per_microbatch.pop(microbatch, 0)
        self.live -= self.released[microbatch]
        self._seen.pop(microbatch, None)

    def reset_peak(self) -> None:
        self.peak = self.live


def saved_bytes_of_forward(module: torch.nn.Module, example: torch.Tensor) -> int:
    """Bytes one forward of `module` on `example` leaves saved for backward (graph discarded after)."""
    meter = SavedTensorMeter(module.parameters())
    x = example.detach().requires_grad_(example.is_floating_point())
    with meter.forward_of(0):
        out = module(x)
    del out
    return meter.per_microbatch[0]
