"""What an outer exchange costs a worker locally when it combines M islands' payloads rather than one.

profile.round_seconds times a round on one worker with no other rank (World.single): its exchange encodes one
payload and decodes that same one. With M islands a gathered exchange (a PayloadCodec such as Quant4, a compressor
whose payloads do not add on the wire such as top-k, a robust aggregator) decodes, merges or ranks M of them on
every worker, and a summable compressor sums M payloads before its one decode. That work grows with M and is not on
the wire, so the link model does not hold it either.

It is timed on MirrorComm: a Collectives of M ranks that all hold what this one holds (an all_gather returns M
copies, a sum all_reduce M times the tensor), with no process group. The exchange then does its whole local work
for M islands on the model's own vector size, and the difference from the same exchange on one rank is the extra
per round (issue #37: a gathered compressor's decoding of every island's payload).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from islands.sync.outer.exchange import Exchange

REPEATS = 5  # paired timings (after one warm-up each); their median difference is kept


class MirrorComm:
    """Collectives of `size` ranks that all hold this rank's tensors (no process group, no wire)."""

    elastic = False
    epoch: int | None = None
    rank = 0

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a MirrorComm needs size >= 1, got {size}")
        self.size = size

    def all_reduce(self, tensor: torch.Tensor, op=None, kind: str = "all_reduce") -> torch.Tensor:
        if op is None or op == dist.ReduceOp.SUM:
            return tensor.mul_(self.size) if self.size > 1 else tensor
        if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            return tensor  # every rank holds the same values
        raise ValueError(f"MirrorComm reduces with SUM, MAX or MIN, not {op}")

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        return [tensor] + [tensor.clone() for _ in range(self.size - 1)]  # a real gather receives size - 1 buffers

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list:
        return [obj] * self.size


def _mean_seconds(exchange: Exchange, comm: MirrorComm, flat: torch.Tensor) -> float:
    t0 = time.perf_counter()
    exchange.mean(comm, flat.clone())
    return time.perf_counter() - t0


def gathered_seconds(exchange: Exchange, numel: int, islands: int, repeats: int = REPEATS) -> float:
    """Extra seconds one exchange of a `numel`-value vector costs a worker with `islands` islands beyond one
    island's (never below 0): copies of `exchange` (its compressor state their own) timed side by side, M ranks then
    one, `repeats` times after a warm-up each; the median of the paired differences."""
    if islands <= 1:
        return 0.0
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    many, one = copy.deepcopy(exchange), copy.deepcopy(exchange)
    comms = MirrorComm(islands), MirrorComm(1)
    _mean_seconds(many, comms[0], flat)  # warm-up: error feedback's residual and the allocator's first pages
    _mean_seconds(one, comms[1], flat)
    diffs = [_mean_seconds(many, comms[0], flat) - _mean_seconds(one, comms[1], flat) for _ in range(repeats)]
    return max(statistics.median(diffs), 0.0)
