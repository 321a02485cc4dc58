"""Robust aggregation (SOTA-220): combine one tensor per worker into one, tolerating faulty workers.

Every aggregator drops NaN/Inf inputs before it or its state sees them (aggregate/base.py).
The aggregators themselves (Mean, CoordinateMedian, Krum, ...) have their public home in islands.robust; this
package exports the machinery around them.
Build one from a spec string with `parse_aggregator("nnm+krum:f=2")`; aggregate across ranks with
`robust_all_reduce(tensor, comm, aggregator)`.
"""

from islands.aggregate.base import AggregationReport, Aggregator, BaseAggregator, TooFewInputsError
from islands.aggregate.clipping import CenteredClipping as CenteredClipping
from islands.aggregate.coordinate import CoordinateMedian as CoordinateMedian, Mean as Mean, TrimmedMean as TrimmedMean
from islands.aggregate.distributed import (
    flatten_named,
    robust_all_reduce,
    robust_all_reduce_dict,
    unflatten_named,
)
from islands.aggregate.geomed import GeometricMedian as GeometricMedian
from islands.aggregate.krum import Krum as Krum, MultiKrum as MultiKrum, pairwise_sq_distances
from islands.aggregate.mixing import Bucketing as Bucketing, NearestNeighborMixing as NearestNeighborMixing
from islands.aggregate.spec import AGGREGATORS, STEPS, parse_aggregator, valid_specs

__all__ = [
    "AGGREGATORS",
    "STEPS",
    "AggregationReport",
    "Aggregator",
    "BaseAggregator",
    "TooFewInputsError",
    "flatten_named",
    "pairwise_sq_distances",
    "parse_aggregator",
    "robust_all_reduce",
    "robust_all_reduce_dict",
    "unflatten_named",
    "valid_specs",
]
