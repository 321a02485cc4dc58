"""Outer strategies: how islands meet, rarely and cheaply, across the cross-island process group.

    DiLoCo(100, exchange=Exchange(aggregator=CoordinateMedian()))                   objects inside (the parts)
    make_outer("diloco:inner_steps=100,aggregator=(median)")                         a spec string, at the edge

Strategies (one module each): local-sgd, post-local-sgd, overlap-local-sgd, slowmo, easgd, diloco
(outer=nesterov|sgd|primal, sync_inner_state), streaming-diloco, gossip (topology=exp|ring|(random:s=S)). Each runs
after the inner strategy (ddp inside an island) at every hook; all cross-island traffic goes through `strategy.comm`.
Their spec names and parameters: STRATEGIES (registry.py), read from the constructors (diloco and streaming-diloco:
from DiLoCo.parts, the keyword options of before, which DiLoCo.from_options builds into the parts).
"""

from __future__ import annotations

from islands.spec import Spec
from islands.sync.outer.base import LoneComm, OuterStrategy
from islands.sync.outer.diloco import DiLoCo as DiLoCo
from islands.sync.outer.easgd import EASGD as EASGD
from islands.sync.outer.gossip import Gossip as Gossip, consensus_distance, simulate_mixing
from islands.sync.outer.local_sgd import LocalSGD as LocalSGD
from islands.sync.outer.overlap_local_sgd import OverlapLocalSGD as OverlapLocalSGD
from islands.sync.outer.post_local_sgd import PostLocalSGD as PostLocalSGD
from islands.sync.outer.registry import STRATEGIES
from islands.sync.outer.slowmo import SlowMo as SlowMo
from islands.sync.outer.spec import PARAMS, OuterSpec, check_outer, parse_outer, valid_specs
from islands.sync.outer.streaming_diloco import StreamingDiLoCo as StreamingDiLoCo
from islands.sync.outer.topology import parse_topology
from islands.sync.outer.warm_start import WarmStart


def make_outer(spec: OuterSpec | Spec | str, warmup: int = 0) -> OuterStrategy | WarmStart:
    """Build an outer strategy from a spec (the CLI's edge); `warmup` is post-local-sgd's switch unless the spec
    gives one (SOTA-216: switch where the schedule first decays, at the end of the warm-up).

    Nested compressor= and aggregator= specs become compressor and aggregator objects. With warm_start=W
    (diloco, streaming-diloco) the strategy runs inside a WarmStart that averages gradients across
    islands for its first W steps.
    """
    return STRATEGIES.build(check_outer(spec), switch=warmup)


# The strategies themselves (DiLoCo, Gossip, ...) have their public home in islands.outer (one home per name,
# tests/unit/project/test_public_homes.py); this package exports the machinery: the registry, the spec edge, the
# base class.
__all__ = [
    "PARAMS",
    "STRATEGIES",
    "LoneComm",
    "OuterSpec",
    "OuterStrategy",
    "check_outer",
    "make_outer",
    "parse_outer",
    "valid_specs",
    # gossip's analysis tools: how far a topology's mixing gets in R rounds, without processes
    "consensus_distance",
    "parse_topology",
    "simulate_mixing",
]
