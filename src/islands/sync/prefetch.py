"""Explicit FSDP2 prefetch: gather the next N units' parameters while the current unit computes (SOTA-117,
LIT-083).

FSDP2 by default issues a unit's all-gather when the unit is about to run (forward) or one unit ahead
(backward), synchronously unless the device has a separate communication stream. On CPU (gloo) there is
no such stream, so by default every gather blocks compute. With `prefetch=N` each unit asks for the
next N units in execution order -- the root for the first N -- and gathers are issued asynchronously
(FSDP2's `_set_unshard_async_op`, the documented companion of explicit prefetching), so gloo's
communication thread moves the next units' parameters while this one computes. The price is N more
units of gathered parameters held in memory. Bytes are unchanged: the same gathers, issued earlier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:  # importing torch's FSDP costs every process ~0.5 s of CPU; only fsdp jobs need it
    from torch.distributed.fsdp import FSDPModule


def fsdp_handle(group: list[nn.Module]) -> FSDPModule:
    """The FSDPModule that carries a unit's state (a grouped unit shares one state across its modules)."""
    from torch.distributed.fsdp import FSDPModule

    unit = group[0]
    assert isinstance(unit, FSDPModule)  # fully_shard made every module of the group one
    return unit


def set_prefetch(root: nn.Module, groups: list[list[nn.Module]], n: int) -> None:
    """Forward: the root and unit i prefetch units i+1..i+n. Backward (reverse order): the root prefetches
    the last n units, unit i the n units before it. `groups` are the non-root units in forward order."""
    if n < 1:
        raise ValueError(f"prefetch needs n >= 1 units ahead; got {n}")
    from torch.distributed.fsdp import FSDPModule

    units = [fsdp_handle(g) for g in groups]
    if not units:
        return
    assert isinstance(root, FSDPModule)  # fully_shard(root) came first (sharded.FSDP.wrap)
    root.set_modules_to_forward_prefetch(units[:n])
    root.set_modules_to_backward_prefetch(units[::-1][:n])
    for i, u in enumerate(units):
        if units[i + 1 : i + 1 + n]:
            u.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + n])
        if i:
            u.set_modules_to_backward_prefetch(units[max(0, i - n) : i][::-1])
    root._set_unshard_async_op(True)  # walks every FSDP module below the root
