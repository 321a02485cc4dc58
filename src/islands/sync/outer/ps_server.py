"""The parameter server's state and numerics (issue #36), in one process, deterministic: what every transport
(in-process, gloo point-to-point) feeds in arrival order.

    state = ServerState(initial_flat, rule=lambda: DelayedNesterov(0.7, 0.9, buffer=2), shards=2,
                        max_staleness=4, quorum=1)
    ack = state.push(Contribution(island=1, version=v, delta=global_at_pull - local, samples=800))
    version, flat = state.pull()

The global model is one fp32 vector split by parameter ranges into `shards` slices (fragment_bounds), each with its
own outer optimizer state (`rule()` builds one per shard, so a shard could move to another host without changing
the arithmetic); the version counts the outer steps taken. A contribution carries the version its round started
from; its staleness is the versions taken since. Staleness rules:
  * staleness > max_staleness (or a version the server never issued): refused, nothing changes; the island pulls
    the current model and starts over from it (its round's work is lost: goodput counts it);
  * otherwise it joins the window. When the window holds contributions from `quorum` distinct islands (1: every
    push steps at once, fully asynchronous; more: Decoupled-DiLoCo-style semi-synchrony, arXiv 2604.21428), the
    window is merged and one outer step runs on every shard, version += 1. The quorum never exceeds the islands
    still training (`settle`): one that finished or left is not waited for.
`scale` (StaleCap): every step's lr is further multiplied by scale(the accepted pushes per staleness so far), so the
delayed step stays within its stability limit; one factor for every push, so no island's data counts less.
`per_push`: the rule's lr is each push's (ps' default plain SGD, DiLoCo's step spread over the pushes), so a window
of k pushes steps k times its merged mean: the k pushes applied as if none were stale. With quorum = M equal islands
that is DiLoCo's own step (lr sqrt(M) on the mean, M = 2). Off: the window's mean steps once at the rule's lr (the
Nesterov rules: one momentum update per window, as DiLoCo's outer step).
Merging (no aggregator): weighted by samples (token-weighted merging, 2604.21428), each weight times
(1 + staleness)^-discount; merged = sum(w_i delta_i) / sum(w_i), summed in arrival order, and the step's lr is
scaled by sum(w_i) / sum(samples_i) (1 when discount = 0), so a stale window moves the model less. With a robust
aggregator (islands.aggregate) the window's deltas go through it unweighted instead (it ranks the deltas).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from islands.aggregate.base import Aggregator
from islands.sync.outer.exchange import Stateful
from islands.sync.outer.flat import fragment_bounds
from islands.sync.outer.outer_opt import OuterOptimizer
from islands.sync.outer.ps_wait import WindowWait


@dataclass(frozen=True)
class Contribution:
    """One island's push: its pseudo-gradient (global at its pull minus its local model now, flat fp32), the server
    version it pulled, and the samples (or tokens) its round trained on."""

    island: int
    version: int
    delta: torch.Tensor
    samples: float = 1.0


@dataclass(frozen=True)
class Ack:
    """The server's answer to a push: accepted or refused, the version now, the push's staleness, and whether it
    completed a window (an outer step ran)."""

    accepted: bool
    version: int
    staleness: int
    stepped: bool = False


# StaleCap's margin: the share of the delayed step's stability limit a push may use, the 2-island default's (lr
# 1/sqrt(2) per push, 1 version stale, whose limit is 1.0); session 30, docs/parameter-server.md
STALE_CAP_MARGIN = 2**-0.5
# Pushes between two computations of StaleCap's factor, once the first CAP_EVERY pushes each had one: its bisection
# costs ~1.5 ms at staleness 8, ~50 ms at 64, ~0.6 s at 128 (np.roots; this host), and the histogram's shares move
# slowly once it holds a few rounds of every island
CAP_EVERY = 32


class StaleCap:
    """The server's lr factor from the staleness its pushes have had (ServerState(scale=...)): the step `lr` is held to
    at most STALE_CAP_MARGIN x the stability limit of the delayed step, min(1, cap / lr), one factor for every push.

    Why: with quorum 1 the plain SGD step is delayed feedback. If every push is s versions stale (M equal-speed
    islands: s = M - 1) and a round's delta goes a share c of the way to its optimum, the model follows
    x[k+1] = x[k] - lr c x[k-s], which is stable only while lr c < 2 sin(pi / (2 (2 s + 1))): 1.0 at s = 1, 0.618
    at s = 2, 0.445 at s = 3 (scripts/ps_delay_stability.py). lr 1/sqrt(M) sits at 71% of it for 2 islands, 93%
    for 3 and past it from 4, and the evaluated model swings (results/parameter-server/churn-s30). Pushes of mixed
    staleness (uneven islands) are steadier than one delay: the limit here is that of the mean step over the
    staleness seen so far, x[k+1] = x[k] - lr c sum_s p(s) x[k-s] (p: the accepted pushes' share at staleness s),
    found by bisection on its characteristic roots. The cap keeps the step at the 2-island default's 71% of that
    limit: one version stale, lr 1/sqrt(M) stays (M >= 2); all 2 stale, 0.437; all 3 stale, 0.315. One factor for
    all pushes, not one per push: capping only the stale ones (a slow island's) weighs that island's data less
    (measured: island 2 of setting (b), 4x slower and ~6 versions stale, then reached DDP's loss only with the final
    answer). Plain SGD only (momentum moves the limit)."""

    def __init__(self, lr: float):
        if not lr > 0:
            raise ValueError(f"StaleCap needs the server step's lr > 0, got {lr}")
        self.lr = float(lr)

    @staticmethod
    def limit(staleness: int) -> float:
        """The largest stable lr x c of a step whose pushes are all `staleness` versions old (closed form)."""
        return 2.0 * math.sin(math.pi / (2 * (2 * max(int(staleness), 0) + 1)))

    @staticmethod
    def limit_of(histogram: Sequence[int]) -> float:
        """The largest stable lr x c of the mean step over pushes whose staleness is s in histogram[s] of them: the
        largest a with every root of z^(S+1) - z^S + a sum_s p(s) z^(S-s) inside the unit circle (S the largest
        staleness seen). 2.0 (no delay's limit) before any push."""
        total = sum(histogram)
        if total == 0:
            return 2.0
        top = max(i for i, n in enumerate(histogram) if n)
        share = np.array([n / total for n in histogram[: top + 1]], dtype=np.float64)

        def stable(a: float) -> bool:
            poly = np.concatenate(([1.0, -1.0], np.zeros(top)))
            poly[1:] += a * share
            return bool(np.abs(np.roots(poly)).max() < 1.0)

        lo, hi = 0.0, 2.0  # stable at lo; the no-delay step's limit 2 bounds every delayed one
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if stable(mid) else (lo, mid)
        return lo

    def __call__(self, histogram: Sequence[int]) -> float:
        return min(1.0, STALE_CAP_MARGIN * self.limit_of(histogram) / self.lr)


def check_server_options(
    shards: int, max_staleness: int, quorum: int, discount: float, wait: WindowWait | None = None
) -> None:
    """ValueError naming the option out of range (the strategy checks at construction, before any worker). `wait`:
    the window's rule as ps_wait.window_wait made it (which checked its own values)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an int >= 1 (parameter ranges), got {shards!r}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0 (versions), got {max_staleness!r}")
    if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1:
        raise ValueError(f"quorum must be an int >= 1 (distinct islands per outer step), got {quorum!r}")
    if not discount >= 0:
        raise ValueError(f"discount must be >= 0 (weight times (1 + staleness)^-discount), got {discount}")
    if wait is not None and quorum < 2:
        raise ValueError(
            f"wait ({wait!r}) holds a push until its window has the quorum's islands, which needs quorum >= 2 "
            "(quorum=1 steps at every push); set quorum= or drop wait="
        )


class ServerState:
    """The global model, the outer optimizer state per shard, the version, the open window, and counts (module
    docstring). One object applies pushes one at a time; its caller orders them (ServerLoop)."""

    def __init__(
        self,
        initial: torch.Tensor,
        rule: Callable[[], OuterOptimizer],
        shards: int = 1,
        max_staleness: int = 4,
        quorum: int = 1,
        discount: float = 0.0,
        aggregator: Aggregator | None = None,
        scale: Callable[[Sequence[int]], float] | None = None,
        per_push: bool = False,
    ):
        flat = initial.detach().to(torch.float32).flatten()
        check_server_options(shards, max_staleness, quorum, discount)
        if shards > max(1, flat.numel()):
            raise ValueError(f"shards must be at most the parameter count {flat.numel()}, got {shards}")
        self.bounds = fragment_bounds(flat.numel(), shards)
        self.params = [flat[lo:hi].clone() for lo, hi in self.bounds]
        self.rules = [rule() for _ in self.bounds]
        self.max_staleness, self.quorum, self.discount = max_staleness, quorum, float(discount)
        self.aggregator = aggregator
        self.scale = scale  # the staleness histogram -> every step's lr factor (StaleCap)
        self.per_push = per_push  # a window of k pushes steps k x its mean (module docstring)
        self.stale_hist = [0] * (max_staleness + 1)  # accepted pushes per staleness: StaleCap's p(s)
        self.cap = {"at": -1, "factor": 1.0}  # the scale's last factor and the accepted pushes it was computed at
        self.version = 0
        self.window: list[tuple[Contribution, int]] = []  # (contribution, its staleness at arrival)
        self.counts = {"pushes": 0, "refused": 0, "steps": 0, "samples": 0.0, "samples_refused": 0.0}
        self.window_bytes_peak = 0  # the open window's deltas at their largest (the server report's memory)

    @property
    def numel(self) -> int:
        return self.bounds[-1][1]

    def staleness(self, version: int) -> int:
        return self.version - int(version)

    def push(self, c: Contribution, active: int | None = None) -> Ack:
        """Apply one contribution by the rules (module docstring). `active`: the islands still training, when the
        caller knows (the quorum shrinks to it: an island that left is not waited for)."""
        if c.delta.numel() != self.numel:
            raise ValueError(f"a push of {c.delta.numel()} values to a server of {self.numel}")
        if not c.samples > 0:
            raise ValueError(f"a push's samples must be > 0, got {c.samples}")
        s = self.staleness(c.version)
        self.counts["pushes"] += 1
        if s < 0 or s > self.max_staleness:
            self.counts["refused"] += 1
            self.counts["samples_refused"] += float(c.samples)
            return Ack(False, self.version, s)
        self.counts["samples"] += float(c.samples)
        self.stale_hist[s] += 1
        self.window.append((c, s))
        held = sum(d.delta.numel() * d.delta.element_size() for d, _ in self.window)
        self.window_bytes_peak = max(self.window_bytes_peak, held)
        stepped = self.settle(self.quorum if active is None else active)
        return Ack(True, self.version, s, stepped=stepped)

    def ready(self, active: int) -> bool:
        """Whether the open window holds contributions of min(quorum, active) distinct islands (at least one)."""
        needed = max(1, min(self.quorum, active))
        return bool(self.window) and len({c.island for c, _ in self.window}) >= needed

    def settle(self, active: int) -> bool:
        """Step the open window if it is ready: after a push, and when an island leaves (the loop calls it with
        the islands still training; with none left, whatever the window holds is applied, so no accepted
        contribution is lost at the end)."""
        if not self.ready(active):
            return False
        self._step(self.window)
        self.window = []
        return True

    @torch.no_grad()
    def _step(self, window: Sequence[tuple[Contribution, int]]) -> None:
        if self.aggregator is not None:
            merged = self.aggregator.aggregate([c.delta.to(torch.float32) for c, _ in window]).to(torch.float32)
            factor = 1.0
        else:
            weights = [float(c.samples) * (1.0 + s) ** -self.discount for c, s in window]
            merged = torch.zeros(self.numel, dtype=torch.float32)
            for (c, _), w in zip(window, weights):  # arrival order: the same sum wherever it runs
                merged.add_(c.delta.to(torch.float32), alpha=w)
            merged.div_(sum(weights))
            factor = sum(weights) / sum(float(c.samples) for c, _ in window)
        if self.per_push:
            factor *= len(window)
        if self.scale is not None:
            factor *= self.cap_factor(self.scale)
        for (lo, hi), params, rule in zip(self.bounds, self.params, self.rules):
            rule.step(params, merged[lo:hi], 0, hi - lo, lr_scale=factor)
        self.version += 1
        self.counts["steps"] += 1

    def cap_factor(self, scale: Callable[[Sequence[int]], float]) -> float:
        """scale(the staleness histogram), computed at each of the first CAP_EVERY accepted pushes, then every
        CAP_EVERY of them (its cost grows with the largest staleness); in between, its last value. A function of the
        state alone, so a rebuilt shard replays it."""
        n = sum(self.stale_hist)
        if self.cap["at"] < 0 or n <= CAP_EVERY or n - self.cap["at"] >= CAP_EVERY:
            self.cap = {"at": n, "factor": float(scale(self.stale_hist))}
        return float(self.cap["factor"])

    def pull(self) -> tuple[int, torch.Tensor]:
        """The version and a copy of the global model (every shard, in order)."""
        return self.version, torch.cat(self.params)

    def goodput(self) -> float:
        """The share of pushed samples that reached the model (accepted; refused ones were computed for nothing)."""
        total = self.counts["samples"] + self.counts["samples_refused"]
        return self.counts["samples"] / total if total else 1.0

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of the state's tensors: the global model, the outer optimizer state now (allocated at the first step
        and never freed, so now is its largest) and the open window at its largest; `total` is their sum, what the
        server holds at the window's peak (the copies a pull answers with come and go and are not counted)."""
        model = sum(p.numel() * p.element_size() for p in self.params)
        optimizer = sum(_tensor_bytes(rule.state_dict()) for rule in self.rules)
        return {
            "model": model,
            "optimizer": optimizer,
            "window_peak": self.window_bytes_peak,
            "total": model + optimizer + self.window_bytes_peak,
        }

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": self.version,
            "bounds": [list(b) for b in self.bounds],
            "params": [p.clone() for p in self.params],
            "rules": [r.state_dict() for r in self.rules],
            "window": [
                {"island": c.island, "version": c.version, "delta": c.delta.clone(), "samples": c.samples, "s": s}
                for c, s in self.window
            ],
            "counts": dict(self.counts),
            "stale_hist": list(self.stale_hist),
            "cap": dict(self.cap),
            **({"aggregator": self.aggregator.state_dict()} if isinstance(self.aggregator, Stateful) else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        bounds = [tuple(int(x) for x in b) for b in state["bounds"]]
        if bounds != self.bounds:
            raise ValueError(
                f"parameter server checkpoint has shards {bounds}, this server {self.bounds}: another model or "
                "another shards= setting"
            )
        self.version = int(state["version"])
        self.params = [p.to(torch.float32).clone() for p in state["params"]]
        for rule, saved in zip(self.rules, state["rules"]):
            rule.load_state_dict(saved)
        self.window = [
            (Contribution(int(w["island"]), int(w["version"]), w["delta"].clone(), float(w["samples"])), int(w["s"]))
            for w in state["window"]
        ]
        self.counts = dict(state["counts"])
        self.stale_hist = [int(n) for n in state.get("stale_hist", [0] * (self.max_staleness + 1))]  # session 30
        self.cap = dict(state.get("cap", {"at": -1, "factor": 1.0}))
        if "aggregator" in state and isinstance(self.aggregator, Stateful):
            self.aggregator.load_state_dict(state["aggregator"])


def _tensor_bytes(tree) -> int:
    """Bytes of every tensor in a state_dict-like tree of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0
