"""`inner = "pipeline"`: the island's ranks are the stages of one pipeline (SOTA-017/018/019).

The strategy cuts the model (rank 0 decides, every rank receives the cut through the counted Comm, so a
measured `balanced` split is the same everywhere), keeps this rank's stage, points the optimizer at the
stage's parameters only, and runs a schedule per step (`forward_backward`). Gradient clipping uses the
norm over all stages. `eval_model` gathers every stage's parameters into the full model each rank holds,
so evaluation and the run record see the trained model.

It needs the loop to hand it the whole batch, which the Strategy hooks cannot do; the trainer runs it
through islands.parallel.pipeline.trainer.PipelineTrainer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from islands.parallel.pipeline.chooser import MicrobatchChoice, choose_microbatches, divisors, profile_microbatches
from islands.parallel.pipeline.cuts import check_stage_count, choose_cuts, parse_cuts
from islands.parallel.pipeline.hf_pieces import is_causal_lm
from islands.parallel.pipeline.pieces import Stage, build_stages, parameter_owner, pieces_of
from islands.parallel.pipeline.runner import PipelineRunner
from islands.parallel.pipeline.schedule import SCHEDULES, bubble_fraction
from islands.runtime.world import World
from islands.sync.base import NoOp

PLAN, LOSS, EVAL_GATHER = "pipeline_plan", "pipeline_loss", "pipeline_eval_gather"


def parse_microbatches(value: str | int) -> int | str:
    """'auto' or a positive integer (as int or digits)."""
    if value == "auto":
        return "auto"
    try:
        m = int(value)
    except (TypeError, ValueError):
        m = 0
    if m < 1 or isinstance(value, (bool, float)):
        raise ValueError(f"microbatches={value!r}: give a positive integer dividing the batch, or 'auto'")
    return m


def example_batch(model: nn.Module, b: int, sequence: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero inputs and targets of the model's shapes (for planning; values do not matter). `sequence`: the task's
    window length, for a transformers LM (which has no context attribute; 32 when not given)."""
    if hasattr(model, "context") or is_causal_lm(model):
        # the ignore: nn.Module.__getattr__ is typed Tensor | Module; `context` is a plain int attribute
        t = int(model.context) if hasattr(model, "context") else int(sequence or 32)  # type: ignore[arg-type]
        x = torch.zeros(b, t, dtype=torch.long)
        return x, x.clone()
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.zeros(b, first.in_features), torch.zeros(b, dtype=torch.long)


class PipelineStages(NoOp):
    name = "pipeline"

    def __init__(
        self,
        stages: int,
        microbatches: int | str,
        cuts: str,
        schedule: str,
        batch: int,
        loss_fn: Callable,
        budget_bytes: float = math.inf,
        grad_clip: float = 0.0,
        sequence: int | None = None,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        self.count, self.cuts, self.schedule = stages, parse_cuts(cuts), schedule
        self.requested = parse_microbatches(microbatches)
        if isinstance(self.requested, int) and batch % self.requested:  # an int, or "auto"
            raise ValueError(
                f"microbatches={self.requested} does not divide the pipeline's batch of {batch}; "
                f"choose one of {divisors(batch)} or 'auto'"
            )
        self.batch, self.loss_fn, self.budget, self.grad_clip = batch, loss_fn, budget_bytes, grad_clip
        self.sequence = sequence  # a transformers LM's window length, for the planning batch
        self.starts: list[int] = []
        self.microbatches = 0
        self.choice: MicrobatchChoice | None = None

    # ---- setup -----------------------------------------------------------------------------------
    def wrap(self, model, optimizer, world: World):
        self.full, self.world = model, world
        self.pieces = pieces_of(model)
        check_stage_count(self.count, len(self.pieces))
        size = world.workers_per_island if world.distributed else 1
        if size != self.count:
            raise ValueError(f"pipeline of {self.count} stages needs {self.count} workers per island, got {size}")
        self.comm = world.comm("local") if world.distributed else None
        self.index = world.local_rank if world.distributed else 0
        self._decide(model)
        self.stages = build_stages(self.pieces, self.starts)
        owner = parameter_owner(self.stages)
        unowned = [n for n, p in model.named_parameters() if id(p) not in owner]
        if unowned:
            raise ValueError(
                f"parameters {unowned} sit in no pipeline piece; the model's forward must run only through its pieces"
            )
        self.stage: Stage = self.stages[self.index]
        mine = {id(p) for p in self.stage.parameters()}
        for group in optimizer.param_groups:  # optimizer state for this stage only: 1/K of it per rank
            group["params"] = [p for p in group["params"] if id(p) in mine]
        self.runner = PipelineRunner(self.pieces, self.stage, self.comm, self.schedule, self.loss_fn)
        return model

    def _decide(self, model: nn.Module) -> None:
        """Rank 0 picks cuts and M; everyone receives them (a measured choice differs between ranks)."""
        plan = torch.zeros(self.count + 1, dtype=torch.long)
        if self.index == 0:
            b = self.batch // (self.requested if isinstance(self.requested, int) else 1)
            x, y = example_batch(model, b, self.sequence)
            self.starts = choose_cuts(self.cuts, self.pieces, self.count, x, self.loss_fn, y)
            self.microbatches = self.requested if isinstance(self.requested, int) else self._auto(model)
            plan[: self.count] = torch.tensor(self.starts)
            plan[self.count] = self.microbatches
        if self.comm is not None:
            self.comm.broadcast(plan, src=self._global_rank(0), kind=PLAN)
        self.starts, self.microbatches = plan[: self.count].tolist(), int(plan[self.count])

    def _auto(self, model: nn.Module) -> int:
        x, y = example_batch(model, self.batch, self.sequence)
        sizes = [self.batch // m for m in divisors(self.batch)]
        prof = profile_microbatches(self.pieces, self.starts, x, y, self.loss_fn, sizes)
        self.choice = choose_microbatches(
            self.count,
            self.batch,
            self.schedule,
            {b: v[0] for b, v in prof.items()},
            self.budget,
            {b: v[1] for b, v in prof.items()},
        )
        return self.choice.microbatches

    def _global_rank(self, stage: int) -> int:
        return self.world.island * self.count + stage if self.world.distributed else 0

    # ---- one step --------------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The batch's loss (the same on every stage); gradients land on this stage's parameters."""
        loss = self.runner.step(x, y, self.microbatches)
        value = torch.zeros(1) if loss is None else loss.reshape(1).float()
        if self.comm is not None:
            self.comm.broadcast(value, src=self._global_rank(self.count - 1), kind=LOSS)
        return float(value)

    def after_backward(self, model, step):
        if self.grad_clip <= 0:
            return
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1) if grads else torch.zeros(1)
        if self.comm is not None:  # the norm over every stage, so clipping matches the unsplit model
            self.comm.all_reduce(sq, kind="pipeline_grad_norm")
        scale = self.grad_clip / (float(sq.sqrt()) + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)

    # ---- evaluation and state --------------------------------------------------------------------
    def eval_model(self, model):
        """Collective: every stage broadcasts its parameters, so each rank's full model is current."""
        if self.comm is None:
            return self.full
        for stage in self.stages:
            params = list(stage.parameters())
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.comm.broadcast(flat, src=self._global_rank(stage.index), kind=EVAL_GATHER)
            if stage.index != self.index:
                with torch.no_grad():
                    torch.nn.utils.vector_to_parameters(flat, params)
        return self.full

    def describe(self) -> dict:
        """What this rank's stage is and holds, for the run record."""
        return {
            "stage": self.index,
            "stages": self.count,
            "starts": self.starts,
            "cuts": self.cuts,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "bubble_fraction": bubble_fraction(self.count, self.microbatches),
            "stage_parameters": sum(p.numel() for p in self.stage.parameters()),
            "held_activation_bytes_peak": self.runner.meter.peak,
            "auto_options": [o.__dict__ for o in self.choice.options] if self.choice else [],
        }

    def state_dict(self) -> dict:
        return {"starts": list(self.starts), "microbatches": self.microbatches}

    def load_state_dict(self, state: dict) -> None:
        if state and (state.get("starts") != self.starts or state.get("microbatches") != self.microbatches):
            raise ValueError(
                f"checkpoint was made with pipeline starts {state.get('starts')} and "
                f"M={state.get('microbatches')}, this job has {self.starts} and M={self.microbatches}"
            )
