"""The outer strategies by spec name (islands.spec): each constructor's signature is the spec's schema.

    diloco:inner_steps=100,compressor=(powersgd:rank=4)       nested specs in parentheses
    gossip:every=4,topology=(random:s=2),seed=3               gossip's seed seeds its random topology
    streaming-diloco:fragments=4,warm_start=200               inside WarmStart for its first 200 steps

diloco and streaming-diloco keep their keyword options of before the parts (outer=, outer_lr=, overlap=, adapt=,
bits=, ...): their schema is `DiLoCo.parts`' signature (options.py) and they build through `from_options`.
`compress=` and `aggregate=` are the older names of `compressor=` and `aggregator=`. post-local-sgd's `switch`
has no default: the caller supplies it (make_outer: the end of the lr warm-up, SOTA-216). ps (the parameter
server, issue #36) builds through `parameter_server`, its spec's schema (outer=, bits=, ... as strings and numbers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from islands.aggregate.registry import AGGREGATORS  # noqa: F401 - registers the aggregator kind for nested specs
from islands.compress.registry import COMPRESSORS  # noqa: F401 - registers the compressor kind for nested specs
from islands.spec import Registry, docs_of, resolved_signature
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.easgd import EASGD
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.local_sgd import LocalSGD
from islands.sync.outer.overlap_local_sgd import OverlapLocalSGD
from islands.sync.outer.post_local_sgd import PostLocalSGD
from islands.sync.outer.ps import parameter_server
from islands.sync.outer.slowmo import SlowMo
from islands.sync.outer.streaming_diloco import StreamingDiLoCo
from islands.sync.outer.topology import TOPOLOGIES  # noqa: F401 - registers the topology kind for gossip
from islands.sync.outer.warm_start import WarmStart


def warm_startable(cls: type[DiLoCo]) -> Callable[..., OuterStrategy | WarmStart]:
    """cls.from_options (the spec's keys: cls.parts' signature) plus `warm_start`, a registry entry: the strategy
    inside WarmStart(strategy, W) when W > 0 (LIT-212 starts DiLoCo from a model pretrained with ordinary data
    parallelism)."""
    own = list(resolved_signature(cls.parts).parameters.values())
    warm = inspect.Parameter("warm_start", inspect.Parameter.KEYWORD_ONLY, default=0, annotation=int)

    def entry(*args: Any, warm_start: int = 0, **kwargs: Any) -> OuterStrategy | WarmStart:
        if warm_start < 0:
            raise ValueError(f"warm_start must be >= 0 steps (0 = no warm start), got {warm_start}")
        outer = cls.from_options(*args, **kwargs)
        return WarmStart(outer, warm_start) if warm_start else outer

    entry.__signature__ = inspect.Signature(own + [warm])  # type: ignore[attr-defined]  # inspect reads it; typeshed's functions lack it
    entry.__doc__ = (
        docs_of(cls).split("\n\n")[0]
        + "\n\n"
        + docs_of(cls.parts)
        + (
            "\n\n`warm_start`: steps of ordinary data parallelism across islands (gradients averaged every step) "
            "before the first round, as LIT-212 starts from a pretrained model; 0 = none."
        )
    )
    entry.__name__ = entry.__qualname__ = cls.__name__
    return entry


STRATEGIES = Registry(
    "outer strategy",
    {
        "local-sgd": LocalSGD,
        "post-local-sgd": PostLocalSGD,
        "overlap-local-sgd": OverlapLocalSGD,
        "slowmo": SlowMo,
        "easgd": EASGD,
        "diloco": warm_startable(DiLoCo),
        "streaming-diloco": warm_startable(StreamingDiLoCo),
        "gossip": Gossip,
        "ps": parameter_server,
    },
    base=OuterStrategy,
    aliases={"compress": "compressor", "aggregate": "aggregator"},
    shared={"gossip": {"topology": ("seed",)}},
)
