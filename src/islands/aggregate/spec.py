"""Aggregator specs: one string for the CLI and for experiment tables.

Syntax (islands.spec):   [step+]...aggregator        step, aggregator = name[:key=value[,key=value]...]

The last stage is the aggregator; stages before it are pre-aggregation steps, applied left to right (so
"bucketing:s=2+nnm+krum:f=2" buckets first, then mixes, then runs Krum). nnm without f takes the aggregator's
f. The names and parameters are AGGREGATORS (islands.aggregate.registry), read from the constructors.

    mean   median   trimmed-mean:beta=0.25   krum:f=2   multi-krum:f=2,m=4   geomed
    cclip:tau=1.0   nnm+krum:f=2   bucketing:s=2+median
"""

from __future__ import annotations

from islands.aggregate.base import BaseAggregator
from islands.aggregate.registry import AGGREGATORS
from islands.spec import Spec

STEPS = AGGREGATORS.chaining()  # the pre-aggregation steps ("nnm", "bucketing"): they feed the stage after '+'


def valid_specs() -> str:
    """Every aggregator and step with its parameters, for error messages and --help."""
    return AGGREGATORS.describe()


def parse_aggregator(spec: str | Spec) -> BaseAggregator:
    """Build an aggregator (with its pre-aggregation steps) from a spec; see module doc."""
    return AGGREGATORS.build(spec)
