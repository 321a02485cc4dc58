"""Data parallel inside an island with torch's DistributedDataParallel (LIT-219).

DDP fuses gradients into buckets (SOTA-048) and all-reduces each bucket as soon as backward has filled
it, overlapping communication with the rest of backward (SOTA-047). We keep DDP's machinery and only
replace the bucket hook, so every byte goes through our counted Comm, and so compressors and robust
aggregators can take over the bucket exchange.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from islands.runtime.comm import Comm
from islands.sync.base import NoOp


def counted_allreduce_hook(comm: Comm, _bucket_state=None):
    """DDP's default exchange (mean of gradients), with bytes and time recorded in comm's ledger."""

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(comm.size)
        return comm.all_reduce_async(buf, kind="grad_all_reduce")

    return hook


class DDP(NoOp):
    name = "ddp"

    def __init__(self, bucket_mb: float = 25.0, hook_factory=None):
        """`hook_factory(comm, model) -> (state, hook)` replaces the plain averaging exchange."""
        self.bucket_mb = bucket_mb
        self.hook_factory = hook_factory
        self.hook_state = None

    def wrap(self, model, optimizer, world):
        if world.workers_per_island == 1:
            return model  # an island of one has nobody to average with
        comm = world.comm("local")
        ddp = DistributedDataParallel(model, process_group=world.local_group, bucket_cap_mb=self.bucket_mb)
        if self.hook_factory is None:
            ddp.register_comm_hook(None, counted_allreduce_hook(comm))
        else:
            self.hook_state, hook = self.hook_factory(comm, model)
            ddp.register_comm_hook(self.hook_state, hook)
        return ddp

    def eval_model(self, model):
        return model.module if isinstance(model, DistributedDataParallel) else model

    def state_dict(self) -> dict:
        sd = getattr(self.hook_state, "state_dict", None)
        return {"hook": sd()} if sd else {}

    def load_state_dict(self, state: dict) -> None:
        if state.get("hook") and hasattr(self.hook_state, "load_state_dict"):
            self.hook_state.load_state_dict(state["hook"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
