"""Per-strategy predictions from measured pieces: step time (compute + exposed communication), bytes per step and per
round inside and across islands, per-rank memory, and each figure's inputs and expected error.

Bytes use the comm ledger's own convention (islands.runtime.comm: bytes a rank *sent*) and the strategies' own
formulas: DDP's gradient all-reduce (every gradient byte once per step), ZeRO-1's parameter all-gather
(islands.sync.zero1.param_gather_bytes), FSDP's per-unit traffic (islands.sync.shard_plan.unit_traffic), and the outer
exchanges of the DiLoCo family (one fp32 all-reduce of the delta, a PayloadCodec's fixed payload, or a compressor's
islands.compress.average.analytic_nbytes), on the schedule the strategy itself follows (rounds.Schedule's offsets,
fragment_bounds, the final synchronisation at finish, the 8-byte start digest). They match a run's ledger exactly
(tests/unit/plan/test_bytes_ledger.py) except a variable-length codec (zstd), whose size depends on the values.

Time: compute is the profiled step (profile.py: the Trainer's own step on one worker); an outer strategy's local work
per round (its outer step, its compressor on the model's own vector: profile.round_seconds) is spread over its H
steps; each collective costs its link's alpha-beta (links.py); DDP's
gradient buckets overlap the backward pass except the last; ZeRO-1's gather and FSDP's collectives do not overlap;
a DiLoCo round blocks (its cost spread over H steps); streaming fragments overlap tau steps of compute. The
islands' workers share their island's link to the others: w workers per island each get 1/w of its rate.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from islands.compress.average import analytic_nbytes
from islands.plan.held import held_bytes
from islands.plan.links import Link
from islands.plan.profile import Profile
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.flat import fragment_bounds
from islands.sync.outer.rounds import overlap_steps
from islands.sync.zero1 import param_gather_bytes

INNER = ("ddp", "zero1", "fsdp")
INIT_DIGEST_BYTES = 8  # OuterStrategy.agree_start: one int64 digest all-gathered once per run
DDP_BUCKET_BYTES = 25_000_000  # islands.sync.ddp.DDP(bucket_mb=25.0), the default

# Expected error of each quantity, (median, worst) relative, measured by `islands bench planner-accuracy` (full tier,
# 2026-12-06 03:30-04:28 UTC on this 2-core CPU machine, load average 0.02-1.77): the byte LM and a transformers llama
# x 8 strategies x 3 tc-shaped testbed links (10, 100, 1000 Mbit/s), 2 workers, the link probed between the testbed's
# hosts; FSDP's 6 rows rerun after its reduce-scatter was timed as gloo runs it (results/planner-accuracy/full-fsdp).
# Step time 6.5%/25.4% over 48 configurations; bytes exact in 48 of 48; memory over the 10 outer configurations
# measured (and DDP and ZeRO-1 in tests/unit/plan/test_flat_memory.py). The quick tier on loopback under other jobs'
# load gave up to 39% (docs/plan.md): a shared machine's load moves runs more than profiles.
EXPECTED_ERROR = {
    "step_s": (0.065, 0.254),
    "bytes": (0.0, 0.0),
    "memory": (0.0, 0.0001),
}
# What planner-accuracy has checked (strategy family, link kind); anything else is flagged "never checked".
CHECKED = {
    *((f, "loopback") for f in ("ddp", "zero1", "diloco", "streaming-diloco")),
    *((f, "shaped link") for f in ("ddp", "zero1", "fsdp", "diloco", "streaming-diloco")),
}


@dataclass(frozen=True)
class Topology:
    workers: int
    islands: int

    @property
    def per_island(self) -> int:
        return self.workers // self.islands


@dataclass(frozen=True)
class Candidate:
    """One strategy to predict: an inner strategy over each island's workers (or over all workers when `outer` is
    None) and an optional outer strategy object across islands. `label`: how the user named it."""

    label: str
    inner: str
    outer: OuterStrategy | None = None
    fsdp_traffic: tuple[tuple[str, int, int], ...] = ()  # (kind, sent, received) per step, for inner fsdp
    fsdp_state: dict = field(default_factory=dict)  # state_bytes_per_rank for inner fsdp
    end_bytes: int = 0  # sent once at a run's end (fsdp: gathering the full model for its final evaluation)
    local_s: float | None = None  # a flat strategy's measured local work per step (plan.flat_step); None: unmeasured
    round_s: float = 0.0  # the outer strategy's measured local work per round (profile.round_seconds)
    gather_s: float = 0.0  # its exchange's extra local work per round for every island's payload (plan.gathered)

    @property
    def family(self) -> str:
        return self.outer.name if self.outer is not None else self.inner


@dataclass
class Memory:
    params: int
    grads: int
    optimizer: int
    strategy: int  # what the strategy keeps beside them (DDP's buckets, DiLoCo's global copy and model, error feedback)
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.strategy + self.activations


@dataclass
class Prediction:
    label: str
    compute_s: float
    strategy_s: float  # the outer strategy's own local work per step (outer step, compression), its rounds' over H
    inside_comm_s: float  # exposed, per step
    cross_comm_s: float  # exposed, per step
    inside_bytes_per_step: int  # per rank sent inside its island (or over the flat group)
    cross_bytes_per_round: int  # per rank sent across islands per full round (every fragment once)
    round_steps: int  # steps per round (1 for a flat strategy)
    cross_bytes_per_step: float
    memory: Memory
    fits: bool
    bytes_exact: bool
    inputs: dict[str, str]
    expected_error: dict[str, tuple[float, float]]
    checked: bool
    notes: list[str] = field(default_factory=list)
    _run_bytes: Callable[[int], int] | None = None  # steps -> per-rank sent over a whole run (see run_bytes)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.strategy_s + self.inside_comm_s + self.cross_comm_s

    @property
    def utilisation(self) -> float:
        return self.compute_s / self.step_s if self.step_s > 0 else 0.0

    def run_bytes(self, steps: int) -> int:
        """Bytes one rank sends over a run of `steps` steps, as its ledger counts them (all kinds)."""
        assert self._run_bytes is not None, "a Prediction made by predict() carries its byte schedule"
        return int(self._run_bytes(steps))

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "strategy_s": self.strategy_s,
            "inside_comm_s": self.inside_comm_s,
            "cross_comm_s": self.cross_comm_s,
            "utilisation": self.utilisation,
            "inside_bytes_per_step": self.inside_bytes_per_step,
            "cross_bytes_per_round": self.cross_bytes_per_round,
            "round_steps": self.round_steps,
            "cross_bytes_per_step": self.cross_bytes_per_step,
            "memory": {**vars(self.memory), "total": self.memory.total},
            "fits": self.fits,
            "bytes_exact": self.bytes_exact,
            "inputs": self.inputs,
            "expected_error": self.expected_error,
            "checked": self.checked,
            "notes": self.notes,
        }


@runtime_checkable
class SizedPayload(Protocol):
    """A payload codec that knows its payload's size for a vector (Quant4: fixed; Quant4Zstd: a bound)."""

    def payload_nbytes(self, numel: int) -> int: ...


# ---- the outer exchanges' bytes ------------------------------------------------------------------------------------
def exchange_bytes(outer: DiLoCo, numel: int) -> tuple[int, str]:
    """(bytes one rank sends, collective kind) for one exchange of a vector of `numel` fp32 values."""
    ex = outer.exchange
    if ex.codec is not None:
        if not isinstance(ex.codec, SizedPayload):
            raise ValueError(f"codec {type(ex.codec).__name__} does not say its payload size (payload_nbytes)")
        return ex.codec.payload_nbytes(numel) + (8 if ex.codec.variable_length else 0), "all_gather"
    if ex.compressor is not None:
        return analytic_nbytes({"x": torch.empty(numel)}, ex.compressor), "all_gather"
    if ex.aggregator is not None:
        return numel * 4, "all_gather"  # robust_all_reduce gathers every island's delta
    return numel * 4, "all_reduce"


def sends_by_fragment(outer: DiLoCo, steps: int) -> list[int]:
    """Scheduled sends of each fragment over `steps` steps (Schedule.starting), before the final synchronisation."""
    sched, h = outer.schedule, outer.inner_steps
    offsets = [(p + 1) * h // sched.fragments for p in range(sched.fragments)]
    return [0 if steps < o else (steps - o) // h + 1 for o in offsets]


def outer_run_bytes(outer: DiLoCo, numel: int, buffer_bytes: int, steps: int) -> int:
    """Bytes one rank sends across islands over a run: the start digest, every scheduled fragment exchange, the buffer
    averages at each full synchronisation, and the final synchronisation at finish (OuterStrategy.finish)."""
    sched = outer.schedule
    bounds = fragment_bounds(numel, sched.fragments)
    per = [exchange_bytes(outer, hi - lo)[0] for lo, hi in bounds]
    sends = sends_by_fragment(outer, steps)
    total = INIT_DIGEST_BYTES + sum(s * b for s, b in zip(sends, per))
    plain = sched.fragments == 1 and overlap_steps(sched) == 0
    if plain:
        synced = sends[0]  # every plain round is a full synchronisation (buffers averaged)
        last = sends[0] * outer.inner_steps
    else:
        synced = sends[-1]  # streaming: buffers once per cycle, when the last fragment starts
        last = 0  # never a full synchronisation before finish
    total += synced * buffer_bytes
    if steps > last or not plain:  # finish: land what is in flight, sync every fragment, then the buffers
        total += sum(per) + buffer_bytes
    return total


# ---- one candidate -------------------------------------------------------------------------------------------------
def _ddp_exposed(link: Link, n: int, grad_bytes: int, backward_s: float) -> float:
    t = link.seconds("all_reduce", n, grad_bytes)
    buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
    return max(t - backward_s * (1 - 1 / buckets), t / buckets)


def _inner(
    c: Candidate, prof: Profile, n: int, link: Link
) -> tuple[int, float, dict[str, int]]:  # bytes/step, seconds/step, memory
    """Bytes, exposed seconds per step (collectives plus the wait for the slowest of n workers at the step's
    synchronisation) and memory of the inner strategy over n workers on `link`."""
    b, t, mem = _inner_comm(c, prof, n, link)
    return b, (t + prof.straggler_s(n) if b else t), mem


def _local_words(c: Candidate) -> str:
    if c.outer is not None or c.inner == "single":
        return "none beyond the profiled step (an outer strategy's is its round's, below)"
    if c.local_s is None:
        return f"{c.inner}'s own work per step not measured (plan.flat_step measures it on the CPU only)"
    return (
        f"{c.inner}'s own work per step (hooks, copies, its optimizer step), measured between 2 processes here less "
        f"its predicted loopback collectives: {c.local_s * 1e3:.2f} ms"
    )


def exposed_seconds(c: Candidate, prof: Profile, n: int, link: Link) -> float:
    """What the cost model gives a flat candidate's step for its collectives and synchronisation over n workers."""
    return _inner(c, prof, n, link)[1]


def _inner_comm(c: Candidate, prof: Profile, n: int, link: Link) -> tuple[int, float, dict[str, int]]:
    g = prof.grad_bytes
    mem = {"params": prof.param_bytes, "grads": g, "optimizer": prof.optimizer_bytes}
    if n < 2 or c.inner == "single":
        return 0, 0.0, mem
    if c.inner in ("ddp", "zero1"):
        # torch DDP's reducer keeps its buckets: a flat copy of every gradient beside the parameters' .grad
        # (islands.sync.ddp.start_ddp leaves gradient_as_bucket_view off); ZeRO-1 exchanges through the same DDP
        mem["strategy"] = g
    if c.inner == "ddp":
        return g, _ddp_exposed(link, n, g, prof.backward_s), mem
    if c.inner == "zero1":
        sent, _ = param_gather_bytes(prof.param_numels, n)
        t = _ddp_exposed(link, n, g, prof.backward_s) + link.seconds("all_gather", n, sent)
        # the optimizer state of the largest partition (param_gather_bytes' figure is that partition in fp32)
        mem["optimizer"] = int(prof.optimizer_bytes * sent / max(prof.param_bytes, 1))
        return g + sent, t, mem
    if c.inner == "fsdp":
        sent = sum(s for _, s, _ in c.fsdp_traffic)
        t = sum(link.seconds(fsdp_kind(k), n, s) for k, s, _ in c.fsdp_traffic)
        if c.fsdp_state:
            mem = {k: int(c.fsdp_state[k]) for k in ("params", "grads", "optimizer")}
        return sent, t, mem
    raise ValueError(f"unknown inner strategy {c.inner!r}; one of {', '.join(INNER)}")


def fsdp_kind(kind: str) -> str:
    """The probe's collective whose cost one of FSDP's ledger kinds pays for its recorded bytes: its gathers an
    all-gather of the rank's shard; its reduce-scatter an all-reduce of the whole gradient, which is what gloo's
    reduce_scatter_tensor costs (probed between 2 testbed hosts at 100 Mbit/s: a 2 MB tensor reduce-scattered in
    176 ms, all-reduced in 178 ms) and what FSDP's ledger records (the whole tensor sent); the clip norm an
    all-reduce. Timed as a real reduce-scatter, FSDP's steps were predicted 35-56% long on the shaped links."""
    return "all_gather" if "gather" in kind else "all_reduce"


def _outer_memory(outer: DiLoCo, prof: Profile) -> int:
    p = prof.numel * 4
    extra = 2 * p  # global_flat (fp32) and the global model evaluation reads
    if outer.exchange.compressor is not None:
        extra += compressor_state_bytes(outer, prof.numel)
    return extra


def compressor_state_bytes(outer: DiLoCo, numel: int) -> int:
    """What the exchange's compressor keeps between rounds (error feedback's residual, its own buffers), measured:
    a copy of it compresses one vector of the model's size here and the tensors it then holds are counted."""
    part = outer.exchange.compressor
    key = (type(part).__name__, repr(vars(part)) if hasattr(part, "__dict__") else "", numel)
    if key not in _STATE_BYTES:  # once per candidate: the bandwidth sweep predicts it at every rate
        comp = copy.deepcopy(outer.exchange.compressor)
        assert comp is not None
        x = torch.zeros(numel)
        state = comp.state("plan", x)
        comp.compress(x.clone(), state)
        _STATE_BYTES[key] = held_bytes(comp, state, exclude=[x])
    return _STATE_BYTES[key]


_STATE_BYTES: dict[tuple, int] = {}


def predict(
    c: Candidate,
    prof: Profile,
    topo: Topology,
    inside: Link,
    cross: Link,
    budget_bytes: int = 0,
) -> Prediction:
    """The prediction for candidate `c` on `topo`, with `inside` the link between an island's workers and `cross` the
    link between islands."""
    notes: list[str] = []
    w = topo.per_island
    if c.outer is None:  # a flat strategy over every worker; across islands its ring runs over the cross link
        n, link = topo.workers, (cross if topo.islands > 1 else inside)
        per_step, t_in, mem = _inner(c, prof, n, link)
        extra, round_steps, bytes_exact, strategy_t = mem.get("strategy", 0), 1, True, c.local_s or 0.0
        if topo.islands > 1:  # every byte crosses the islands' link
            inside_t, inside_b, cross_t, cross_round = 0.0, 0, t_in, per_step
        else:
            inside_t, inside_b, cross_t, cross_round = t_in, per_step, 0.0, 0

        def run_bytes(steps: int) -> int:
            return steps * per_step + c.end_bytes

    else:
        if not isinstance(c.outer, DiLoCo):
            raise ValueError(f"outer strategy {c.outer.name!r} has no cost model yet (the DiLoCo family has)")
        outer = c.outer
        per_step, inside_t, mem = _inner(c, prof, w, inside)
        inside_b = per_step
        bounds = fragment_bounds(prof.numel, outer.schedule.fragments)
        h = outer.inner_steps
        tau = overlap_steps(outer.schedule)
        shared = Link(cross.rate_bps / w, cross.latency_s, cross.source + (f" shared by {w}" if w > 1 else ""))
        share = shared if not cross.fitted else cross
        frag_t = []
        for lo, hi in bounds:
            b, kind = exchange_bytes(outer, hi - lo)
            t = share.seconds(kind, topo.islands, b)
            frag_t.append(max(t - tau * prof.compute_s, 0.0))  # overlapped with tau steps of compute
        # every round's exchange waits for the slowest island's H steps
        cross_t = (sum(frag_t) + prof.straggler_s(topo.islands, h)) / h
        cross_round = sum(exchange_bytes(outer, hi - lo)[0] for lo, hi in bounds) + prof.buffer_bytes
        round_steps = h
        strategy_t = (c.round_s + c.gather_s) / h
        extra = mem.get("strategy", 0) + _outer_memory(outer, prof)
        bytes_exact = not (outer.exchange.codec is not None and outer.exchange.codec.variable_length)
        if not bytes_exact:
            notes.append("a variable-length codec's size depends on the values: its bytes are the payload bound")

        def run_bytes(steps: int) -> int:
            inner_b = steps * per_step
            return inner_b + outer_run_bytes(outer, prof.numel, prof.buffer_bytes, steps)

    memory = Memory(mem["params"], mem["grads"], mem["optimizer"], extra, prof.activation_peak_bytes)
    # the links this candidate's traffic uses: the cross link whenever there are several islands, the inside one
    # when an island (or the one flat group) has several workers
    used = ([cross] if topo.islands > 1 else []) + ([inside] if (w > 1 or topo.islands == 1) else [])
    link_kind = "loopback" if all("loopback" in x.source for x in used) else "shaped link"
    checked = (c.family, link_kind) in CHECKED
    if not checked:
        notes.append(f"{c.family} over a {link_kind} has never been checked against a measured run")
    inputs = {
        "compute": f"profiled step {prof.compute_s * 1e3:.2f} ms (mean) at batch {prof.batch_size} on {prof.device} "
        f"(+-{prof.spread * 100:.0f}% over {prof.steps} steps{', cached' if prof.cached else ''})",
        "inside link": inside.describe(),
        "cross link": cross.describe(),
        "memory": "parameters, gradients, optimizer state counted after a profiled step (islands.memory); "
        "activations: the profiled saved-for-backward peak",
        "bytes": "the ledger's formulas (islands.plan.costs)",
        "strategy's local work": _local_words(c),
        "outer round": (
            f"its local work timed on this model (outer step, compression of the real vector): "
            f"{c.round_s * 1e3:.2f} ms per round over {round_steps} steps, and combining {topo.islands} "
            f"islands' payloads rather than one: {c.gather_s * 1e3:.2f} ms more"
            if c.outer is not None
            else "none (a flat strategy)"
        ),
        "synchronisation wait": f"E(slowest of n) - mean over the profiled steps: {prof.straggler_s(2) * 1e3:.2f} ms "
        "at n=2",
    }
    return Prediction(
        label=c.label,
        compute_s=prof.compute_s,
        strategy_s=strategy_t,
        inside_comm_s=inside_t,
        cross_comm_s=cross_t,
        inside_bytes_per_step=inside_b,
        cross_bytes_per_round=cross_round,
        round_steps=round_steps,
        cross_bytes_per_step=cross_round / round_steps,
        memory=memory,
        fits=budget_bytes <= 0 or memory.total <= budget_bytes,
        bytes_exact=bytes_exact,
        inputs=inputs,
        expected_error=dict(EXPECTED_ERROR),
        checked=checked,
        notes=notes,
        _run_bytes=run_bytes,
    )
