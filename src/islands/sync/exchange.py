"""DDP's robust bucket exchange: every rank's bucket all-gathered, Byzantine ranks corrupt what they send,
and a robust aggregator combines them identically on every rank (SOTA-220).

`islands.sync.ddp.DDP(aggregator=..., attack=...)` registers `robust_bucket_hook` with a
`RobustBucketState`. Compression and robust aggregation are not combined in the per-step path: robust
aggregators need each rank's vector.
"""

from __future__ import annotations

import copy

import torch

from islands.aggregate.distributed import robust_all_reduce
from islands.runtime.comm import Comm


class RobustBucketState:
    """One aggregator and one attack plan per DDP bucket, copied from the strategy's objects.

    Per bucket, because some hold per-tensor state: centered clipping's centre and stale dropout's
    frozen tensor have the bucket's size, so one shared object would fail on the second bucket. DDP
    rebuilds its buckets after the first step, so a bucket is keyed by (index, size): a rebuilt
    bucket starts a fresh aggregator (cclip restarts from the coordinate median; nothing breaks).
    """

    def __init__(self, comm: Comm, aggregator, attack, rank: int, world_size: int, seed: int = 0):
        self.comm, self.rank, self.world_size, self.seed = comm, rank, world_size, seed
        self.aggregator, self.attack = aggregator, attack
        self.lanes: dict[str, tuple] = {}

    def lane(self, index: int, numel: int) -> tuple:
        """(aggregator, attack plan or None) for one bucket, built on first use identically on every rank."""
        key = f"{index}:{numel}"
        if key not in self.lanes:
            # A distinct seed per bucket, so Gaussian noise is not the same stream in every bucket.
            plan = self.attack.plan(self.world_size, seed=self.seed * 1009 + index) if self.attack is not None else None
            self.lanes[key] = (copy.deepcopy(self.aggregator), plan)
        return self.lanes[key]

    def state_dict(self) -> dict:
        return {
            "lanes": {
                k: {"aggregator": agg.state_dict(), "attack": plan.state_dict() if plan else {}}
                for k, (agg, plan) in self.lanes.items()
            }
        }

    def load_state_dict(self, state: dict) -> None:
        for key, saved in state.get("lanes", {}).items():
            index, numel = (int(v) for v in key.split(":"))
            agg, plan = self.lane(index, numel)
            agg.load_state_dict(saved["aggregator"])
            if plan is not None and saved.get("attack"):
                plan.load_state_dict(saved["attack"])


def robust_bucket_hook(state: RobustBucketState, bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    aggregator, attack = state.lane(bucket.index(), buf.numel())
    sent = attack.corrupt(buf, state.rank, state.comm) if attack is not None else buf
    buf.copy_(robust_all_reduce(sent, state.comm, aggregator, kind="grad_all_gather"))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's return annotation as an object; postponed annotations would hand it a string.
robust_bucket_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
