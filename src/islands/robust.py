"""Robust aggregation and the attacks to rehearse it against (public names; docs/robustness.md).

Aggregators (SOTA-220), for `inner.DDP(aggregator=...)` and every outer strategy's `aggregator=`:
    Mean(), CoordinateMedian(), TrimmedMean(beta), Krum(f), MultiKrum(f, m), GeometricMedian(),
    CenteredClipping(tau), and the pre-aggregation steps NearestNeighborMixing(aggregator, f), Bucketing(aggregator, s)
Attacks: Byzantine(role, count=k | ranks=(...)) with a role SignFlip(), Scaled(factor), GaussianNoise(sigma),
    ALIE(z), InnerProductManipulation(eps), NonFinite(value), SilentDropout(mode), Straggler(delay), LabelFlip(classes)
"""

from islands._deprecated import alias_getattr
from islands.aggregate.clipping import CenteredClipping
from islands.aggregate.coordinate import CoordinateMedian, Mean, TrimmedMean
from islands.aggregate.geomed import GeometricMedian
from islands.aggregate.krum import Krum, MultiKrum
from islands.aggregate.mixing import Bucketing, NearestNeighborMixing
from islands.faults.attacks import Byzantine
from islands.faults.roles import (
    ALIE,
    GaussianNoise,
    InnerProductManipulation,
    LabelFlip,
    NonFinite,
    Scaled,
    SignFlip,
    SilentDropout,
    Straggler,
)

__getattr__ = alias_getattr(__name__)  # Median: deprecated, now CoordinateMedian (docs/deprecations.md)

__all__ = [
    "ALIE",
    "Bucketing",
    "Byzantine",
    "CenteredClipping",
    "CoordinateMedian",
    "GaussianNoise",
    "GeometricMedian",
    "InnerProductManipulation",
    "Krum",
    "LabelFlip",
    "Mean",
    "MultiKrum",
    "NearestNeighborMixing",
    "NonFinite",
    "Scaled",
    "SignFlip",
    "SilentDropout",
    "Straggler",
    "TrimmedMean",
]
