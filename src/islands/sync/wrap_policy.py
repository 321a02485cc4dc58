"""Wrap policies: which modules become one FSDP unit (one all-gather, one reduce-scatter per pass).

A policy returns groups of modules; each group is sharded as one unit with `fully_shard(group)`, and the
root module is sharded last, so it holds every parameter no group claimed. Unit counts below include
the root unit.

    model        one unit: the whole model (the root alone)
    block        each parameterised element of an nn.ModuleList / nn.Sequential (transformer blocks,
                 MLP layers), plus the root: the usual per-block wrapping (LIT-083)
    params:N     size threshold, bottom-up: a module whose not-yet-claimed parameters number >= N
                 becomes a unit (the classic size-based auto-wrap rule)
    split:K      K units that balance parameter bytes over modules in registration order; knows
                 nothing of execution order or activations (the parameter-count baseline for Q-3)
    graph:K      K units over the modules in the order a forward pass runs them, balancing parameter
                 bytes and, among near-balanced splits, cutting where the activation is smallest (Q-3)

How `graph:K` chooses (our method, documented in docs/sharding.md): one forward pass on a one-sample
example records, through forward hooks, the order in which parameter-owning modules first run and the
bytes of each one's output. Cuts go between consecutive modules in that order. First the smallest
achievable largest-unit size B* is found (dynamic programme over contiguous splits); then, among splits
whose every unit stays within (1 + slack) * B*, the one with the smallest summed activation bytes at the
cuts wins. The first segment joins the root (it runs first, with the root's own parameters such as a
position table). The output of the module before a cut is a lower bound on what crosses the cut (a
residual stream may cross too); a pipeline stage boundary would send it, an FSDP unit boundary does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from islands.spec import Registry, Spec

GRAPH_SLACK = 0.10  # tolerated growth of the largest unit in exchange for cheaper cuts (our choice)


def _own_param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))


def _leaves(model: nn.Module) -> list[nn.Module]:
    """Modules that own parameters directly, excluding the root, in registration order."""
    return [m for m in model.modules() if m is not model and _own_param_bytes(m) > 0]


def example_input(model: nn.Module, batch: int = 1) -> torch.Tensor:
    """A zero input of the right shape for our reference models (byte transformer or MLP)."""
    device = next(model.parameters()).device
    if hasattr(model, "context"):
        # the ignore: nn.Module.__getattr__ is typed Tensor | Module; `context` is a plain int attribute
        return torch.zeros(batch, int(model.context), dtype=torch.long, device=device)  # type: ignore[arg-type]
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise TypeError(
            f"graph wrapping needs an example input for {type(model).__name__}; pass GraphWrap(units, example=tensor)"
        )
    return torch.zeros(batch, first.in_features, device=device)


def trace_order(model: nn.Module, example: torch.Tensor) -> list[tuple[nn.Module, int, int]]:
    """(module, own parameter bytes, output bytes) for each parameter-owning module, in first-run order."""
    seen: dict[int, tuple[nn.Module, int, int]] = {}
    order: list[int] = []

    def hook(module, inputs, output):
        if id(module) not in seen and isinstance(output, torch.Tensor):
            seen[id(module)] = (module, _own_param_bytes(module), output.numel() * output.element_size())
            order.append(id(module))

    handles = [m.register_forward_hook(hook) for m in _leaves(model)]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in order]


def _min_bottleneck(weights: list[int], k: int) -> int:
    """Smallest possible largest segment when splitting `weights` into k contiguous non-empty segments."""
    n, prefix = len(weights), [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first i items in j segments
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            best[j][i] = min(max(best[j - 1][s], prefix[i] - prefix[s]) for s in range(j - 1, i))
    return int(best[k][n])


def split_cheapest_cuts(weights: list[int], cut_costs: list[int], k: int, cap: float) -> list[int]:
    """Start indices of k contiguous segments, each weighing <= cap, minimising the summed cost of the cuts.

    cut_costs[i] is the cost of cutting between item i and item i + 1.
    """
    n, prefix = len(weights), [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[-1] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                if cost[j - 1][s] == inf or prefix[i] - prefix[s] > cap:
                    continue
                c = cost[j - 1][s] + (cut_costs[s - 1] if s > 0 else 0)
                if c < cost[j][i]:
                    cost[j][i], back[j][i] = c, s
    if cost[k][n] == inf:
        raise ValueError(f"no split of {n} modules into {k} units stays under {cap:.0f} bytes")
    starts, i = [], n
    for j in range(k, 0, -1):
        i = back[j][i]
        starts.append(i)
    return starts[::-1]


def _segments(items: list, starts: list[int]) -> list[list]:
    ends = starts[1:] + [len(items)]
    return [items[a:b] for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class ModelWrap:
    """One unit: the whole model (the root alone)."""

    spec = "model"

    def groups(self, model: nn.Module) -> list[list[nn.Module]]:
        return []


@dataclass(frozen=True)
class BlockWrap:
    """Each parameterised element of an nn.ModuleList / nn.Sequential, plus the root (LIT-083)."""

    spec = "block"

    def groups(self, model: nn.Module) -> list[list[nn.Module]]:
        out = []
        for m in model.modules():
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                out += [[child] for child in m if any(True for _ in child.parameters())]
        return out


def _positive(policy: str, name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"wrap {policy}: {name} must be a positive integer, e.g. {policy}:4; got {value!r}")


@dataclass(frozen=True)
class ParamThreshold:
    """Size threshold, bottom-up: a module whose not-yet-claimed parameters number >= `min_params` becomes a unit."""

    min_params: int

    def __post_init__(self) -> None:
        _positive("params", "min_params", self.min_params)

    @property
    def spec(self) -> str:
        return f"params:{self.min_params}"

    def groups(self, model: nn.Module) -> list[list[nn.Module]]:
        claimed: set[int] = set()
        out = []

        def visit(m: nn.Module) -> int:  # post-order: returns this subtree's unclaimed parameter count
            free = sum(visit(c) for c in m.children())
            free += sum(p.numel() for p in m.parameters(recurse=False) if id(p) not in claimed)
            if m is not model and free >= self.min_params:
                out.append([m])
                claimed.update(id(p) for p in m.parameters())
                return 0
            return free

        visit(model)
        return out


@dataclass(frozen=True)
class SplitByParams:
    """Balanced split: the modules, in registration order, cut into `units` pieces of about equal parameter bytes."""

    units: int

    def __post_init__(self) -> None:
        _positive("split", "units", self.units)

    @property
    def spec(self) -> str:
        return f"split:{self.units}"

    def groups(self, model: nn.Module) -> list[list[nn.Module]]:
        mods = _leaves(model)
        weights = [_own_param_bytes(m) for m in mods]
        weights[0] += _own_param_bytes(model)  # the root's own parameters ride with the first segment
        _check_units(self.units, len(mods))
        cap = _min_bottleneck(weights, self.units)
        # zero cut costs: any split meeting the optimum bottleneck; the DP keeps the first it finds
        starts = split_cheapest_cuts(weights, [0] * len(mods), self.units, cap)
        return _segments(mods, starts)[1:]


@dataclass(frozen=True)
class GraphWrap:
    """Graph split: the modules, in the order a forward pass runs them, cut into `units` pieces of balanced parameter
    bytes where the activation is smallest; `slack`: tolerated growth of the largest unit for cheaper cuts."""

    units: int
    slack: float = GRAPH_SLACK
    example: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _positive("graph", "units", self.units)

    @property
    def spec(self) -> str:
        return f"graph:{self.units}"

    def plan(self, model: nn.Module) -> dict:
        """The traced order, the chosen cuts and what they cost; groups() uses it, reports print it."""
        trace = trace_order(model, self.example if self.example is not None else example_input(model))
        _check_units(self.units, len(trace))
        mods = [m for m, _, _ in trace]
        weights = [w for _, w, _ in trace]
        traced = {id(m) for m in mods}
        # the root's own parameters and modules the forward never ran stay in the root unit
        weights[0] += _own_param_bytes(model) + sum(_own_param_bytes(m) for m in _leaves(model) if id(m) not in traced)
        acts = [a for _, _, a in trace]
        cap = _min_bottleneck(weights, self.units) * (1 + self.slack)
        starts = split_cheapest_cuts(weights, acts, self.units, cap)
        return {
            "modules": mods,
            "starts": starts,
            "param_bytes": weights,
            "activation_bytes": acts,
            "cut_activation_bytes": [acts[s - 1] for s in starts[1:]],
        }

    def groups(self, model: nn.Module) -> list[list[nn.Module]]:
        p = self.plan(model)
        return _segments(p["modules"], p["starts"])[1:]


def _check_units(units: int, modules: int) -> None:
    if not 1 <= units <= modules:
        raise ValueError(f"cannot make {units} units from {modules} parameter-owning modules; choose 1..{modules}")


WrapPolicy = ModelWrap | BlockWrap | ParamThreshold | SplitByParams | GraphWrap
WRAP_POLICIES = Registry(
    "wrap policy",
    {"model": ModelWrap, "block": BlockWrap, "params": ParamThreshold, "split": SplitByParams, "graph": GraphWrap},
    base=(ModelWrap, BlockWrap, ParamThreshold, SplitByParams, GraphWrap),
)


def parse_wrap(spec: str | Spec) -> WrapPolicy:
    """'model', 'block', 'params:N' (N parameters), 'split:K' or 'graph:K' (K units including the root)."""
    return WRAP_POLICIES.build(spec)
