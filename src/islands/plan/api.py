"""islands.plan(...): from the user's words (a job config, link specs, strategy specs) to a ranked Plan.

The string edge of the planner: the task is built as `islands train` builds it (islands.app.build), strategies are
spec strings (`ddp`, `zero1`, `fsdp`, or any outer spec `islands train --outer` takes), links are parsed by
links.parse_link. Every bad input raises PlanError naming what was given and what would be right.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from islands.app.build import build_task
from islands.app.validate import validate
from islands.config import ConfigError, JobConfig, from_mapping
from islands.data.source import batch_source
from islands.loop.task import Task
from islands.loop.trainer import Trainer
from islands.plan.costs import INNER, Candidate, Prediction, Topology, exposed_seconds, predict
from islands.plan.flat_step import FLAT, PROCESSES, flat_step_extra
from islands.plan.gathered import gathered_seconds
from islands.plan.job import job_trainer
from islands.plan.links import Link, LinkError, parse_link, probe_link
from islands.plan.profile import (
    Profile,
    cached_round_seconds,
    cached_seconds,
    profile_step,
    round_probe,
    round_steps,
)
from islands.plan.rank import Crossover, crossovers, ranked, rate_sweep
from islands.runtime.world import World
from islands.sync.base import Strategy
from islands.sync.outer import check_outer, make_outer, valid_specs
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.warm_start import WarmStart
from islands.sync.shard_plan import Unit, eval_gather_bytes, plan_units, state_bytes_per_rank, unit_traffic
from islands.sync.single import Single
from islands.sync.stack import Stack
from islands.sync.wrap_policy import BlockWrap
from islands.tasks.user import TaskError

# The default candidates: the flat strategies, DiLoCo and streaming DiLoCo at a few H, and DiLoCo's outer compressors
DEFAULT_STRATEGIES = (
    "ddp",
    "zero1",
    "fsdp",
    "diloco:inner_steps=10",
    "diloco:inner_steps=50",
    "diloco:inner_steps=200",
    "streaming-diloco:inner_steps=50",
    "streaming-diloco:inner_steps=200",
    "diloco:inner_steps=50,compressor=(topkq:ratio=0.01,bits=2)",
    "diloco:inner_steps=50,compressor=(randomk-shared:ratio=0.01)",
)


class PlanError(ValueError):
    """Bad input to the planner (the CLI exits 2 with it)."""


@dataclass
class Plan:
    predictions: list[Prediction]  # ranked: fastest that fits first
    topology: Topology
    inside: Link
    cross: Link
    profile: Profile
    crossovers: list[Crossover]
    curves: dict[str, list[tuple[float, float]]]  # label -> (cross rate bit/s, predicted step s)
    seconds: float  # what planning took, profiling included
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def as_dict(self) -> dict:
        return {
            "workers": self.topology.workers,
            "islands": self.topology.islands,
            "inside_link": self.inside.describe(),
            "cross_link": self.cross.describe(),
            "profile": vars(self.profile),
            "predictions": [p.as_dict() for p in self.predictions],
            "crossovers": [vars(c) for c in self.crossovers],
            "seconds": self.seconds,
            "notes": self.notes,
        }


def candidate(spec: str, cfg: JobConfig, model: torch.nn.Module) -> Candidate:
    """One strategy spec -> a Candidate with its objects built (an outer spec through islands' own registry)."""
    spec = spec.strip()
    if spec in INNER:
        if spec != "fsdp":
            return Candidate(spec, spec)
        n = cfg.world.workers
        units = plan_units(model, BlockWrap())[1]
        end = eval_gather_bytes([p.shape for p in model.parameters()], n)  # the final evaluation's full model
        traffic = fsdp_traffic(units, n, cfg.train.grad_clip > 0)
        return Candidate(spec, "fsdp", None, traffic, state_bytes_per_rank(units, n), end_bytes=end)
    try:
        check_outer(spec)
        outer = make_outer(spec)
    except (ValueError, TypeError) as e:
        raise PlanError(
            f"strategy {spec!r} is not one the planner knows ({e}); give {', '.join(INNER)}, or an outer spec as "
            f"`islands train --outer` takes: {valid_specs()}"
        ) from None
    if isinstance(outer, WarmStart):
        outer = outer.outer
    if not isinstance(outer, DiLoCo):
        raise PlanError(
            f"strategy {spec!r}: the planner has a cost model for ddp, zero1, fsdp and the DiLoCo family "
            f"(diloco, streaming-diloco), not {outer.name}"
        )
    inner = "ddp" if cfg.world.workers // cfg.world.islands > 1 else "single"
    return Candidate(spec, inner, outer)


def fsdp_traffic(units: list[Unit], n: int, clip: bool) -> tuple[tuple[str, int, int], ...]:
    """The planner's FSDP over `n` workers of `units` (one per block: BlockWrap), resharded after forward; with the
    trainer clipping (`clip`), FSDP also all-reduces the global norm once a step."""
    traffic = unit_traffic(units, n, reshard_after_forward=True)
    return tuple(traffic + ([("fsdp_grad_norm", 4, 4)] if clip else []))


def job_config(overrides: dict | JobConfig) -> JobConfig:
    """The user's job (task, workers, islands, batch) validated as one island, for building the task once."""
    try:
        cfg = overrides if isinstance(overrides, JobConfig) else from_mapping(overrides)
        flat = copy.deepcopy(cfg)
        flat.world.islands, flat.outer.strategy = 1, None
        validate(flat)
    except (ConfigError, ValueError, TypeError) as e:
        raise PlanError(str(e)) from None
    if cfg.world.islands < 1 or cfg.world.workers % cfg.world.islands:
        raise PlanError(f"workers ({cfg.world.workers}) must split evenly over islands ({cfg.world.islands})")
    return cfg


@dataclass
class Profiler:
    """The job built once (one worker's share of the batch); its step and its outer strategies' rounds profiled
    through `job_trainer` (cached by fingerprint)."""

    cfg: JobConfig  # one island: the job as each worker runs its step
    task: Task
    device: str = "cpu"
    refresh: bool = False

    @classmethod
    def of(cls, cfg: JobConfig, device: str = "cpu", refresh: bool = False) -> Profiler:
        flat = copy.deepcopy(cfg)
        flat.world.islands, flat.outer.strategy = 1, None
        try:
            with torch.random.fork_rng():
                task = build_task(flat)
        except TaskError as e:
            raise PlanError(str(e)) from None
        except Exception as e:  # the user's model or data did not build: their input, said as such
            raise PlanError(f"task {cfg.task.name!r} does not build: {type(e).__name__}: {e}") from e
        return cls(flat, task, device, refresh)

    def trainer(self, strategy: Strategy | None = None) -> Trainer:
        return job_trainer(self.cfg, self.task, World.single(self.device), strategy)

    def step(self, steps: int = 16) -> Profile:
        cfg, task = self.cfg, self.task
        with torch.random.fork_rng():
            batch = batch_source(task.train_data, 0, 1, task.batch_size, cfg.train.seed).next()
            trainer = self.trainer()
            settings = (
                f"{type(trainer.optimizer).__name__}:{trainer.step_fn.precision}:{trainer.step_fn.micro_batch}:"
                f"clip={cfg.train.grad_clip}"
            )
            return profile_step(
                trainer, batch, steps=steps, threads=cfg.world.threads, settings=settings, refresh=self.refresh
            )

    def local_work(self, cands: list[Candidate], prof: Profile) -> list[Candidate]:
        """The flat candidates with their strategy's measured local work per step (local_s): its step between 2
        processes here beyond the plain step (plan.flat_step), less what the cost model gives its collectives and
        synchronisation between 2 workers on the loopback probe's link."""
        flat = [c for c in cands if c.outer is None and c.inner in FLAT]
        if not flat or self.device != "cpu":  # two gloo processes measure a CPU step only
            return cands
        loopback = probe_link()
        local = {}
        for c in flat:
            with torch.random.fork_rng():
                extra, _ = cached_seconds(
                    prof,
                    f"{c.inner}|local work x{PROCESSES}",
                    partial(flat_step_extra, self.cfg, c.inner, self.cfg.world.threads),
                    threads=self.cfg.world.threads,
                    refresh=self.refresh,
                )
            two = (
                c
                if c.inner != "fsdp"
                else dataclasses.replace(
                    c,
                    fsdp_traffic=fsdp_traffic(
                        plan_units(self.task.model, BlockWrap())[1], PROCESSES, self.cfg.train.grad_clip > 0
                    ),
                )
            )
            local[c.label] = max(extra - exposed_seconds(two, prof, PROCESSES, loopback), 0.0)
        return [dataclasses.replace(c, local_s=local[c.label]) if c.label in local else c for c in cands]

    def rounds(self, cands: list[Candidate], prof: Profile, islands: int = 1) -> list[Candidate]:
        """The candidates with each outer strategy's measured local work per round (round_s) and what combining
        `islands` islands' payloads adds to it (gather_s)."""
        out = []
        for c in cands:
            if not isinstance(c.outer, DiLoCo):  # a flat strategy (candidate() builds only DiLoCo outers)
                out.append(c)
                continue
            h = round_steps(c.outer)
            probe = round_probe(c.outer, h)
            # a round's work does not depend on H: diloco at H = 10, 50 and 200 share one timing
            key = re.sub(r"inner_steps=\d+", f"inner_steps=<probe {h}>", c.label)
            with torch.random.fork_rng():
                s, _ = cached_round_seconds(
                    prof,
                    key,
                    partial(self.trainer, Stack(Single(), probe)),
                    self.trainer,
                    h,
                    threads=self.cfg.world.threads,
                    refresh=self.refresh,
                )
                g = 0.0  # one island combines its own payload only: the round timing holds it
                if islands > 1:
                    g, _ = cached_seconds(
                        prof,
                        f"{key}|combine x{islands}",
                        partial(gathered_seconds, c.outer.exchange, prof.numel, islands),
                        threads=self.cfg.world.threads,
                        refresh=self.refresh,
                    )
            out.append(dataclasses.replace(c, round_s=s, gather_s=g))
        return out


def profile_job(
    cfg: JobConfig, device: str = "cpu", refresh: bool = False, steps: int = 16
) -> tuple[Profile, torch.nn.Module]:
    """Build the task as `islands train` would (one worker's batch) and profile its step (cached)."""
    profiler = Profiler.of(cfg, device, refresh)
    return profiler.step(steps), profiler.task.model


def plan(
    config: dict | JobConfig,
    link: str | Link = "100mbit",
    inside_link: str | Link = "measured",
    strategies: tuple[str, ...] | list[str] = DEFAULT_STRATEGIES,
    device: str = "cpu",
    budget_mb: float = 0.0,
    refresh: bool = False,
) -> Plan:
    """Predict every strategy for the job `config` (islands.config keys: task, workers, islands, global_batch, ...)
    with `link` between islands and `inside_link` between an island's workers. Returns a ranked Plan."""
    t0 = time.perf_counter()
    cfg = job_config(config)
    topo = Topology(cfg.world.workers, cfg.world.islands)
    try:
        cross = link if isinstance(link, Link) else parse_link(link)
        if isinstance(inside_link, Link):
            inside = inside_link
        elif topo.islands == 1 and inside_link == "measured":
            inside = cross  # one island: the given link is its workers' link
        elif topo.per_island > 1 or topo.islands == 1:
            inside = parse_link(inside_link)
        else:
            inside = cross  # one-worker islands have no link inside
    except LinkError as e:
        raise PlanError(str(e)) from None
    profiler = Profiler.of(cfg, device, refresh)
    prof = profiler.step()
    cands = [candidate(s, cfg, profiler.task.model) for s in strategies]
    if topo.islands == 1:
        dropped = [c.label for c in cands if c.outer is not None]
        cands = [c for c in cands if c.outer is None]
        notes = [f"one island: outer strategies do not apply ({', '.join(dropped)})"] if dropped else []
    else:
        notes = []
    if not cands:
        raise PlanError("no strategy applies to this job: give --strategy ddp, zero1 or fsdp for one island")
    cands = profiler.local_work(profiler.rounds(cands, prof, topo.islands), prof)
    budget = int(budget_mb * 1e6)
    preds = ranked([predict(c, prof, topo, inside, cross, budget) for c in cands])

    def at(rate: float) -> dict[str, float]:
        other = Link(rate, cross.latency_s, f"{rate / 1e6:g} Mbit/s")
        ins = inside if topo.islands > 1 else other
        return {c.label: predict(c, prof, topo, ins, other, budget).step_s for c in cands}

    rates = rate_sweep()
    curves: dict[str, list[tuple[float, float]]] = {c.label: [] for c in cands}
    for r in rates:
        for label, s in at(r).items():
            curves[label].append((r, s))
    return Plan(preds, topo, inside, cross, prof, crossovers(at, rates), curves, time.perf_counter() - t0, notes)
