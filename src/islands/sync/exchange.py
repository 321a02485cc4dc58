"""What replaces DDP's plain bucket average: a compressed exchange, or a robust one under attack.

The DDP strategy asks `bucket_hook_factory(cfg, world)` for a `factory(comm, model) -> (state, hook)`.
  - compress=SPEC               -> islands.compress.ddp_comm_hook (summable payloads all-reduced,
                                   gathered ones all-gathered; error feedback keyed by parameter name)
  - aggregate=SPEC or attack=SPEC -> every rank's bucket is all-gathered, Byzantine ranks corrupt what
                                   they send, and a robust aggregator combines them (same result on
                                   every rank). Compression and robust aggregation are not combined
                                   in the per-step path: robust aggregators need each rank's vector.
"""

from __future__ import annotations

import torch

from islands.config import TrainConfig
from islands.runtime.comm import Comm
from islands.runtime.world import World


class RobustBucketState:
    """One aggregator and one attack plan per DDP bucket, built from the job's specs.

    Per bucket, because some hold per-tensor state: centered clipping's centre and stale dropout's
    frozen tensor have the bucket's size, so one shared object would fail on the second bucket. DDP
    rebuilds its buckets after the first step, so a bucket is keyed by (index, size): a rebuilt
    bucket starts a fresh aggregator (cclip restarts from the coordinate median; nothing breaks).
    """

    def __init__(self, comm: Comm, aggregate: str, attack: str, rank: int, world_size: int, seed: int = 0):
        self.comm, self.rank, self.world_size, self.seed = comm, rank, world_size, seed
        self.aggregate_spec, self.attack_spec = aggregate or "mean", attack
        self.lanes: dict[str, tuple] = {}

    def lane(self, index: int, numel: int) -> tuple:
        """(aggregator, attack plan or None) for one bucket, built on first use identically on every rank."""
        key = f"{index}:{numel}"
        if key not in self.lanes:
            from islands.aggregate import parse_aggregator
            from islands.faults.attacks import parse_attack

            # A distinct seed per bucket, so Gaussian noise is not the same stream in every bucket.
            plan = parse_attack(self.attack_spec, self.world_size, seed=self.seed * 1009 + index) if self.attack_spec else None
            self.lanes[key] = (parse_aggregator(self.aggregate_spec), plan)
        return self.lanes[key]

    def state_dict(self) -> dict:
        return {"lanes": {k: {"aggregator": agg.state_dict(), "attack": plan.state_dict() if plan else {}}
                          for k, (agg, plan) in self.lanes.items()}}

    def load_state_dict(self, state: dict) -> None:
        for key, saved in state.get("lanes", {}).items():
            index, numel = (int(v) for v in key.split(":"))
            agg, plan = self.lane(index, numel)
            agg.load_state_dict(saved["aggregator"])
            if plan is not None and saved.get("attack"):
                plan.load_state_dict(saved["attack"])


def robust_bucket_hook(state: RobustBucketState, bucket) -> torch.futures.Future:
    from islands.aggregate import robust_all_reduce

    buf = bucket.buffer()
    aggregator, attack = state.lane(bucket.index(), buf.numel())
    sent = attack.corrupt(buf, state.rank, state.comm) if attack is not None else buf
    buf.copy_(robust_all_reduce(sent, state.comm, aggregator, kind="grad_all_gather"))
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's return annotation as an object; postponed annotations would hand it a string.
robust_bucket_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def bucket_hook_factory(cfg: TrainConfig, world: World):
    robust = cfg.aggregate not in ("", "mean") or bool(cfg.attack)
    if robust and cfg.compress not in ("", "none"):
        raise ValueError("compress and a robust aggregate/attack cannot be combined in the per-step exchange; "
                         "use one of them, or robust aggregation in an outer strategy")
    if robust:

        def factory(comm: Comm, model: torch.nn.Module):
            return RobustBucketState(comm, cfg.aggregate, cfg.attack, world.rank, world.size, cfg.seed), robust_bucket_hook

        return factory

    from islands.compress import ddp_comm_hook, parse_compressor

    def factory(comm: Comm, model: torch.nn.Module):
        return ddp_comm_hook(parse_compressor(cfg.compress), comm, model.named_parameters(), overlap=cfg.hook_overlap)

    return factory
