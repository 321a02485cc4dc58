"""Outer strategy specs: `name:key=value,...` (islands.spec), checked before any worker starts.

The names and their parameters are STRATEGIES (islands.sync.outer.registry), read from the constructors.
Nested specs go in parentheses (`diloco:compressor=(randomk:ratio=0.01,seed=3)`); the older unparenthesised form
still reads, a piece whose key is not a parameter of the strategy continuing the nested spec.
`parse_outer` resolves a spec into an OuterSpec holding every parameter (given or default) and which ones were
given, after building it once: a constructor's own checks fail here, not in the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from islands.spec import Spec, SpecError, format as format_spec
from islands.sync.outer.registry import STRATEGIES

# The caller supplies post-local-sgd's switch when it builds (make_outer: the end of the lr warm-up, SOTA-216).
SUPPLIED = ("switch",)


@dataclass(frozen=True)
class OuterSpec:
    """A checked outer spec: `spec` the canonical value; `params` every parameter, given or default (nested specs
    as their text, a parameter the caller supplies as None); `given` the keys the spec gave."""

    name: str
    params: dict = field(default_factory=dict)
    given: frozenset = frozenset()
    spec: Spec | None = None

    def __getitem__(self, key: str):
        if key not in self.params:
            key = STRATEGIES.aliases.get(key, key)  # s["aggregate"] is s["aggregator"]
        return self.params[key]


def _schema_table() -> dict[str, dict[str, tuple]]:
    return {
        name: {p.name: (None if p.required else p.default, p.type, p.help) for p in STRATEGIES.schema(name)}
        for name in STRATEGIES
    }


PARAMS: dict[str, dict[str, tuple]] = _schema_table()  # name -> {param: (default, type, help)}, for reports


def valid_specs() -> str:
    return STRATEGIES.describe()


# Checks across parameters that no constructor can make (they need to know what the spec gave), and ranges the
# outer optimizers do not check themselves. (values: every parameter; given: the keys the spec gave)
_RULES: list[tuple[Callable[[dict, frozenset], bool], str]] = [
    # (None: the strategy's own default, which may depend on the world: ps's lr 1/sqrt(M))
    (
        lambda v, g: v.get("momentum") is not None and not 0 <= v["momentum"] < 1,
        "momentum must be in [0, 1), got {momentum}",
    ),
    (lambda v, g: v.get("outer_lr") is not None and not v["outer_lr"] > 0, "outer_lr must be > 0, got {outer_lr}"),
    (lambda v, g: "slow_lr" in v and not v["slow_lr"] > 0, "slow_lr must be > 0, got {slow_lr}"),
    (
        lambda v, g: v.get("outer") == "primal" and "momentum" in g,
        "outer=primal smooths by its weight, not momentum; drop momentum= or use outer=nesterov",
    ),
    (lambda v, g: "weight" in g and v.get("outer") != "primal", "weight= applies to outer=primal only"),
    (
        lambda v, g: v.get("overlap", "none") != "none" and bool(g & {"tau", "merge", "landing"}),
        "overlap={overlap} lands each exchange a whole round later; tau, merge and landing are overlap=none's partial "
        "delay, drop them",
    ),
]


def _checked(spec: str | Spec | OuterSpec) -> Spec:
    if isinstance(spec, OuterSpec):
        if spec.spec is None:
            raise TypeError("an OuterSpec to build comes from parse_outer (it carries the checked spec)")
        return spec.spec
    if isinstance(spec, str) and not spec.strip():
        raise SpecError(f"outer spec must be a non-empty string such as 'diloco:inner_steps=100'\n{valid_specs()}")
    checked = STRATEGIES.check(spec, supplied=SUPPLIED)
    if checked.name == "post-local-sgd" and checked.get("switch") == -1:  # the older "switch=-1: at warm-up's end"
        checked = Spec(checked.name, [(k, v) for k, v in checked.args if k != "switch"])
    return checked


def _values(checked: Spec) -> dict[str, Any]:
    values = {}
    for p in STRATEGIES.schema(checked.name):
        given = checked.get(p.name, p.default if not p.required else None)
        values[p.name] = format_spec(given) if isinstance(given, Spec) else given
    return values


def check_outer(spec: str | Spec | OuterSpec) -> Spec:
    """The canonical spec, checked against the schema and the rules across parameters (nothing built)."""
    checked = _checked(spec)
    values, given = _values(checked), frozenset(k for k, _ in checked.args)
    for broken, message in _RULES:
        if broken(values, given):
            raise SpecError(f"outer strategy {checked.name!r}: " + message.format(**values))
    return checked


def parse_outer(spec: str | Spec) -> OuterSpec:
    """Resolve a spec into every parameter of its strategy; SpecError (a ValueError) names what is wrong."""
    checked = check_outer(spec)
    STRATEGIES.build(checked, switch=0)  # built once and dropped: the constructors' own checks, before any worker
    return OuterSpec(checked.name, _values(checked), frozenset(k for k, _ in checked.args), checked)
