"""The aggregators by spec name (islands.spec): each constructor's signature is the spec's schema.

    mean   median   trimmed-mean:beta=0.25   krum:f=2   multi-krum:f=2,m=4   geomed   cclip:tau=1.0
    nnm+krum:f=2   bucketing:s=2+median   bucketing:s=2+nnm+krum:f=2

The pre-aggregation steps (nnm, bucketing) take the aggregator they feed after a '+', so the leftmost step runs
first on the inputs. nnm without f takes the f of the aggregator at the end of the chain.
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator, BaseAggregator
from islands.aggregate.clipping import CenteredClipping
from islands.aggregate.coordinate import CoordinateMedian, Mean, TrimmedMean
from islands.aggregate.geomed import GeometricMedian
from islands.aggregate.krum import Krum, MultiKrum
from islands.aggregate.mixing import Bucketing, NearestNeighborMixing
from islands.spec import Registry


def _final_f(inner: BaseAggregator) -> int | None:
    """The f of the aggregator at the end of a chain of steps, if it has one."""
    while isinstance(inner, (NearestNeighborMixing, Bucketing)):
        inner = inner.inner
    return getattr(inner, "f", None)


def nearest_neighbor_mixing(inner: BaseAggregator, f: int | None = None) -> NearestNeighborMixing:
    """Nearest-neighbour mixing (Allouah et al., 2023): each input becomes the mean of its n - f nearest inputs
    before the next aggregator sees them. `f`: how many inputs may be faulty; by default the f of the aggregator
    at the end of the chain (nnm+krum:f=2)."""
    if f is None:
        f = _final_f(inner)
        if f is None:
            raise ValueError(
                f"nnm needs f=<int>, or an aggregator after it that has f (nnm+krum:f=2); {inner!r} has none"
            )
    return NearestNeighborMixing(inner, f)


AGGREGATORS = Registry(
    "aggregator",
    {
        "mean": Mean,
        "median": CoordinateMedian,
        "trimmed-mean": TrimmedMean,
        "krum": Krum,
        "multi-krum": MultiKrum,
        "geomed": GeometricMedian,
        "cclip": CenteredClipping,
        "nnm": nearest_neighbor_mixing,
        "bucketing": Bucketing,
    },
    base=(Aggregator, BaseAggregator),
    aliases={"iters": "max_iter"},  # geomed's older key (its repr still writes it)
)
