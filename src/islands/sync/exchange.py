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
    """Aggregator (and its explicit state) plus the attack plan, shared by every bucket."""

    def __init__(self, comm: Comm, aggregator, attack, rank: int):
        self.comm, self.aggregator, self.attack, self.rank = comm, aggregator, attack, rank

    def state_dict(self) -> dict:
        return {"aggregator": self.aggregator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.aggregator.load_state_dict(state["aggregator"])


def robust_bucket_hook(state: RobustBucketState, bucket) -> torch.futures.Future:
    from islands.aggregate import robust_all_reduce

    buf = bucket.buffer()
    sent = state.attack.corrupt(buf, state.rank, state.comm) if state.attack is not None else buf
    buf.copy_(robust_all_reduce(sent, state.comm, state.aggregator, kind="grad_all_gather"))
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
        from islands.aggregate import parse_aggregator
        from islands.faults.attacks import parse_attack

        def factory(comm: Comm, model: torch.nn.Module):
            attack = parse_attack(cfg.attack, world_size=world.size, seed=cfg.seed) if cfg.attack else None
            return RobustBucketState(comm, parse_aggregator(cfg.aggregate or "mean"), attack, world.rank), robust_bucket_hook

        return factory

    from islands.compress import ddp_comm_hook, parse_compressor

    def factory(comm: Comm, model: torch.nn.Module):
        return ddp_comm_hook(parse_compressor(cfg.compress), comm, model.named_parameters())

    return factory
