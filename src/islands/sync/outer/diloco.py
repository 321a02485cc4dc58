"""DiLoCo (SOTA-155, LIT-212): H inner AdamW steps per island, then one outer step on the average delta.

A round, on every island:
    delta   = global - local            (where this round started, minus where the island got to)
    mean    = mean of delta over islands (one all-reduce, ledger kind "outer_delta")
    global  = outer_step(global, mean)   (plain SGD, lr sqrt(2), no momentum by default; fp32)
    local   = global                     (the next round starts from the new global model)
The inner optimizer state (Adam moments) stays on its island (SOTA-219); sync_inner_state=1 also
averages the moments, one more all-reduce of 2x the parameter bytes (kind "outer_inner_state"),
only for the experiment that measures what that buys.

DiLoCo is built from parts, each with its own state:

    DiLoCo(inner_steps=50,
           outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True),
           exchange=Exchange(compressor=TopKQ(...)),        # or aggregator=Median(); compressor=Quant4(1024)
           schedule=Fragments(fragments=4, tau=1))          # or Rounds(), Overlapped("eager"), Adaptive("speed")

  outer_optimizer  any torch.optim optimizer factory (the pseudo-gradient form: the global parameters' .grad is the
                   mean delta, then optimizer.step()), islands' own OuterSGD / PrimalAveraging, or an OuterStep
                   around either with its lr factors (sqrt_islands, follow_inner_lr) (outer_opt.py). Default: plain
                   SGD, lr sqrt(2), no momentum.
  exchange         how a delta crosses the islands: the plain mean, a compressor (islands.compress, or a 4-bit
                   PayloadCodec: Quant4, Quant4Zstd) or a robust aggregator (exchange.py)
  schedule         when each fragment's exchange starts and how it lands: Rounds (plain, default), Fragments
                   (streaming: F fragments, tau steps of overlap; rounds.py), Overlapped (delayed|eager: one round
                   late; eager.py), Adaptive (speed|deadline: islands of different speeds; adaptive.py)
  sync_inner_state also average the inner Adam moments each round (plain rounds only)

The spec strings' keyword options of before (outer=, outer_lr=, overlap=, adapt=, ...) build the same parts through
`DiLoCo.from_options(**options)` (options.py), which the registry uses; calling DiLoCo(...) itself with them still
works and warns (DeprecationWarning).
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from islands.sync.outer.base import SHARDED_OUTER, STATISTICS, OuterStrategy
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.flat import FlatView
from islands.sync.outer.options import diloco_parts
from islands.sync.outer.outer_opt import OptimizerFactory, OuterOptimizer, OuterStep
from islands.sync.outer.rounds import Rounds, Schedule

_MOMENTS = ("exp_avg", "exp_avg_sq")


class DiLoCo(OuterStrategy):
    name = "diloco"
    # the keyword options of before -> this constructor's arguments (options.py); each subclass has its own
    # options (StreamingDiLoCo: streaming_parts), so typed by what they share
    parts: Callable[..., dict] = staticmethod(diloco_parts)

    def __init__(
        self,
        inner_steps: int = 100,
        outer_optimizer: OuterStep | OuterOptimizer | OptimizerFactory | None = None,
        exchange: Exchange | None = None,
        schedule: Schedule | None = None,
        sync_inner_state: bool = False,
        statistics: str = "mean",
        **options,
    ):
        """`inner_steps` H: inner optimizer steps per round (per fragment cycle). `outer_optimizer`: a torch.optim
        factory (params -> optimizer), OuterSGD / PrimalAveraging, or an OuterStep around either (its lr factors);
        default plain SGD, lr sqrt(2). `exchange`: an Exchange (compressor, aggregator); default the plain mean.
        `schedule`: Rounds() (default), Fragments, Overlapped or Adaptive. `sync_inner_state`: also average the
        inner Adam moments each round (SOTA-219 experiment only; plain rounds only). `statistics`: mean (every sync
        averages the buffers, BatchNorm's running statistics, over the islands) or own (each island keeps its own
        through the end; the job keeps island 0's: islands whose inputs differ). `options`: the keyword
        options of before (outer=, outer_lr=, overlap=, ...): deprecated here, use DiLoCo.from_options."""
        super().__init__()
        if options:
            warnings.warn(
                f"{type(self).__name__}({', '.join(sorted(options))}=...) is the keyword form of before "
                f"the parts; use {type(self).__name__}.from_options(...) or the parts (outer_optimizer=, "
                "exchange=, schedule=): docs/outer-strategies.md",
                DeprecationWarning,
                stacklevel=2,
            )
            if outer_optimizer is not None or exchange is not None or schedule is not None:
                raise TypeError(
                    "give either the parts (outer_optimizer=, exchange=, schedule=) or the keyword "
                    f"options of before ({', '.join(sorted(options))}), not both"
                )
            inner_state: dict[str, Any] = {"sync_inner_state": True} if sync_inner_state else {}
            parts = self.parts(inner_steps=inner_steps, statistics=statistics, **options, **inner_state)
            inner_steps, outer_optimizer, exchange, schedule, sync_inner_state = (
                parts["inner_steps"],
                parts["outer_optimizer"],
                parts["exchange"],
                parts["schedule"],
                parts["sync_inner_state"],
            )
        if statistics not in STATISTICS:
            raise ValueError(f"statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
        self.statistics = statistics
        if statistics == "own":  # the syncs leave each island's buffers as they are (base.synced_buffers)
            self.buffer_policy = "own"
        schedule, exchange = self.default_parts(schedule, exchange)
        self.inner_steps = int(inner_steps)
        self.outer = outer_optimizer if isinstance(outer_optimizer, OuterStep) else OuterStep(outer_optimizer)
        self.exchange = exchange if exchange is not None else Exchange("outer_delta")
        if not isinstance(self.exchange, Exchange) or not isinstance(schedule, Schedule):
            raise TypeError(
                f"exchange must be an Exchange and schedule a Schedule (Rounds, Fragments, Overlapped, "
                f"Adaptive); got {type(self.exchange).__name__}, {type(schedule).__name__}"
            )
        schedule.check(self.inner_steps)
        why = schedule.refusal(self.exchange, sync_inner_state)
        if why:
            raise ValueError(why)
        self.schedule = schedule
        # sync_inner_state: the inner moments' own exchange (the deltas' aggregator, a copy)
        self.inner_state = (
            Exchange("outer_inner_state", aggregator=copy.deepcopy(self.exchange.aggregator))
            if sync_inner_state
            else None
        )
        self.report_dir: str | None = None  # where rank 0 writes outer_exchanges.json at the end (the app sets it)

    @classmethod
    def from_options(cls, **options) -> DiLoCo:
        """The keyword options of before the parts (the spec strings' keys: outer, outer_lr, momentum, weight,
        sync_inner_state, compressor, aggregator, fragments, tau, merge, codec, lr_scale, landing, outer_schedule,
        overlap, adapt, deadline; streaming: bits, block, entropy), checked as before, built into the parts."""
        return cls(**cls.parts(**options))

    def default_parts(self, schedule: Schedule | None, exchange: Exchange | None) -> tuple[Schedule, Exchange | None]:
        """The parts not given: plain rounds and (exchange None) the plain mean; StreamingDiLoCo: its fragments and
        4-bit deltas."""
        return (schedule if schedule is not None else Rounds()), exchange

    @property
    def sync_inner_state(self) -> bool:
        return self.inner_state is not None

    def setup(self) -> None:
        self.schedule.bind(self, self._world)
        self.outer.bind(self.schedule.bounds, self.optimizer)

    def elastic_refusal(self) -> str | None:
        if self.outer.sqrt_islands and self.schedule.fragments > 1:
            # a fragment lands on the training thread while another's exchange may be failing over on the
            # exchange thread: the member count read at the landing would differ between members
            return (
                "lr_scale=sqrt-islands with fragments > 1 is not supported in an elastic job (the island count "
                "can change while a fragment is in flight); use lr_scale=none or fragments=1"
            )
        return self.schedule.elastic_refusal()

    def sharded_refusal(self) -> str | None:
        """Plain rounds run per shard unchanged (the mean of shards is the shard of the mean; an elementwise or
        per-vector compressor acts on each worker's shard vector). Fragments, delayed landings and adaptive rounds
        are untested on shards, and a robust aggregator would rank each shard's deltas on their own: refused."""
        if self.name != "diloco":
            return super().sharded_refusal()
        given = [
            f"{k}={v}"
            for k, v in self.schedule.options().items()
            if v != {"fragments": 1, "tau": 0, "overlap": "none", "adapt": "none"}[k]
        ]
        given += [
            f"{k}={v}"
            for k, v, plain in (
                ("sync_inner_state", int(self.sync_inner_state), 0),
                ("aggregator", type(self.exchange.aggregator).__name__ if self.exchange.aggregator else None, None),
            )
            if v != plain
        ]
        if given:
            return (
                f"diloco with {', '.join(given)} is not wired for sharded parameters yet; with inner fsdp use "
                f"{SHARDED_OUTER}"
            )
        return None

    def wrap(self, model, optimizer, world):
        self._world = world  # setup binds the schedule to it (adaptive rounds read the island's group)
        return super().wrap(model, optimizer, world)

    def on_batch(self, batch, step):
        self.schedule.on_batch(batch)
        return batch

    def after_step(self, model, optimizer, step):
        self.schedule.after_step(self.tick(step))

    def next_step(self, done: int) -> int:
        return self.schedule.next_step(done)

    def has_pending(self) -> bool:
        return self.schedule.has_pending()

    def joined(self) -> None:
        """Elastic joiner (base.joined): local <- global; landing=replay measures its own steps from here."""
        super().joined()
        self.schedule.joined()

    def finish(self, model) -> None:
        super().finish(model)
        self.write_report()  # also when the last step ended a round (then finish runs no final_sync)

    def in_order(self, fn):
        return self.exchange.run(fn)  # behind the fragments in flight, on the exchange's own thread

    def final_sync(self) -> None:
        """Land what is in flight, then sync every fragment, blocking: the global model holds all work."""
        self.schedule.final_sync()

    def write_report(self) -> None:
        """Bytes this rank sent per exchange, for the peak-per-sync figure (the ledger keeps only totals)."""
        if not self.report_dir or self.comm.rank != 0:
            return
        sent = self.exchange.sent
        path = Path(self.report_dir) / "outer_exchanges.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "strategy": self.name,
                    "fragments": self.schedule.fragments,
                    "exchanges": len(sent),
                    "peak_sent_bytes": max(sent, default=0),
                    "sent_per_exchange": sent,
                    **self.schedule.report(),
                }
            )
        )

    # ---- what the schedule calls ------------------------------------------------------------------
    def outer_step(self, p: int, mean_delta: torch.Tensor) -> None:
        """The outer optimizer's step on fragment p of the global model, published for evaluation."""
        lo, hi = self.schedule.bounds[p]
        self.outer.step(self.global_flat, mean_delta, lo, hi, self.outer_lr_factor())
        self.publish(lo, hi)
        self.rounds += 1

    def outer_lr_factor(self) -> float:
        """The outer lr's factor now (OuterStep.factor: sqrt(M) and/or the inner lr's schedule; else 1)."""
        return self.outer.factor(self.comm, self.optimizer)

    def inner_state_step(self) -> None:
        """sync_inner_state: average the inner Adam moments after a landing (one more all-reduce)."""
        if self.inner_state is None:
            return
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                st = self.optimizer.state.get(param, {})
                if not all(k in st for k in _MOMENTS):
                    raise ValueError(
                        "sync_inner_state needs an Adam-style inner optimizer with exp_avg and "
                        f"exp_avg_sq state; found state keys {sorted(st)}"
                    )
                tensors += [st[k] for k in _MOMENTS]
        view = FlatView(tensors)
        view.write(self.inner_state.mean(self.comm, view.read(), name="inner_state"))

    # ---- state: one entry per part, the keys of before (a checkpoint written before loads) ----------
    def extra_state(self) -> dict:
        schedule = self.schedule.state_dict()  # first: waits for the exchanges in flight (error feedback)
        return {
            "outer_opt": self.outer.state_dict(),
            "inflight": schedule.pop("inflight"),
            "sends": schedule.pop("sends"),
            "exchange": self.exchange.state_dict(),
            **schedule,
        }

    def load_extra_state(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer_opt"])
        self.schedule.load_state_dict(state)
        self.exchange.load_state_dict(state.get("exchange", {}))
