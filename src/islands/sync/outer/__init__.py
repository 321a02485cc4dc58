"""Outer strategies: how islands meet, rarely and cheaply, across the cross-island process group.

    DiLoCo(inner_steps=100, aggregator=CoordinateMedian())                         objects inside
    make_outer("diloco:inner_steps=100,outer_lr=0.7,momentum=0.9")                 a spec string, at the edge

Strategies (one module each): local-sgd, post-local-sgd, overlap-local-sgd, slowmo, easgd, diloco
(outer=nesterov|sgd|primal, sync_inner_state), streaming-diloco, gossip (topology=exp|ring|random:s=S). Each runs after the inner strategy
(ddp inside an island) at every hook; all cross-island traffic goes through `strategy.comm`.
"""

from __future__ import annotations

from islands.sync.outer.base import LoneComm, OuterStrategy
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.easgd import EASGD
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.local_sgd import LocalSGD
from islands.sync.outer.overlap_local_sgd import OverlapLocalSGD
from islands.sync.outer.post_local_sgd import PostLocalSGD
from islands.sync.outer.slowmo import SlowMo
from islands.sync.outer.spec import PARAMS, OuterSpec, parse_outer, valid_specs
from islands.sync.outer.streaming_diloco import StreamingDiLoCo
from islands.sync.outer.warm_start import WarmStart

CLASSES = {
    "local-sgd": LocalSGD,
    "post-local-sgd": PostLocalSGD,
    "overlap-local-sgd": OverlapLocalSGD,
    "slowmo": SlowMo,
    "easgd": EASGD,
    "diloco": DiLoCo,
    "streaming-diloco": StreamingDiLoCo,
    "gossip": Gossip,
}


def make_outer(spec: OuterSpec | str, warmup: int = 0) -> OuterStrategy | WarmStart:
    """Build an outer strategy from a spec string (the CLI's edge); `warmup` is post-local-sgd's default switch.

    Nested compress= and aggregate= specs become compressor and aggregator objects. With warm_start=W
    (diloco, streaming-diloco) the strategy runs inside a WarmStart that averages gradients across
    islands for its first W steps.
    """
    from islands.aggregate import parse_aggregator
    from islands.compress.spec import build_compressor

    spec = parse_outer(spec) if isinstance(spec, str) else spec
    kwargs = dict(spec.params)
    if spec.name == "post-local-sgd" and kwargs["switch"] == -1:
        kwargs["switch"] = warmup  # SOTA-216: switch where the schedule first decays (end of warm-up)
    if "sync_inner_state" in kwargs:
        kwargs["sync_inner_state"] = bool(kwargs["sync_inner_state"])
    compress, aggregate = kwargs.pop("compress", "none"), kwargs.pop("aggregate", "mean")
    if compress != "none":
        kwargs["compressor"] = build_compressor(compress)
    if aggregate != "mean":
        kwargs["aggregator"] = parse_aggregator(aggregate)
    warm = kwargs.pop("warm_start", 0)
    outer = CLASSES[spec.name](**kwargs)
    return WarmStart(outer, warm) if warm else outer


__all__ = ["CLASSES", "PARAMS", "DiLoCo", "EASGD", "Gossip", "LocalSGD", "LoneComm", "OuterSpec", "OuterStrategy",
           "OverlapLocalSGD", "PostLocalSGD", "SlowMo", "StreamingDiLoCo", "WarmStart", "make_outer",
           "parse_outer", "valid_specs"]
