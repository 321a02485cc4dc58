"""Outer strategies: how islands meet, rarely and cheaply (public names; docs/outer-strategies.md).

    DiLoCo(inner_steps=100, outer="sgd", outer_lr=sqrt(2), momentum=0, compressor=None, aggregator=None)
                                           the measured best; LIT-212's: outer="nesterov", outer_lr=0.7, momentum=0.9
    StreamingDiLoCo(inner_steps=100, fragments=4, tau=1, bits=4)     fragments, overlap, 4-bit deltas (LIT-214)
    LocalSGD(every=8), PostLocalSGD(switch, every=16), OverlapLocalSGD(tau=2, pull=0.5), SlowMo(every=8),
    EASGD(every=4, beta=0.9), Gossip(every=4, topology=ExponentialGraph())
    WarmStart(outer, steps)                ordinary data parallelism across islands first (LIT-212)
Outer optimizers: OuterSGD(lr, momentum, nesterov), PrimalAveraging(lr, weight). Gossip topologies: Ring(),
ExponentialGraph(), RandomPeers(s, seed). Every one of them needs no step count: call `finish(model)` after
the last step (the Trainer does), and `eval_model(model)` is the global model, parameters and buffers.
"""

from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.easgd import EASGD
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.local_sgd import LocalSGD
from islands.sync.outer.outer_opt import OuterSGD, PrimalAveraging
from islands.sync.outer.overlap_local_sgd import OverlapLocalSGD
from islands.sync.outer.post_local_sgd import PostLocalSGD
from islands.sync.outer.slowmo import SlowMo
from islands.sync.outer.streaming_diloco import StreamingDiLoCo
from islands.sync.outer.topology import ExponentialGraph, RandomPeers, Ring
from islands.sync.outer.warm_start import WarmStart

__all__ = ["DiLoCo", "EASGD", "ExponentialGraph", "Gossip", "LocalSGD", "OuterSGD", "OverlapLocalSGD", "PostLocalSGD",
           "PrimalAveraging", "RandomPeers", "Ring", "SlowMo", "StreamingDiLoCo", "WarmStart"]
