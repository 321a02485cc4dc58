"""Strategies inside an island (DDP, ZeRO-1, FSDP) and across islands (islands.sync.outer).

The strategies' public names are in islands.inner and islands.outer; this package exports the sizing tools
a user (or the benchmarks) reasons with before choosing one: FSDP's units and per-rank state, the sharding
group that fits a memory budget, and the bytes each choice sends.
"""

from islands.sync.shard_group import choose_group, cross_island_wire_bytes
from islands.sync.shard_plan import Unit, plan_units, state_bytes_per_rank
from islands.sync.wrap_policy import parse_wrap, trace_order
from islands.sync.zero1 import partition

__all__ = [
    "Unit",  # one FSDP unit's parameter shapes: what state_bytes_per_rank and choose_group count
    "choose_group",  # the smallest sharding group whose per-rank state fits a budget (SOTA-119)
    "cross_island_wire_bytes",  # bytes per step a sharding group sends across islands
    "parse_wrap",  # a wrap policy from its spec string (--inner.wrap), for plan_units
    "partition",  # ZeRO-1's owner of each parameter, deterministic from the sizes (SOTA-028)
    "plan_units",  # the FSDP units a wrap policy makes of a model, before any sharding
    "state_bytes_per_rank",  # parameters + gradients + optimizer state per rank under FSDP
    "trace_order",  # each parameter-owning module's bytes and output bytes, in run order (graph wrap)
]
