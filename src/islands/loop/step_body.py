"""The body of one training step of the Trainer (islands.loop.trainer), in the order it runs:

    body.set_lr(step)                    the schedule's factor of each group's initial lr (a function step -> factor)
    loss = body.forward_backward(batch)  all micro-batches, one gradient (islands.memory.step), or the
                                         strategy's own forward_backward (a pipeline)
    body.update(step)                    strategy.after_backward -> clip -> optimizer.step -> zero_grad -> a torch
                                         LRScheduler's step
    step = body.next_step(step + 1, total)  step + 1, unless the rounds let this island skip ahead
    body.readout.took(loss)              the loss stays on the device until a log entry or a callback reads it

It holds what the user gave for the step: the loss function and the validation metrics, the step function
(micro-batches, precision), grad_clip, the schedule and the torch.compile settings (the compiled model runs the
forward; the strategy's hooks get the model it wrapped); and the readout of its losses and times
(islands.loop.step_readout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from islands.loop.step_readout import StepReadout
from islands.memory.step import ForwardBackward
from islands.runtime.compiled import Compile, graphs_compiled, is_compiled
from islands.runtime.world import World
from islands.sync.base import CompilesByUnit, OwnsStep, SkipsSteps, Strategy, capability


class StepBody:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        *,
        loss_fn: Callable | None,
        step_fn: ForwardBackward,
        grad_clip: float,
        schedule: Any,
        metrics: dict[str, Callable],
        log_every: int,
        compile: Compile | None = None,
    ):
        """`model`: as the strategy wrapped it; `log_every`: steps per entry of the training-loss series; `compile`:
        torch.compile settings for the forward and backward (the strategy's hooks keep the wrapped model)."""
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.loss_fn, self.step_fn, self.grad_clip = loss_fn, step_fn, grad_clip
        self.schedule = schedule  # a function step -> factor of each group's initial lr, or a torch LRScheduler
        self.metrics = metrics  # name -> fn(prediction, targets), for validation (Trainer.evaluate)
        owner = capability(strategy, OwnsStep)  # type: ignore[type-abstract]  # mypy#4717 (Protocol as type[C])
        self._own_step = owner.forward_backward if owner is not None else None
        if compile is not None and owner is not None:
            raise ValueError(
                f"compile= compiles the model's forward and backward, which {type(owner).__name__} runs itself "
                "(a pipeline's stages): leave compile off with it"
            )
        # compiled after wrap (docs/own-model.md, "Compiled models"): DDP's graph is split at its buckets; evaluation
        # and checkpoints go through the strategy's eval_model, the eager module, so eval mode compiles nothing more
        self.compile = compile
        units = compile_units(strategy, model) if compile is not None else []
        self.compiled_units = len(units)  # 0: the whole model compiles as one (or nothing compiles)
        self.forward_model = compile.apply(model, units) if compile is not None else model
        self.graphs_before = graphs_compiled()  # the graphs this body's fits compile are counted from here
        self._skips = capability(strategy, SkipsSteps)  # type: ignore[type-abstract]  # mypy#4717 (Protocol as type[C])
        self._base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.readout = StepReadout(log_every)

    def set_lr(self, step: int) -> None:
        if self.schedule is None:
            return
        if hasattr(self.schedule, "step") and hasattr(self.schedule, "get_last_lr"):
            return  # a torch LRScheduler: stepped after the optimizer
        factor = self.schedule(step)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor

    def forward_backward(self, batch: Any, explain: bool = False) -> Any:
        """The batch's loss (on the device), its gradient accumulated; `explain`: say why a batch the model
        cannot take fails (the first step of a fit)."""
        if self._own_step is not None:
            return self._own_step(*batch)
        return self.step_fn(self.forward_model, batch, self.loss_fn, explain=explain)

    def update(self, step: int) -> None:
        self.strategy.after_backward(self.model, step)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.schedule, "get_last_lr"):
            self.schedule.step()

    def next_step(self, step: int, total_steps: int) -> int:
        """`step`, or where a slower island skips to: its round's end (never past the run's)."""
        if self._skips is not None:
            return max(step, min(int(self._skips.next_step(step)), total_steps))
        return step


def compile_units(strategy: Strategy, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units the Trainer's compile compiles one by one (fsdp's; base.CompilesByUnit), or [] for the whole model.
    islands does not reach into a model the user compiled themselves: it compiles what it was given whole, as it
    does under any strategy."""
    by_unit = capability(strategy, CompilesByUnit)  # type: ignore[type-abstract]  # mypy#4717 (Protocol as type[C])
    return by_unit.compile_units() if by_unit is not None and not is_compiled(model) else []


def compile_record(body: StepBody, world: World) -> dict:
    """The run record's `compile` part of a body that compiles: its fit's first step against its steady ones, and the
    graphs torch compiled since the body was built (Compile.record).

    Simulated islands (islands.runtime.simulate, backend "simulated") are threads of one process: they share
    torch.compile's cache and its graph counter, so the island that steps first compiles the graphs every other island
    then reuses, and an island that came later saw a warm first step and no graph of its own. There every island
    records the island that paid the compilation (the greatest first-step excess) and the graphs compiled since the
    first body was built. Collective in a simulation: every island calls it (the run record's build does)."""
    compile_ = body.compile
    assert compile_ is not None, "compile_record is for a body that compiles"
    seconds, before = body.readout.seconds, body.graphs_before
    if world.backend == "simulated" and world.size > 1:
        gathered = world.all_gather_object((before, list(seconds)))
        before = min(b for b, _ in gathered)
        seconds = max((s for _, s in gathered), key=lambda s: compile_.record(s)["seconds"] or 0.0)
    return compile_.record(seconds, graphs_compiled() - before, body.compiled_units)
