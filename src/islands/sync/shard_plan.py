"""FSDP units before any sharding: which parameters each unit holds, and the bytes that follow from it.

`plan_units(model, policy)` groups modules as a wrap policy asks (islands.sync.wrap_policy) and describes
each unit by its parameter shapes; `unit_traffic` and `state_bytes_per_rank` are the analytic
all-gather/reduce-scatter bytes and per-rank state of those units, using FSDP's padding of dim 0 to a
multiple of the shard count (see sync/sharded.py for the byte definitions). Shared by the FSDP strategy
and the sharding-group chooser (sync/shard_group.py), and usable without a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from islands.sync.wrap_policy import WrapPolicy


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameter names and shapes, whether it is the root, and its dtype sizes."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    root: bool

    def padded_numel(self, n: int) -> int:
        return sum(_padded_rows(s, n) * _row_numel(s) for s in self.shapes)

    def shard_numel(self, n: int, rank: int) -> int:
        """Elements of the unpadded local slice rank `rank` holds (torch.chunk layout along dim 0)."""
        return sum(_local_rows(s, n, rank) * _row_numel(s) for s in self.shapes)

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def rows_of(shape) -> int:
    return shape[0] if shape else 1


def _row_numel(shape) -> int:
    return math.prod(shape[1:]) if shape else 1


def _padded_rows(shape, n: int) -> int:
    return math.ceil(rows_of(shape) / n) * n


def _local_rows(shape, n: int, rank: int) -> int:
    chunk = math.ceil(rows_of(shape) / n)
    return max(0, min(chunk, rows_of(shape) - rank * chunk))


def eval_gather_bytes(shapes, n: int, param_bytes: int = 4) -> int:
    """What one rank sends to assemble the full model for an evaluation or a checkpoint (ShardedFSDP.eval_model): its
    slice of every parameter, padded to ceil(rows / n) rows, once per parameter."""
    return sum(math.ceil(rows_of(s) / n) * _row_numel(s) * param_bytes for s in shapes) if n > 1 else 0


def plan_units(model: nn.Module, policy: WrapPolicy) -> tuple[list[list[nn.Module]], list[Unit]]:
    """The module groups a policy asks for, and the units they make (root last), before any sharding."""
    groups = policy.groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    claimed: set[int] = set()
    units = []
    for i, group in enumerate(groups):
        params = [p for m in group for p in m.parameters() if id(p) not in claimed]
        if not params:
            raise ValueError(f"wrap policy {policy.spec!r}: unit {i} has no parameters of its own")
        claimed.update(id(p) for p in params)
        label = names[id(params[0])].rsplit(".", 1)[0] + (f" +{len(group) - 1}" if len(group) > 1 else "")
        units.append(Unit(label, tuple(tuple(p.shape) for p in params), root=False))
    rest = [p for p in model.parameters() if id(p) not in claimed]
    units.append(Unit("root", tuple(tuple(p.shape) for p in rest), root=True))
    return groups, units


def unit_traffic(
    units: list[Unit], n: int, reshard_after_forward: bool, param_bytes: int = 4, grad_bytes: int = 4
) -> list[tuple[str, int, int]]:
    """(kind, sent, received) for every collective FSDP issues in one training step on one rank."""
    out = []
    for u in units:
        full = u.padded_numel(n)
        gathers = 2 if (reshard_after_forward and not u.root) else 1  # forward, and again in backward
        out += [("fsdp_all_gather", full // n * param_bytes, (n - 1) * full // n * param_bytes)] * gathers
        out.append(("fsdp_reduce_scatter", full * grad_bytes, full // n * grad_bytes))
    return out


def state_bytes_per_rank(
    units: list[Unit], n: int, rank: int = 0, optimizer_slots: int = 2, bytes_per_elem: int = 4
) -> dict:
    """Resident bytes of parameters, gradients and optimizer state on one rank between steps.

    n=1 gives the replicated (DDP) figure. AdamW keeps two slots (exp_avg, exp_avg_sq); its 0-d step
    counters are ignored. Rank 0 holds the largest slice.
    """
    elems = sum(u.shard_numel(n, rank) for u in units)
    return {
        "params": elems * bytes_per_elem,
        "grads": elems * bytes_per_elem,
        "optimizer": optimizer_slots * elems * bytes_per_elem,
        "total": (2 + optimizer_slots) * elems * bytes_per_elem,
    }
