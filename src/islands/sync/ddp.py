"""Data parallel inside an island with torch's DistributedDataParallel (LIT-219).

DDP fuses gradients into buckets (SOTA-048) and all-reduces each bucket as soon as backward has filled
it, overlapping communication with the rest of backward (SOTA-047). We keep DDP's machinery and only
replace the bucket hook, so every byte goes through our counted Comm, and so compressors and robust
aggregators can take over the bucket exchange:

    DDP()                                           counted mean of each bucket
    DDP(compressor=PowerSGD(rank=4))                compressed exchange (islands.compress.ddp_comm_hook)
    DDP(aggregator=CoordinateMedian(), attack=Byzantine(SignFlip(), count=1))
                                                    robust exchange under a rehearsed attack (sync/exchange.py)
    DDP(compressor=TorchPowerSGD(rank=4))           torch's own PowerSGD hook, counted (the A/B reference)

With an optimizer that averages across ranks itself (1-bit Adam, split-moment AdamW: a
`CommunicatingOptimizer`), there is no gradient exchange: `wrap` only makes every rank of the island
start from its first rank's parameters and floating buffers (one counted broadcast each, kind
"param_broadcast"), which makes identical starting points a fact rather than an assumption about seeds.
"""

from __future__ import annotations

import hashlib
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from islands.aggregate.coordinate import Mean
from islands.compress.base import Compressor
from islands.compress.ddp_hook import ddp_comm_hook
from islands.compress.error_feedback import with_error_feedback
from islands.compress.optimizer_base import CommunicatingOptimizer
from islands.faults.roles import LabelFlip, flip_targets
from islands.runtime.comm import Comm
from islands.runtime.compiled import uncompiled
from islands.sync.base import NoOp, refuse_alone_in_elastic
from islands.sync.exchange import RobustBucketState, robust_bucket_hook


def counted_allreduce_hook(comm: Comm, _bucket_state=None):
    """DDP's default exchange (mean of gradients), with bytes and time recorded in comm's ledger."""
    size = comm.size  # fixed for the life of the group: not looked up per bucket

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(size)
        return comm.all_reduce_async(buf, kind="grad_all_reduce")

    return hook


class DDP(NoOp):
    name = "ddp"

    def __init__(
        self,
        compressor: Compressor | None = None,
        aggregator=None,
        attack=None,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        seed: int = 0,
    ):
        """`compressor`: any islands Compressor (biased ones get error feedback unless built with ef=False) or
        TorchPowerSGD. `aggregator`: a robust aggregator (islands.robust); Mean or None is DDP's plain mean.
        `attack`: a Byzantine plan to rehearse. `bucket_mb`: DDP's bucket size (torch's default 25 MB, Horovod's
        fusion buffer 64 MB, LIT-220). `overlap`: compress each bucket on a worker thread while backward goes on,
        or inside the hook. `seed`: seeds the attack's per-bucket random streams."""
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if isinstance(aggregator, Mean):
            aggregator = None
        if compressor is not None and (aggregator is not None or attack is not None):
            raise ValueError(
                "a compressor and a robust aggregator/attack cannot be combined in the per-step exchange: "
                "robust aggregators need each rank's uncompressed gradient; use one of them, or robust "
                "aggregation in an outer strategy"
            )
        if compressor is not None and not (isinstance(compressor, Compressor) or hasattr(compressor, "make_hook")):
            raise TypeError(
                f"DDP(compressor=...) takes a compressor (islands.compress.PowerSGD(rank=4), ...); "
                f"got {type(compressor).__name__}"
            )
        if isinstance(compressor, Compressor):
            compressor = with_error_feedback(compressor)  # early: a non-contractive compressor with ef fails here
        self.compressor, self.aggregator, self.attack = compressor, aggregator, attack
        self.bucket_mb = max(bucket_mb, getattr(compressor, "bucket_mb", 0.0))  # torch's hook: one bucket
        self.overlap, self.seed = bool(overlap), int(seed)
        self.hook_state: object = None  # the comm hook's state, its type the exchange's own (None: plain DDP)
        self.rank = 0
        self.label_flip = None  # (attack plan, classes) when a Byzantine rank trains on flipped labels

    def _hook(self, comm: Comm, model: torch.nn.Module, world):
        """(state, hook) for this exchange; (None, counted mean) for plain DDP."""
        if self.compressor is not None and hasattr(self.compressor, "make_hook"):
            return self.compressor.make_hook(comm, model)
        if self.compressor is not None:  # state keyed by the plain names: a compiled model's match an eager one's
            return ddp_comm_hook(self.compressor, comm, unwrap(model).named_parameters(), overlap=self.overlap)
        if self.aggregator is not None or self.attack is not None:
            return RobustBucketState(
                comm, self.aggregator or Mean(), self.attack, world.rank, world.size, self.seed
            ), robust_bucket_hook
        return None, counted_allreduce_hook(comm)

    def wrap(self, model, optimizer, world):
        refuse_alone_in_elastic(self, world)
        self.rank = world.rank
        if self.attack is not None:
            plan = self.attack.plan(world.size, self.seed)
            if plan.is_byzantine(world.rank) and isinstance(plan.attack, LabelFlip):  # the data path
                self.label_flip = plan
        if isinstance(optimizer, CommunicatingOptimizer):
            if self.compressor is not None or self.aggregator is not None or self.attack is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} averages across ranks itself, so there is no gradient "
                    "exchange to compress or aggregate; use DDP() with it"
                )
            self.name = f"synced-by-{getattr(optimizer, 'name', type(optimizer).__name__)}"
            broadcast_start(model, world)
            return model
        if world.workers_per_island == 1:
            return model  # an island of one has nobody to average with
        comm = world.comm("local")
        ddp = start_ddp(model, world.local_group, self.bucket_mb)
        self.hook_state, hook = self._hook(comm, model, world)
        ddp.register_comm_hook(self.hook_state, hook)
        return ddp

    def on_batch(self, batch, step):
        if self.label_flip is None:
            return batch
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and torch.is_tensor(batch[1])):
            raise TypeError("a label-flip attack needs (inputs, integer targets) batches")
        classes = self.label_flip.attack.classes
        if classes is None:
            raise ValueError("label-flip needs the number of classes: LabelFlip(classes=C)")
        return batch[0], flip_targets(batch[1], classes)

    def eval_model(self, model):
        return unwrap(model)

    def state_dict(self) -> dict:
        sd = getattr(self.hook_state, "state_dict", None)
        return {"hook": sd()} if sd else {}

    def load_state_dict(self, state: dict) -> None:
        load = getattr(self.hook_state, "load_state_dict", None)
        if state.get("hook") and load is not None:
            load(state["hook"])


def start_ddp(model: torch.nn.Module, group, bucket_mb: float) -> DistributedDataParallel:
    """torch's DDP over `group`, its start-up synchronisation done with plain collectives.

    DDP's own start-up (checking the parameters' shapes across ranks, broadcasting parameters and buffers from the
    first rank) held the GIL for long stretches: beside 4 busy processes the gap between a heartbeat thread's 50 ms
    ticks reached 0.43 s, and 1.12 s on the chaos experiment's loaded machine, against 0.17 s with these
    collectives (session 20). A worker whose heartbeat thread cannot run is found silent and killed: the chaos
    runs' start-up false deaths came just after epoch 0 formed, when every island builds its DDP. Same result:
    every rank starts from the group's first rank's parameters and buffers, and models that differ are refused."""
    if "init_sync" not in inspect.signature(DistributedDataParallel.__init__).parameters:  # torch before 2.5
        return DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    group = group if group is not None else dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    tensors = list(model.parameters()) + list(model.buffers())
    shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    mine = torch.tensor([int.from_bytes(hashlib.sha256(shapes).digest()[:7], "big")], dtype=torch.int64)
    first = mine.clone()
    dist.broadcast(first, src, group=group)
    same = torch.tensor([int(bool(first == mine))], dtype=torch.int64)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    if not int(same):
        raise ValueError(
            f"the model's parameters and buffers differ in shape or dtype across the ranks of this "
            f"island ({len(tensors)} tensors here): every rank must build the same model"
        )
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src, group=group)
    return DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb, init_sync=False)


def broadcast_start(model: torch.nn.Module, world) -> None:
    """Every rank of the island starts from the island's first rank's parameters and floating buffers."""
    if world.workers_per_island == 1:
        return
    comm = world.comm("local")
    src = world.island * world.workers_per_island  # global rank of this island's first worker
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            comm.broadcast(t.data, src=src, kind="param_broadcast")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under DDP and torch.compile wrappers, in either order (compiled before or after wrap):
    what strategies name parameters by and what eval_model returns, so keys carry no `module.`/`_orig_mod.`."""
    model = uncompiled(model)
    while isinstance(model, DistributedDataParallel):
        model = uncompiled(model.module)
    return model
