"""Outer strategy specs: `name:key=value,key=value`, checked before any worker starts.

Every strategy declares its parameters (default, type, meaning) in PARAMS; parse_outer resolves a
spec string into an OuterSpec holding every parameter (given or default) and which ones were given.
The values of `compress=` and `aggregate=` are specs of their own packages and may contain ':' and
',' themselves (`compress=topk:ratio=0.01,seed=3`): a comma-separated piece whose key is not a
parameter of the strategy continues the previous compress/aggregate value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Shared parameter blocks ---------------------------------------------------------------------------
_EXCHANGE = {
    "compress": ("none", str, "compressor spec for the exchanged deltas (islands.compress)"),
    "aggregate": ("mean", str, "aggregator spec across islands (islands.aggregate), e.g. median"),
}
_AGGREGATE_ONLY = {"aggregate": _EXCHANGE["aggregate"]}
# LIT-212 starts DiLoCo from a model pretrained with ordinary data parallelism (warm_start.py).
_WARM = {
    "warm_start": (0, int, "steps of ordinary data parallelism across islands (gradients averaged every step) "
                           "before the first round, as LIT-212 starts from a pretrained model; 0 = none"),
}
# DiLoCo's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9 (LIT-212).
_OUTER_OPT = {
    "outer": ("nesterov", str, "outer optimizer: nesterov | sgd (heavy-ball, or plain with momentum=0) | primal"),
    "outer_lr": (0.7, float, "outer learning rate (LIT-212: 0.7)"),
    "momentum": (0.9, float, "outer momentum (LIT-212: 0.9); not used by outer=primal"),
    "weight": (0.5, float, "outer=primal only: weight c of the new outer iterate in the primal average (LIT-276)"),
    "lr_scale": ("none", str, "none | sqrt-islands: multiply outer_lr by sqrt(M), M = islands in the exchange "
                              "(undoes the 1/sqrt(M) shrink of per-island Adam on 1/M of the batch; "
                              "docs/outer-strategies.md)"),
    "outer_schedule": ("constant", str, "constant | inner: multiply the outer lr by the inner optimizer's current lr "
                                        "over its lr when the strategy was built (decays with the inner cosine)"),
}

PARAMS: dict[str, dict[str, tuple]] = {
    "local-sgd": {
        "every": (8, int, "local steps between parameter averages (H)"),
        **_AGGREGATE_ONLY,
    },
    "post-local-sgd": {
        "every": (16, int, "H after the switch; SOTA-216 suggests 16 to 32"),
        "switch": (-1, int, "step at which averaging every step ends; -1 = warmup, where the LR first decays"),
        **_AGGREGATE_ONLY,
    },
    "overlap-local-sgd": {
        "tau": (2, int, "local steps per round, run while the previous average is in flight; 0 = blocking, every step"),
        "pull": (0.5, float, "strength of the pull toward the anchor after each round, in (0, 1]"),
        **_AGGREGATE_ONLY,
    },
    "slowmo": {
        "every": (8, int, "local steps between outer steps (H)"),
        "slow_lr": (1.0, float, "outer (slow) learning rate"),
        "momentum": (0.5, float, "slow momentum over the averaged iterates (heavy ball)"),
        **_EXCHANGE,
    },
    "easgd": {
        "every": (4, int, "local steps between elastic updates"),
        "beta": (0.9, float, "total elastic strength; each worker's pull is beta / islands (LIT-370)"),
        **_AGGREGATE_ONLY,
    },
    "diloco": {
        "inner_steps": (100, int, "inner optimizer steps per round (H)"),
        **_OUTER_OPT,
        "sync_inner_state": (0, int, "1 = also average the inner Adam moments each round (SOTA-219 experiment only)"),
        **_WARM,
        **_EXCHANGE,
    },
    "streaming-diloco": {
        "inner_steps": (100, int, "inner steps between two syncs of the same fragment (H)"),
        "fragments": (4, int, "F: parameter fragments, synced in turn every H/F steps"),
        "tau": (1, int, "inner steps each fragment's exchange overlaps with; 0 = blocking"),
        "merge": (0.5, float, "landing=mix: weight kept of the local fragment when the new global one arrives (tau > 0)"),
        "landing": ("mix", str, "mix (LIT-214: merge*local + (1-merge)*global) | replay (global + the tau steps since the send)"),
        "bits": (4, int, "bits per exchanged delta value: 4 (block-scaled) or 32 (plain fp32)"),
        "block": (1024, int, "values per 4-bit quantisation block (one fp32 scale each)"),
        "entropy": ("none", str, "none | zstd: lossless zstd over the 4-bit codes (bits=4 only; zstd4.py)"),
        **_OUTER_OPT,
        **_WARM,
        **_EXCHANGE,
    },
    "gossip": {
        "every": (4, int, "local steps between gossip rounds (H)"),
        "topology": ("exp", str, "exp (one peer at distance 2^k, k rotating; SOTA-226) | ring | "
                                 "random:s=S (S fresh out-peers per round, push-sum; SOTA-223)"),
        "seed": (0, int, "seed of topology=random's per-round draws (the same on every rank)"),
        **_AGGREGATE_ONLY,
    },
}

_OUTER_CHOICES = ("nesterov", "sgd", "primal")
LR_SCALES = ("none", "sqrt-islands")
OUTER_SCHEDULES = ("constant", "inner")


@dataclass(frozen=True)
class OuterSpec:
    name: str
    params: dict = field(default_factory=dict)
    given: frozenset = frozenset()

    def __getitem__(self, key: str):
        return self.params[key]


def valid_specs() -> str:
    lines = ["valid outer strategies (name:key=value,...):"]
    for name, params in PARAMS.items():
        keys = ", ".join(f"{k}={d}" for k, (d, _, _) in params.items())
        lines.append(f"  {name}: {keys}")
    return "\n".join(lines)


def _convert(name: str, key: str, text: str, typ: type):
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"outer strategy {name!r}: {key} must be {typ.__name__}, got {text!r}") from None


def _pieces(name: str, body: str, params: dict) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for piece in body.split(","):
        key = piece.split("=", 1)[0].strip()
        if "=" in piece and key in params:
            out.append((key, piece.split("=", 1)[1].strip()))
        elif out and out[-1][0] in _EXCHANGE:
            out[-1] = (out[-1][0], out[-1][1] + "," + piece)  # a nested compress/aggregate spec
        else:
            raise ValueError(f"outer strategy {name!r}: bad parameter {piece!r}; "
                             f"valid: {', '.join(params)}\n{valid_specs()}")
    return out


def parse_outer(spec: str) -> OuterSpec:
    """Resolve a spec string into every parameter of its strategy; ValueError names what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"outer spec must be a non-empty string, got {spec!r}\n{valid_specs()}")
    name, _, body = spec.strip().partition(":")
    name = name.strip()
    if name not in PARAMS:
        raise ValueError(f"unknown outer strategy {name!r}\n{valid_specs()}")
    params = PARAMS[name]
    values = {k: d for k, (d, _, _) in params.items()}
    given = set()
    for key, text in (_pieces(name, body, params) if body.strip() else []):
        if key in given:
            raise ValueError(f"outer strategy {name!r}: {key} given twice in {spec!r}")
        values[key] = _convert(name, key, text, params[key][1])
        given.add(key)
    out = OuterSpec(name, values, frozenset(given))
    _check(out)
    return out


def _check(s: OuterSpec) -> None:
    p, name = s.params, s.name

    def bad(msg: str):
        raise ValueError(f"outer strategy {name!r}: {msg}")

    for key in ("every", "inner_steps", "fragments", "block"):
        if key in p and p[key] < 1:
            bad(f"{key} must be >= 1, got {p[key]}")
    if "warm_start" in p and p["warm_start"] < 0:
        bad(f"warm_start must be >= 0 steps (0 = no warm start), got {p['warm_start']}")
    if "tau" in p and p["tau"] < 0:
        bad(f"tau must be >= 0, got {p['tau']}")
    if "switch" in p and p["switch"] < -1:
        bad(f"switch must be >= 0 (or -1 for the warmup step), got {p['switch']}")
    for key in ("pull", "weight"):
        if key in p and not 0 < p[key] <= 1:
            bad(f"{key} must be in (0, 1], got {p[key]}")
    for key in ("merge", "momentum"):
        if key in p and not 0 <= p[key] < 1:
            bad(f"{key} must be in [0, 1), got {p[key]}")
    for key in ("outer_lr", "slow_lr", "beta"):
        if key in p and p[key] <= 0:
            bad(f"{key} must be > 0, got {p[key]}")
    if "beta" in p and p["beta"] > 1:
        bad(f"beta must be <= 1 (each worker moves at most all the way to the centre), got {p['beta']}")
    if "outer" in p:
        if p["outer"] not in _OUTER_CHOICES:
            bad(f"outer must be one of {', '.join(_OUTER_CHOICES)}, got {p['outer']!r}")
        if p["outer"] == "primal" and "momentum" in s.given:
            bad("outer=primal smooths by its weight, not momentum; drop momentum= or use outer=nesterov")
        if p["outer"] != "primal" and "weight" in s.given:
            bad("weight= applies to outer=primal only")
    if "lr_scale" in p and p["lr_scale"] not in LR_SCALES:
        bad(f"lr_scale must be one of {', '.join(LR_SCALES)}, got {p['lr_scale']!r}")
    if "outer_schedule" in p and p["outer_schedule"] not in OUTER_SCHEDULES:
        bad(f"outer_schedule must be one of {', '.join(OUTER_SCHEDULES)}, got {p['outer_schedule']!r}")
    if p.get("sync_inner_state") not in (None, 0, 1):
        bad(f"sync_inner_state must be 0 or 1, got {p['sync_inner_state']}")
    if "bits" in p and p["bits"] not in (4, 32):
        bad(f"bits must be 4 or 32, got {p['bits']}")
    if name == "streaming-diloco":
        if p["fragments"] > p["inner_steps"]:
            bad(f"fragments ({p['fragments']}) must be <= inner_steps ({p['inner_steps']}): one start per step at most")
        if p["tau"] >= p["inner_steps"]:
            bad(f"tau ({p['tau']}) must be < inner_steps ({p['inner_steps']}) so a fragment lands before its next send")
        if p["landing"] not in ("mix", "replay"):
            bad(f"landing must be mix or replay, got {p['landing']!r}")
        if p["entropy"] not in ("none", "zstd"):
            bad(f"entropy must be none or zstd, got {p['entropy']!r}")
        if p["entropy"] == "zstd" and p["bits"] != 4:
            bad("entropy=zstd codes the 4-bit deltas; it needs bits=4")
        if p["bits"] == 4 and p["compress"] != "none":
            bad("bits=4 is the built-in quantiser; to use compress= set bits=32")
    if "topology" in p:
        from islands.sync.outer.topology import parse_topology

        try:
            parse_topology(p["topology"])
        except ValueError as e:
            bad(str(e))
    if p.get("compress", "none") != "none" and p.get("aggregate", "mean") != "mean":
        bad("compress= and aggregate= together are not supported: a robust aggregator needs each island's "
            "uncompressed delta; pick one")
    _check_nested(s)


def _check_nested(s: OuterSpec) -> None:
    """Parse nested specs now, so a typo fails before any worker starts."""
    compress, aggregate = s.params.get("compress", "none"), s.params.get("aggregate", "mean")
    if compress != "none":
        try:
            from islands.compress import parse_compressor
        except ImportError as e:
            raise ValueError(f"outer strategy {s.name!r}: compress={compress!r} needs islands.compress ({e})") from None
        parse_compressor(compress)
    if aggregate != "mean":
        from islands.aggregate import parse_aggregator

        parse_aggregator(aggregate)
