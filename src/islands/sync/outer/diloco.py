"""DiLoCo (SOTA-155, LIT-212): H inner AdamW steps per island, then one outer step on the average delta.

A round, on every island:
    delta   = global - local            (where this round started, minus where the island got to)
    mean    = mean of delta over islands (one all-reduce, ledger kind "outer_delta")
    global  = outer_step(global, mean)   (plain SGD, lr sqrt(2), no momentum by default; fp32)
    local   = global                     (the next round starts from the new global model)
The inner optimizer state (Adam moments) stays on its island (SOTA-219); sync_inner_state=1 also
averages the moments, one more all-reduce of 2x the parameter bytes (kind "outer_inner_state"),
only for the experiment that measures what that buys.

The same engine runs the streaming form (streaming_diloco.py): the parameters split into F
fragments, fragment p starting its exchange at steps (p+1)*H/F + k*H, the exchange landing tau
steps later while inner steps continue, and the landed global fragment merged into the local one.
Plain DiLoCo is the case F = 1, tau = 0, fp32 payloads. overlap=delayed|eager (eager.py) delays each exchange by
a whole round instead: it runs during all H inner steps of the next round and lands with a staleness correction.
adapt=speed|deadline (adaptive.py) lets islands of different speeds take different numbers of inner steps per round
(speed-adaptive H, or a wall-clock deadline) and weighs their deltas by the samples behind them.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from islands.aggregate.base import Aggregator
from islands.aggregate.coordinate import Mean
from islands.compress.base import Compressor
from islands.sync.outer.adaptive import ADAPTS, AdaptiveRounds
from islands.sync.outer.base import SHARDED_OUTER, OuterStrategy
from islands.sync.outer.eager import OVERLAPS, EagerOverlap
from islands.sync.outer.exchange import Exchange, Pending
from islands.sync.outer.flat import FlatView, fragment_bounds
from islands.sync.outer.outer_opt import (DEFAULT_OUTER, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, OuterOptimizer,
                                          build_outer_optimizer)
from islands.sync.outer.quant4 import Quant4

_MOMENTS = ("exp_avg", "exp_avg_sq")


class DiLoCo(AdaptiveRounds, EagerOverlap, OuterStrategy):
    name = "diloco"

    def __init__(self, inner_steps: int = 100, outer: str | OuterOptimizer = DEFAULT_OUTER,
                 outer_lr: float = DEFAULT_OUTER_LR, momentum: float = DEFAULT_OUTER_MOMENTUM, weight: float = 0.5,
                 sync_inner_state: bool = False,
                 compressor: Compressor | None = None, aggregator: Aggregator | None = None,
                 fragments: int = 1, tau: int = 0, merge: float = 0.5, codec: Quant4 | None = None,
                 lr_scale: str = "none", landing: str = "mix", outer_schedule: str = "constant",
                 overlap: str = "none", adapt: str = "none", deadline: float = 0.0):
        """`inner_steps` H: inner optimizer steps per round. `outer`: the outer optimizer, nesterov | sgd (heavy
        ball, or plain with momentum=0) | primal, or an object with step(params, delta, lo, hi, lr_scale)
        (islands.outer.OuterSGD, PrimalAveraging); `outer_lr` (default sqrt(2), the best measured; LIT-212: 0.7),
        `momentum` (default 0; LIT-212: 0.9 with outer=nesterov) and
        `weight` (primal's weight of the new iterate, LIT-276) configure the named ones. `sync_inner_state`:
        also average the inner Adam moments each round (SOTA-219 experiment only). `compressor`: compresses the
        exchanged deltas (error feedback per island, islands.compress); `aggregator`: a robust aggregator across
        islands (islands.robust). `fragments`, `tau`, `merge`, `landing`, `codec`: the streaming form
        (streaming_diloco.py). `lr_scale`: none | sqrt-islands (outer_lr times sqrt(M), M islands in the
        exchange). `outer_schedule`: constant | inner (the outer lr follows the inner optimizer's lr). `overlap`: none |
        delayed | eager: each exchange runs during all H inner steps of the next round (per fragment) and lands
        one round late, as is (delayed) or after an eager stand-in step on the island's own delta (eager.py);
        it replaces tau (tau, merge and landing apply to overlap=none). `adapt`: none | speed | deadline: islands of
        different speeds take different inner steps per round and their deltas are weighted by samples (adaptive.py;
        speed: the fastest island takes H steps, the others in proportion to their measured speed; deadline: each
        island steps until a wall-clock budget per round runs out); `deadline`: adapt=deadline's budget in seconds
        (0: the fastest island's measured time for H steps)."""
        super().__init__()
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)}; got {overlap!r}")
        if overlap != "none" and sync_inner_state:
            raise ValueError("sync_inner_state needs overlap=none (plain DiLoCo)")
        self.overlap = overlap
        if adapt not in ADAPTS:
            raise ValueError(f"adapt must be one of {', '.join(ADAPTS)}; got {adapt!r}")
        if not (deadline >= 0 and math.isfinite(deadline)):
            raise ValueError(f"deadline must be >= 0 seconds (0: the fastest island's time for H steps); got {deadline}")
        if deadline > 0 and adapt != "deadline":
            raise ValueError(f"deadline={deadline} applies to adapt=deadline only; got adapt={adapt!r}")
        if adapt != "none":
            clash = [f"{k}={v}" for k, v, plain in (("fragments", fragments, 1), ("tau", tau, 0),
                                                    ("sync_inner_state", bool(sync_inner_state), False)) if v != plain]
            if clash:
                raise ValueError(f"adapt={adapt} runs whole-model DiLoCo rounds (fragments=1, tau=0, "
                                 f"sync_inner_state=0; overlap=eager|delayed is fine); drop {', '.join(clash)}")
            if aggregator is not None and not isinstance(aggregator, Mean):
                raise ValueError(f"adapt={adapt} weighs each island's delta by its samples; a robust aggregator has no "
                                 "such weights: drop aggregator= or use adapt=none")
        self.adapt, self.deadline = adapt, float(deadline)
        if overlap != "none":
            tau = 0  # the exchange lands a whole round later instead
        if outer_schedule not in ("constant", "inner"):
            raise ValueError(f"outer_schedule must be 'constant' or 'inner', got {outer_schedule!r}")
        if landing not in ("mix", "replay"):
            raise ValueError(f"landing must be 'mix' or 'replay', got {landing!r}")
        if lr_scale not in ("none", "sqrt-islands"):
            raise ValueError(f"lr_scale must be 'none' or 'sqrt-islands', got {lr_scale!r}")
        if inner_steps < 1 or fragments < 1 or fragments > inner_steps:
            raise ValueError(f"need 1 <= fragments <= inner_steps; got fragments={fragments}, inner_steps={inner_steps}")
        if not 0 <= tau < inner_steps:
            raise ValueError(f"tau must be in [0, inner_steps); got tau={tau}, inner_steps={inner_steps}")
        if sync_inner_state and (fragments > 1 or tau > 0):
            raise ValueError("sync_inner_state needs fragments=1 and tau=0 (plain DiLoCo)")
        if not 0 <= merge < 1:
            raise ValueError(f"merge must be in [0, 1), got {merge}")
        self.inner_steps, self.fragments, self.tau, self.merge = int(inner_steps), int(fragments), int(tau), float(merge)
        self.sync_inner_state = bool(sync_inner_state)
        self.lr_scale, self.landing, self.outer_schedule = lr_scale, landing, outer_schedule
        self.at_send: dict[int, torch.Tensor] = {}  # landing=replay: the local fragment when its delta left
        self.opt = outer if not isinstance(outer, str) else build_outer_optimizer(outer, outer_lr, momentum, weight)
        self.exchange = Exchange("outer_delta", aggregator=aggregator, compressor=compressor, codec=codec)
        self.state_exchange = Exchange("outer_inner_state", aggregator=copy.deepcopy(aggregator)) if sync_inner_state else None
        # fragment p's first send is at step count (p+1)*H//F, then every H steps (staggered, LIT-214)
        self.offsets = [(p + 1) * self.inner_steps // self.fragments for p in range(self.fragments)]
        self.pending: list[tuple[int, int, Pending]] = []  # (fragment, step count it lands at, exchange)
        self.sends = [0] * self.fragments  # completed sends per fragment, for tests and reports
        self.report_dir: str | None = None  # where rank 0 writes outer_exchanges.json at the end (the app sets it)

    def setup(self) -> None:
        self.bounds = fragment_bounds(self.global_flat.numel(), self.fragments)
        # outer_schedule=inner: the trainer builds the optimizer at its peak lr and only then schedules
        # it, so the lr seen here is the reference the inner schedule is measured against.
        self.base_lr = float(self.optimizer.param_groups[0]["lr"])
        if getattr(self.comm, "elastic", False) and self.lr_scale == "sqrt-islands" and self.fragments > 1:
            # a fragment lands on the training thread while another's exchange may be failing over on the
            # exchange thread: the member count read at the landing would differ between members
            raise ValueError("lr_scale=sqrt-islands with fragments > 1 is not supported in an elastic job (the "
                             "island count can change while a fragment is in flight); use lr_scale=none or fragments=1")
        self._overlap_setup()
        if self.adapt != "none":
            self._adapt_setup(self._world)

    def sharded_refusal(self) -> str | None:
        """Plain rounds run per shard unchanged (the mean of shards is the shard of the mean; an elementwise or
        per-vector compressor acts on each worker's shard vector). Fragments, delayed landings and adaptive rounds
        are untested on shards, and a robust aggregator would rank each shard's deltas on their own: refused."""
        if self.name != "diloco":
            return super().sharded_refusal()
        given = [f"{k}={v}" for k, v, plain in (
            ("fragments", self.fragments, 1), ("tau", self.tau, 0), ("overlap", self.overlap, "none"),
            ("adapt", self.adapt, "none"), ("sync_inner_state", int(self.sync_inner_state), 0),
            ("aggregator", type(self.exchange.aggregator).__name__ if self.exchange.aggregator else None, None))
            if v != plain]
        if given:
            return (f"diloco with {', '.join(given)} is not wired for sharded parameters yet; with inner fsdp use "
                    f"{SHARDED_OUTER}")
        return None

    def starting(self, done: int) -> list[int]:
        """Fragments whose exchange starts after `done` steps (the schedule, without the final flush)."""
        return [p for p, o in enumerate(self.offsets) if done >= o and (done - o) % self.inner_steps == 0]

    def wrap(self, model, optimizer, world):
        self._world = world  # setup reads the island's group for adapt (base wrap calls setup)
        return super().wrap(model, optimizer, world)

    def on_batch(self, batch, step):
        if self.adapt != "none":
            self._adapt_on_batch(batch)
        return batch

    def after_step(self, model, optimizer, step):
        done = self.tick(step)
        if self.adapt != "none":
            self._adapt_after_step(done)
            return
        if self.overlap != "none":
            self._overlap_after_step(done)
            return
        for entry in list(self.pending):
            p, lands, pending = entry
            if lands <= done:
                self.pending.remove(entry)
                self._land(p, pending.wait(), adopt=False)
        starting = self.starting(done)
        for p in starting:
            self._send(p, blocking=self.tau == 0)
        if starting and self.fragments == 1 and self.tau == 0:
            self.synced()  # a blocking round of the whole model: every island's work is in
        elif starting and starting[-1] == self.fragments - 1:
            self.synced_buffers()  # streaming: buffers once per cycle (parameters never all at once)

    def _send(self, p: int, blocking: bool) -> None:
        lo, hi = self.bounds[p]
        delta = self.global_flat[lo:hi] - self.local.read(lo, hi)
        self.sends[p] += 1
        if blocking:
            self._land(p, self.exchange.mean(self.comm, delta, name=f"fragment{p}"), adopt=True)
            return
        if self.landing == "replay":
            self.at_send[p] = self.local.read(lo, hi)
        self.pending.append((p, self.clock + self.tau, self.exchange.start(self.comm, delta, name=f"fragment{p}")))

    def has_pending(self) -> bool:
        return bool(self.pending) or self.round_inflight is not None

    def joined(self) -> None:
        """Elastic joiner (base.joined): local <- global; landing=replay measures its own steps from here."""
        super().joined()
        for p in list(self.at_send):
            lo, hi = self.bounds[p]
            self.at_send[p] = self.local.read(lo, hi)

    def finish(self, model) -> None:
        super().finish(model)
        self._write_report()  # also when the last step ended a round (then finish runs no final_sync)

    def in_order(self, fn):
        return self.exchange.run(fn)  # behind the fragments in flight, on the exchange's own thread

    def final_sync(self) -> None:
        """Land what is in flight, then sync every fragment, blocking: the global model holds all work."""
        if self.adapt != "none":  # this island's partial round, weighted like every other
            if self.overlap == "none":
                self._adapt_exchange()
            else:
                self._adapt_final()
            return
        skip = set()
        if self.overlap != "none":
            self._overlap_final()
            skip = set(self.starting(self.clock))  # a boundary was the last step: no work since, nothing to send
        for p, _, pending in self.pending:
            self._land(p, pending.wait(), adopt=False)
        self.pending = []
        for p in range(self.fragments):
            if p not in skip:
                self._send(p, blocking=True)

    def _write_report(self) -> None:
        """Bytes this rank sent per exchange, for the peak-per-sync figure (the ledger keeps only totals)."""
        if not self.report_dir or self.comm.rank != 0:
            return
        sent = self.exchange.sent
        path = Path(self.report_dir) / "outer_exchanges.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"strategy": self.name, "fragments": self.fragments, "exchanges": len(sent),
                                    "peak_sent_bytes": max(sent, default=0), "sent_per_exchange": sent,
                                    **({"adapt": self.adapt, "steps_per_round": self.history, "last_rates": self.rates}
                                       if self.adapt != "none" else {})}))

    def _land(self, p: int, mean_delta: torch.Tensor, adopt: bool) -> None:
        lo, hi = self.bounds[p]
        self.opt.step(self.global_flat, mean_delta, lo, hi, lr_scale=self.outer_lr_factor())
        self.publish(lo, hi)
        if adopt:
            self.adopt_global(lo, hi)
        elif self.landing == "replay":  # new global + exactly the tau steps taken since the delta left
            x = self.local.read(lo, hi).sub_(self.at_send.pop(p)).add_(self.global_flat[lo:hi])
            self.local.write(x, lo)
        else:  # the island kept training for tau steps: keep part of that work (LIT-214's merge)
            x = self.local.read(lo, hi).mul_(self.merge).add_(self.global_flat[lo:hi], alpha=1 - self.merge)
            self.local.write(x, lo)
        self.rounds += 1
        if self.sync_inner_state:
            self._average_moments()

    def outer_lr_factor(self) -> float:
        """sqrt(M) under lr_scale=sqrt-islands, M read from the Comm at each step (elastic-safe); else 1;
        times inner lr now / inner lr at build under outer_schedule=inner.

        Why sqrt(M): each of M islands runs Adam on 1/M of the global batch. Where gradient noise
        dominates a coordinate, Adam's second moment grows ~M-fold, so the signal in each island's
        step shrinks ~1/sqrt(M) against DDP's Adam on the full batch, while the islands' independent
        noise shrinks 1/sqrt(M) in the average. Scaling the averaged delta by sqrt(M) restores both
        to DDP's size (our derivation; measured in docs/outer-strategies.md).
        """
        factor = float(self.comm.size) ** 0.5 if self.lr_scale == "sqrt-islands" else 1.0
        if self.outer_schedule == "inner":  # follow the inner warm-up + cosine
            factor *= float(self.optimizer.param_groups[0]["lr"]) / self.base_lr
        return factor

    def _average_moments(self) -> None:
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                st = self.optimizer.state.get(param, {})
                if not all(k in st for k in _MOMENTS):
                    raise ValueError("sync_inner_state needs an Adam-style inner optimizer with exp_avg and "
                                     f"exp_avg_sq state; found state keys {sorted(st)}")
                tensors += [st[k] for k in _MOMENTS]
        view = FlatView(tensors)
        view.write(self.state_exchange.mean(self.comm, view.read(), name="inner_state"))

    # ---- state ------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        # Exchanges in flight were started on every rank: wait for them here and keep their results (first: an
        # exchange in flight still updates the compressor's error feedback saved below).
        adapt = self._adapt_state() if self.adapt != "none" else {}
        inflight = [(p, lands, pending.wait().clone()) for p, lands, pending in self.pending]
        self.pending = [(p, lands, Pending(value=v)) for p, lands, v in inflight]
        return {"outer_opt": self.opt.state_dict(), "inflight": inflight, "sends": list(self.sends),
                "exchange": self.exchange.state_dict(), "at_send": {p: v.clone() for p, v in self.at_send.items()},
                **self._overlap_state(), **adapt}

    def load_extra_state(self, state: dict) -> None:
        self.opt.load_state_dict(state["outer_opt"])
        self.pending = [(int(p), int(lands), Pending(value=v.to(torch.float32).clone()))
                        for p, lands, v in state.get("inflight", [])]
        self.sends = list(state.get("sends", [0] * self.fragments))
        self.exchange.load_state_dict(state.get("exchange", {}))
        self.at_send = {int(p): v.to(torch.float32).clone() for p, v in state.get("at_send", {}).items()}
        self._load_overlap_state(state)
        if self.adapt != "none":
            self._load_adapt_state(state)
