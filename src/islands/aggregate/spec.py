"""Aggregator specs: one string for the CLI and for experiment tables.

Syntax:   [step+]...aggregator        step, aggregator = name[:key=value[,key=value]...]

The last stage is the aggregator; stages before it are pre-aggregation steps, applied left to
right (so "bucketing:s=2+nnm+krum:f=2" buckets first, then mixes, then runs Krum). A step that needs
f and is not given one takes the aggregator's f. Examples:

    mean   median   trimmed-mean:beta=0.25   krum:f=2   multi-krum:f=2,m=4   geomed
    cclip:tau=1.0   nnm+krum:f=2   bucketing:s=2+median
"""

from __future__ import annotations

from typing import Callable

from islands.aggregate.base import BaseAggregator
from islands.aggregate.clipping import CenteredClipping
from islands.aggregate.coordinate import CoordinateMedian, Mean, TrimmedMean
from islands.aggregate.geomed import GeometricMedian
from islands.aggregate.krum import Krum, MultiKrum
from islands.aggregate.mixing import Bucketing, NearestNeighborMixing

_REQUIRED = object()

# name -> (constructor, {param: (type, default)}); param names are the spec's, constructor kwargs may differ.
AGGREGATORS: dict[str, tuple[Callable[..., BaseAggregator], dict[str, tuple[type, object]]]] = {
    "mean": (Mean, {}),
    "median": (CoordinateMedian, {}),
    "trimmed-mean": (TrimmedMean, {"beta": (float, 0.1)}),
    "krum": (Krum, {"f": (int, _REQUIRED)}),
    "multi-krum": (MultiKrum, {"f": (int, _REQUIRED), "m": (int, _REQUIRED)}),
    "geomed": (
        lambda iters, tol, eps: GeometricMedian(max_iter=iters, tol=tol, eps=eps),
        {"iters": (int, 100), "tol": (float, 1e-6), "eps": (float, 1e-8)},
    ),
    "cclip": (CenteredClipping, {"tau": (float, 1.0), "iters": (int, 1)}),
}
STEPS: dict[str, dict[str, tuple[type, object]]] = {
    "nnm": {"f": (int, _REQUIRED)},
    "bucketing": {"s": (int, _REQUIRED), "seed": (int, 0)},
}


def _describe(params: dict[str, tuple[type, object]]) -> str:
    if not params:
        return ""
    parts = [f"{k}=<{t.__name__}>" if d is _REQUIRED else f"{k}={d:g}" if t is float else f"{k}={d}"
             for k, (t, d) in params.items()]
    return ":" + ",".join(parts)


def valid_specs() -> str:
    """One line per aggregator and step, for error messages and --help."""
    aggs = ", ".join(name + _describe(p) for name, (_, p) in AGGREGATORS.items())
    steps = ", ".join(name + _describe(p) for name, p in STEPS.items())
    return f"aggregators: {aggs}; steps (prefix with '+'): {steps}"


def _split_stage(stage: str, spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = stage.partition(":")
    name = name.strip().lower()
    values: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ValueError(f"bad parameter {item!r} in aggregator spec {spec!r}: write key=value. {valid_specs()}")
            values[key.strip().lower()] = value.strip()
    return name, values


def _bind(name: str, params: dict[str, tuple[type, object]], given: dict[str, str], spec: str,
          inherited: dict[str, object] | None = None) -> dict[str, object]:
    unknown = sorted(set(given) - set(params))
    if unknown:
        allowed = ", ".join(params) or "none"
        raise ValueError(f"{name} does not take {', '.join(unknown)} (in {spec!r}); its parameters: {allowed}")
    out: dict[str, object] = {}
    for key, (kind, default) in params.items():
        if key in given:
            try:
                out[key] = kind(given[key])
            except ValueError:
                raise ValueError(f"{name}: {key}={given[key]!r} is not a valid {kind.__name__} (in {spec!r})") from None
        elif inherited and key in inherited:
            out[key] = inherited[key]
        elif default is _REQUIRED:
            extra = " or follow it with an aggregator that has f (nnm+krum:f=2)" if key == "f" and name in STEPS else ""
            raise ValueError(f"{name} needs {key}=<{kind.__name__}> (in {spec!r}): write {name}{_describe(params)}{extra}")
        else:
            out[key] = default
    return out


def parse_aggregator(spec: str) -> BaseAggregator:
    """Build an aggregator (with its pre-aggregation steps) from a spec string; see module doc."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"aggregator spec must be a non-empty string, got {spec!r}. {valid_specs()}")
    stages = [_split_stage(s, spec) for s in spec.split("+")]
    *steps, (agg_name, agg_given) = stages
    if agg_name not in AGGREGATORS:
        hint = " (a step must come before an aggregator)" if agg_name in STEPS else ""
        raise ValueError(f"unknown aggregator {agg_name!r} in {spec!r}{hint}. {valid_specs()}")
    ctor, agg_params = AGGREGATORS[agg_name]
    agg_kwargs = _bind(agg_name, agg_params, agg_given, spec)
    result = ctor(**agg_kwargs)
    # Wrap from the innermost outward, so the leftmost step runs first on the inputs.
    for name, given in reversed(steps):
        if name not in STEPS:
            raise ValueError(f"unknown pre-aggregation step {name!r} in {spec!r}. {valid_specs()}")
        kw = _bind(name, STEPS[name], given, spec, inherited={"f": agg_kwargs["f"]} if "f" in agg_kwargs else None)
        if name == "nnm":
            result = NearestNeighborMixing(result, f=kw["f"])
        else:
            result = Bucketing(result, s=kw["s"], seed=kw["seed"])
    return result
