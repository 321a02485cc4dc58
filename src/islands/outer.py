"""Outer strategies: how islands meet, rarely and cheaply (public names; docs/outer-strategies.md).

    DiLoCo(inner_steps=100, outer_optimizer=None, exchange=None, schedule=None)     from parts: plain SGD, lr sqrt(2)
                                           (the measured best), the plain mean, plain rounds by default; LIT-212's:
                                           outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9,
                                           nesterov=True) or OuterSGD(0.7, 0.9, nesterov=True)
      parts: OuterStep(optimizer, sqrt_islands, follow_inner_lr); Exchange(compressor=, aggregator=) (compressor:
      islands.compress or Quant4/Quant4Zstd); Rounds(), Fragments(fragments, tau, merge, landing),
      Overlapped("delayed"|"eager", fragments), Adaptive("speed"|"deadline", deadline, overlap)
      DiLoCo.from_options(outer="nesterov", outer_lr=0.7, ...)   the spec strings' keyword options
    StreamingDiLoCo(inner_steps=100)       DiLoCo with Fragments(4, tau=1) and 4-bit deltas (LIT-214)
    LocalSGD(every=8), PostLocalSGD(switch, every=16), OverlapLocalSGD(tau=2, pull=0.5), SlowMo(every=8),
    EASGD(every=4, beta=0.9), Gossip(every=4, topology=ExponentialGraph())
    ParameterServer(inner_steps=100, rule=None, shards=1, max_staleness=4, quorum=1, discount=0, aggregator=None,
                    compressor=None, arrivals=None, host=None)
                                           asynchronous pushes and pulls to a server (issue #36): delayed Nesterov
                                           (DelayedNesterov, arXiv 2401.09135), samples-weighted windows, staleness
                                           refusal; arrivals FirstCome() | VirtualClock(round_seconds);
                                           host=InProcessServer() under islands.simulate;
                                           service=ServerProcesses(servers) for server processes that a
                                           supervisor restarts from their journals (docs/parameter-server.md);
                                           wait=FixedWait(s) | PacedWait() (or seconds, "auto") with quorum >= 2
    WarmStart(outer, steps)                ordinary data parallelism across islands first (LIT-212)
Outer optimizers: OuterSGD(lr, momentum, nesterov), PrimalAveraging(lr, weight). Gossip topologies: Ring(),
ExponentialGraph(), RandomPeers(s, seed). Every one of them needs no step count: call `finish(model)` after
the last step (the Trainer does), and `eval_model(model)` is the global model, parameters and buffers.
"""

from islands.sync.outer.adaptive import Adaptive
from islands.sync.outer.delayed_nesterov import DelayedNesterov
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.eager import Overlapped
from islands.sync.outer.easgd import EASGD
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.local_sgd import LocalSGD
from islands.sync.outer.outer_opt import OuterSGD, OuterStep, PrimalAveraging
from islands.sync.outer.overlap_local_sgd import OverlapLocalSGD
from islands.sync.outer.post_local_sgd import PostLocalSGD
from islands.sync.outer.ps import InProcessServer, ParameterServer, ServerProcesses
from islands.sync.outer.ps_link import FirstCome, VirtualClock
from islands.sync.outer.ps_wait import FixedWait, PacedWait, WindowWait
from islands.sync.outer.quant4 import Quant4
from islands.sync.outer.rounds import Fragments, Rounds
from islands.sync.outer.slowmo import SlowMo
from islands.sync.outer.streaming_diloco import StreamingDiLoCo
from islands.sync.outer.topology import ExponentialGraph, RandomPeers, Ring
from islands.sync.outer.warm_start import WarmStart
from islands.sync.outer.zstd4 import Quant4Zstd

__all__ = [
    "Adaptive",
    "DelayedNesterov",
    "DiLoCo",
    "EASGD",
    "Exchange",
    "ExponentialGraph",
    "FirstCome",
    "FixedWait",
    "Fragments",
    "Gossip",
    "InProcessServer",
    "LocalSGD",
    "OuterSGD",
    "OuterStep",
    "OverlapLocalSGD",
    "PacedWait",
    "Overlapped",
    "ParameterServer",
    "PostLocalSGD",
    "PrimalAveraging",
    "Quant4",
    "Quant4Zstd",
    "RandomPeers",
    "Ring",
    "Rounds",
    "ServerProcesses",
    "SlowMo",
    "StreamingDiLoCo",
    "VirtualClock",
    "WarmStart",
    "WindowWait",
]
