"""Sharded data parallel inside an island with torch's FSDP2 `fully_shard` (LIT-083, ZeRO LIT-027).

Each rank of the island keeps 1/N of every parameter, gradient and optimizer state (ZeRO-3, SOTA-030).
Before a unit runs forward its parameters are all-gathered; after backward its gradients are
reduce-scattered so each rank gets the mean of its own slice. `reshard_after_forward=False` keeps the
gathered parameters from forward to backward (one all-gather per step instead of two: ZeRO-2-like
traffic, at the memory of whole parameters during the pass).

FSDP issues its collectives itself, outside our Comm, so the bytes are recorded analytically once per
step in `after_backward` (see `unit_traffic`), using Comm's payload definitions:
    all-gather      sent = this rank's padded shard, received = the other N-1 shards
    reduce-scatter  sent = the whole padded gradient handed in, received = this rank's reduced shard
FSDP pads dim 0 of every parameter to a multiple of N, so sizes are ceil(d0 / N) * N * (other dims).
The root unit is never resharded after forward (FSDP's own heuristic: backward needs it at once).
tests/integration/sharding/test_sharded.py checks these numbers against the bytes FSDP hands to torch.distributed.

Evaluation and checkpoints see a full copy: `eval_model` gathers every parameter through our counted
Comm into a plain module; loading a state dict into that copy writes each rank's slice back.

Islands: alone, FSDP over several islands is HSDP (each island one replica, gradient shards all-reduced
across islands every step). Under an outer strategy (a Stack calls `keep_islands_apart`) each island shards
over its own workers only and trains apart; the outer strategy meets across islands shard by shard (each
worker exchanges its 1/N with the workers holding the same shard on the other islands: the "cross" group).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from islands.runtime.comm import Comm
from islands.runtime.compiled import uncompiled
from islands.sync.base import NoOp, refuse_alone_in_elastic
from islands.sync.prefetch import set_prefetch
from islands.sync.shard_group import build_mesh, parse_shard_group, resolve_group
from islands.sync.shard_plan import (
    Unit,
    plan_units,
    rows_of,
    state_bytes_per_rank,  # noqa: F401 - imported from here by tests/integration/sharding/test_sharded_hybrid.py
    unit_traffic,
)
from islands.sync.wrap_policy import BlockWrap, WrapPolicy

if TYPE_CHECKING:
    from islands.runtime.contracts import Collectives

DTYPES = {"": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measured_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The same three figures, summed over the local tensors this rank actually holds."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def size(t):
        return t.numel() * t.element_size()

    params = sum(size(local(p)) for p in model.parameters())
    grads = sum(size(local(p.grad)) for p in model.parameters() if p.grad is not None)
    opt = sum(
        size(local(v))
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict, after: dict) -> None:
    """fully_shard swaps in new (sharded) Parameter objects; the optimizer must step those."""
    if any(optimizer.state.values()):
        raise ValueError("fsdp must wrap the model before the optimizer has taken a step")
    swap = {id(before[name]): after[name] for name in before}
    for group in optimizer.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]


def _mesh_comm(mesh, world):
    """A counted Comm over this rank's sharding group of `mesh` (its last dimension)."""
    return Comm(mesh.get_group(mesh.ndim - 1), world.ledger)


class FSDP(NoOp):
    """FSDP2 over the island's local ranks. `wrap` is a wrap policy object (islands.sync.wrap_policy; islands.inner
    exports them: BlockWrap(), ModelWrap(), ParamThreshold(n), SplitByParams(k), GraphWrap(k)); None is
    BlockWrap()."""

    name = "fsdp"

    def __init__(
        self,
        wrap: WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        param_dtype: str = "",
        reduce_dtype: str = "",
        grad_clip: bool = False,
        prefetch: int = 0,
        shard_group: str | int = "",
        memory_budget_bytes: int = 0,
    ):
        """`prefetch` N >= 1: gather the next N units ahead, forward and backward (SOTA-117; 0 = FSDP2's own).
        `shard_group`: "" (the island), "auto" (smallest group fitting `memory_budget_bytes`) or a rank count;
        groups smaller than the data-parallel world replicate across each other (HSDP, SOTA-119)."""
        if wrap is not None and not isinstance(wrap, WrapPolicy):
            hint = f"; parse text at the edge: islands.sync.parse_wrap({wrap!r})" if isinstance(wrap, str) else ""
            raise TypeError(
                f"FSDP takes a wrap policy object (BlockWrap(), ModelWrap(), ParamThreshold(n), "
                f"SplitByParams(k), GraphWrap(k)); got {type(wrap).__name__} {wrap!r}{hint}"
            )
        self.policy = BlockWrap() if wrap is None else wrap
        self.reshard_after_forward = bool(reshard_after_forward)
        for label, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{label}={value!r}; choose one of {', '.join(repr(k) for k in DTYPES)}")
        self.param_dtype, self.reduce_dtype = DTYPES[param_dtype], DTYPES[reduce_dtype]
        self.grad_clip = grad_clip  # the trainer clips: one scalar all-reduce of the global norm per step
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}; give 0 (FSDP2's implicit prefetch) or N >= 1 units ahead")
        self.prefetch, self.shard_group = prefetch, parse_shard_group(shard_group)
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.group_size = 0  # ranks per sharding group, resolved in wrap
        self.shard_comm: Collectives | None = None  # counted Comm over this rank's sharding group (evaluation gathers)
        self.units: list[Unit] = []
        self.traffic: list[tuple[str, int, int]] = []
        self.full: nn.Module | None = None
        self.sharded: nn.Module | None = None  # the module fully_shard sharded (under any compile wrapper)
        self.world = None
        self.islands_apart = False  # set by a Stack with an outer strategy: no replication across islands

    def keep_islands_apart(self) -> None:
        """An outer strategy joins the islands: shard inside each island and replicate nothing across them
        (HSDP's per-step all-reduce across islands would make every island the same replica)."""
        self.islands_apart = True

    def wrap(self, model, optimizer, world):
        refuse_alone_in_elastic(self, world)
        self.world = world
        if world.size == 1 or (self.islands_apart and world.workers_per_island == 1):
            return model  # a world (or, under an outer strategy, an island) of one has nothing to shard across
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compiled, model = model, uncompiled(model)  # compiled before wrap: shard the module under it (plain names)
        groups, self.units = plan_units(model, self.policy)
        n = self.group_size = resolve_group(self.shard_group, self.units, world, self.memory_budget_bytes)
        if self.islands_apart and n != world.workers_per_island:
            raise ValueError(
                f"fsdp under an outer strategy shards over each island's {world.workers_per_island} "
                f"workers; shard_group={self.shard_group!r} asks for groups of {n}: leave it ''"
            )
        # under an outer strategy: the island's own 1-D mesh (the world's ("island", "local") mesh sliced), so
        # FSDP replicates nothing across islands
        mesh = world.mesh["local"] if self.islands_apart else build_mesh(world, n)
        self.shard_comm = world.comm("local") if n == world.workers_per_island else _mesh_comm(mesh, world)
        self.full = copy.deepcopy(model)  # plain copy for evaluation and checkpoints, refreshed on demand
        self.full.register_load_state_dict_post_hook(lambda module, keys: self._scatter_full(self.sharded))
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        before = dict(model.named_parameters())
        for group in groups:
            fully_shard(
                group if len(group) > 1 else group[0],
                mesh=mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=mp,
            )
        fully_shard(model, mesh=mesh, mp_policy=mp)  # root: FSDP decides (keeps it gathered for backward)
        if self.prefetch:
            set_prefetch(model, groups, self.prefetch)
        _repoint_optimizer(optimizer, before, dict(model.named_parameters()))
        self.sharded = model
        pb = (self.param_dtype or torch.float32).itemsize
        gb = (self.reduce_dtype or self.param_dtype or torch.float32).itemsize
        # a group of one gathers and scatters nothing (FSDP skips both); it only all-reduces across groups
        self.traffic = unit_traffic(self.units, n, self.reshard_after_forward, pb, gb) if n > 1 else []
        if mesh.ndim > 1:  # HSDP: each unit's reduced 1/n gradient shard is all-reduced across the groups
            self.traffic += [
                ("fsdp_replicate_all_reduce", u.padded_numel(n) // n * gb, u.padded_numel(n) // n * gb)
                for u in self.units
            ]
        if self.grad_clip:
            self.traffic.append(("fsdp_grad_norm", 4, 4))  # the fp32 global norm, reduced once
        return compiled  # the user's object: a compiled model stays compiled, its module now sharded in place

    def compile_units(self) -> list[nn.Module]:
        """The modules fully_shard wrapped (root first), for a compile one unit at a time (base.CompilesByUnit):
        torch.compile does not trace FSDP's hooks, and after the break at a unit's call it starts again only in code
        of the model's own, so a unit that is one of torch's layers (an nn.Linear of an nn.Sequential) would run
        eagerly under a compile of the whole model."""
        if self.sharded is None:
            return []  # not sharded (a world or island of one): the whole model compiles as one
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.sharded.modules() if isinstance(m, FSDPModule)]

    def after_backward(self, model, step):
        for kind, sent, received in self.traffic:
            self.world.ledger.record(kind, sent, received)

    # ---- a full model for evaluation and checkpoints --------------------------------------------
    def eval_model(self, model):
        """Collective: every rank of the island must call it. Returns a plain module with full tensors."""
        if self.full is None:
            return uncompiled(model)
        model = uncompiled(model)  # compiled after wrap: the sharded module under it, named as self.full is
        comm = self.shard_comm
        n = comm.size
        with torch.no_grad():
            full = dict(self.full.named_parameters())
            for name, p in model.named_parameters():
                q = full[name]
                local = p.to_local().detach() if hasattr(p, "to_local") else p.detach()
                rows = math.ceil(rows_of(p.shape) / n)
                padded = local.new_zeros((rows, *p.shape[1:]) if p.dim() else (1,))
                padded[: local.shape[0] if p.dim() else 1].copy_(local if p.dim() else local.reshape(1))
                whole = torch.cat(comm.all_gather(padded, kind="fsdp_eval_gather"))
                q.copy_(whole[: rows_of(p.shape)].reshape(p.shape))
            for b, c in zip(model.buffers(), self.full.buffers()):
                c.copy_(b)
        self.full.train(model.training)
        return self.full

    def _scatter_full(self, model) -> None:
        """After a state dict was loaded into the full copy: write each rank's slice into the shards."""
        assert self.shard_comm is not None and self.full is not None  # wrap made both before registering this hook
        n, rank = self.shard_comm.size, self.shard_comm.rank
        full = dict(self.full.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                q = full[name]
                if not hasattr(p, "to_local"):
                    p.copy_(q)
                    continue
                rows = math.ceil(rows_of(p.shape) / n)
                local = p.to_local()
                if local.numel():
                    local.copy_(q[rank * rows : rank * rows + local.shape[0]])
            for b, c in zip(model.buffers(), self.full.buffers()):
                b.copy_(c)

    def state_dict(self) -> dict:
        return {}  # parameters travel through eval_model; FSDP keeps no other state between steps
