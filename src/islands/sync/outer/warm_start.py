"""Warm start (LIT-212's protocol): ordinary data parallelism across islands first, then the outer strategy.

DiLoCo's paper does not start its islands from a random model: it pretrains with ordinary
data-parallel training and starts DiLoCo from that checkpoint. `WarmStart(outer, steps=W)` gives
the same shape to any outer strategy whose rounds are counted in steps (diloco, streaming-diloco):

  steps 0 .. W-1   after every backward the islands average their gradients (one all-reduce of the
                   fp32 gradients, ledger kind "outer_warm_grad"), so every island takes the same
                   AdamW step as one data-parallel job over all of them; parameters and Adam moments
                   stay identical on every island. Gradients are divided by the island count before
                   the sum, as torch's DDP does, so with 2 islands the average is bit for bit DDP's.
  after step W-1   the outer strategy restarts its global model from the (identical) live one and runs
                   its rounds over the remaining steps, its clock starting at 0.
The ledger keeps the warm-up bytes apart from the rounds' ("outer_warm_grad" vs "outer_delta"), so a
report can give the bytes of the compared phase alone and with the warm-up.
"""

from __future__ import annotations

import torch

from islands.sync.base import NoOp
from islands.sync.ddp import unwrap
from islands.sync.outer.base import SHARDED_OUTER, OuterStrategy, is_sharded

WARM_KIND = "outer_warm_grad"


class WarmStart(NoOp):
    def __init__(self, outer: OuterStrategy, steps: int):
        if not isinstance(outer, OuterStrategy):
            raise TypeError(f"WarmStart wraps an OuterStrategy, got {type(outer).__name__}")
        if steps < 1:
            raise ValueError(
                f"warm-start steps must be >= 1 (0 means no warm start: use the outer strategy itself), got {steps}"
            )
        self.outer, self.steps = outer, int(steps)
        self.name = f"{outer.name}+warm{self.steps}"
        self._done = 0

    @property
    def comm(self):
        return self.outer.comm

    @property
    def warm(self) -> bool:
        """True while the islands still train as one data-parallel job."""
        return self._done < self.steps

    def sharded_refusal(self) -> str | None:
        """The warm-up averages whole gradients across islands; under inner fsdp they are shards: not wired."""
        return f"warm_start={self.steps} is not wired for sharded parameters yet; with inner fsdp use {SHARDED_OUTER}"

    def elastic_refusal(self) -> str | None:
        """The wrapped strategy's own rule: the warm-up's gradient averages go through its (elastic) comm."""
        return self.outer.elastic_refusal()

    def wrap(self, model, optimizer, world):
        if is_sharded(unwrap(model)):
            raise ValueError(f"inner fsdp shards the parameters: {self.sharded_refusal()}")
        self._done = 0
        model = self.outer.wrap(model, optimizer, world)
        self.params = [p for p in unwrap(model).parameters() if p.requires_grad]
        return model

    @torch.no_grad()
    def after_backward(self, model, step):
        if step >= self.steps:
            return self.outer.after_backward(model, step - self.steps)
        grads = [p.grad for p in self.params if p.grad is not None]
        if len(grads) != len(self.params):
            # Every island must send the same vector; a missing gradient would misalign the sum.
            raise ValueError(
                f"warm start: {len(self.params) - len(grads)} parameter(s) got no gradient at step "
                f"{step}; every trainable parameter must take part in the loss"
            )
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        flat.div_(self.comm.size)  # divide first, then sum: DDP's order, so 2 islands match it bitwise
        flat = self.comm.all_reduce(flat, kind=WARM_KIND)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()

    def after_step(self, model, optimizer, step):
        if step >= self.steps:
            return self.outer.after_step(model, optimizer, step - self.steps)
        self._done = step + 1
        if self._done == self.steps:
            self.outer.global_flat = self.outer.local.read()  # the same on every island
            self.outer.publish()

    def on_batch(self, batch, step):
        return self.outer.on_batch(batch, step - self.steps) if step >= self.steps else batch

    def next_step(self, done: int) -> int:
        return done if done <= self.steps else self.steps + self.outer.next_step(done - self.steps)

    def finish(self, model):
        if not self.warm:  # during warm-up every island already holds the global model
            self.outer.finish(model)

    @property
    def rounds(self) -> int:
        return self.outer.rounds

    def eval_model(self, model):
        # During warm-up the live model is the global one (every island holds the same bits).
        return model if self.warm else self.outer.eval_model(model)

    def state_dict(self) -> dict:
        return {"warm_steps": self.steps, "done": self._done, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if int(state["warm_steps"]) != self.steps:
            raise ValueError(
                f"checkpoint was written with warm_start={state['warm_steps']}, this run has "
                f"warm_start={self.steps}; resume with the same spec"
            )
        self._done = int(state["done"])
        self.outer.load_state_dict(state["outer"])
