"""A list of tensors seen as one flat fp32 vector, and its split into fragments.

Outer strategies work on flat vectors: one exchange per round (or per fragment) instead of one per
parameter, and fragments may cut through a parameter. Reads return fp32 copies; writes cast back to
each tensor's own dtype, so the outer arithmetic stays in fp32 whatever the model's dtype (LIT-214).

A sharded tensor (a DTensor of FSDP2, inner strategy fsdp) counts as the part this rank holds (`to_local()`),
resolved at every read and write: FSDP2 hands out a new local view object per call (same storage). So under
fsdp an outer strategy's flat vector is this rank's shard of every parameter, and every rank holding the same
shard index (its cross-island group) has a vector of the same length.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its shard of a DTensor, else `t` itself."""
    # No DTensor can exist before torch.distributed.tensor is imported, and importing it costs every process
    # ~0.5 s of CPU, so only a process that already has it (an fsdp job) pays for the check.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


class FlatView:
    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = list(tensors)
        if not self.tensors:
            raise ValueError("FlatView needs at least one tensor (does the model have parameters?)")
        self.starts = []
        total = 0
        for t in self.tensors:
            self.starts.append(total)
            total += local_part(t).numel()
        self.numel = total

    def _segments(self, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(tensor, start inside tensor, end inside tensor, start inside [lo, hi)) for each overlap."""
        for t, start in zip(self.tensors, self.starts):
            t = local_part(t)
            a, b = max(lo, start), min(hi, start + t.numel())
            if a < b:
                yield t, a - start, b - start, a - lo

    def read(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        hi = self.numel if hi is None else hi
        parts = [t.detach().reshape(-1)[a:b].to(torch.float32) for t, a, b, _ in self._segments(lo, hi)]
        if not parts:  # a rank whose shards are all empty (fsdp: fewer rows than ranks) holds nothing
            return torch.zeros(0, dtype=torch.float32, device=local_part(self.tensors[0]).device)
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    @torch.no_grad()
    def write(self, values: torch.Tensor, lo: int = 0) -> None:
        hi = lo + values.numel()
        for t, a, b, at in self._segments(lo, hi):
            t.view(-1)[a:b].copy_(values[at : at + (b - a)])


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """F contiguous slices of [0, numel) whose sizes differ by at most one; each element in exactly one."""
    if fragments < 1 or fragments > numel:
        raise ValueError(f"fragments must be in 1..{numel} (the parameter count), got {fragments}")
    base, extra = divmod(numel, fragments)
    bounds, lo = [], 0
    for f in range(fragments):
        hi = lo + base + (1 if f < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
