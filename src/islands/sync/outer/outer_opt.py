"""Outer optimizers over flat fp32 slices: they step global[lo:hi] with a pseudo-gradient for it.

The pseudo-gradient of a round is  delta = global_at_round_start - mean_over_islands(local_at_end),
so a step with lr 1 and no momentum lands exactly on the islands' average (up to fp32 rounding of
global - delta). Slices let Streaming DiLoCo step one fragment at a time; the state is flat too,
so a fragment's momentum lives at the same offsets as its parameters.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

# DiLoCo's default outer step: plain SGD (no momentum) with lr sqrt(2) on the averaged delta. On 2 islands this
# is bitwise the `outer=sgd,outer_lr=1,momentum=0,lr_scale=sqrt-islands` step, the best outer step measured
# (islands bench diloco-vs-ddp: byte LM H=100 +8.7% vs DDP, LIT-212's Nesterov 0.7/0.9 +16.6%); unlike
# sqrt-islands it stays at 1.41 on 4 islands, where sqrt(4) = 2 over-steps (diloco-gap --quick).
# Why, with the numbers: docs/outer-strategies.md, "Default outer step". LIT-212's step is one spec away:
# outer=nesterov,outer_lr=0.7,momentum=0.9.
DEFAULT_OUTER = "sgd"
DEFAULT_OUTER_LR = math.sqrt(2)
DEFAULT_OUTER_MOMENTUM = 0.0


@runtime_checkable
class OuterOptimizer(Protocol):
    """Steps global[lo:hi] with the averaged pseudo-gradient for that slice; state is explicit."""

    def step(self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None,
             lr_scale: float = 1.0) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class OuterSGD:
    """SGD with heavy-ball or Nesterov momentum (LIT-212's outer step: Nesterov, lr 0.7, momentum 0.9); DiLoCo's
    default is plain SGD, lr sqrt(2), no momentum (DEFAULT_OUTER_LR above)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False):
        if nesterov and momentum <= 0:
            raise ValueError("nesterov needs momentum > 0")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.buf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None,
             lr_scale: float = 1.0) -> None:
        hi = params.numel() if hi is None else hi
        update = delta
        if self.momentum > 0:
            if self.buf is None:
                self.buf = torch.zeros_like(params)
            buf = self.buf[lo:hi]
            buf.mul_(self.momentum).add_(delta)
            update = delta + self.momentum * buf if self.nesterov else buf
        params[lo:hi].add_(update, alpha=-self.lr * lr_scale)

    def state_dict(self) -> dict:
        return {"momentum_buffer": None if self.buf is None else self.buf.clone()}

    def load_state_dict(self, state: dict) -> None:
        buf = state.get("momentum_buffer")
        self.buf = None if buf is None else buf.to(torch.float32).clone()


class PrimalAveraging:
    """LIT-276: outer SGD on a sequence z, and the model is a running average of z.

        z      <- z - lr * delta
        global <- (1 - weight) * global + weight * z
    weight = 1 is plain outer SGD; smaller weights smooth more. The smoothing strength is one
    continuous knob that does not depend on the number of inner steps.
    """

    def __init__(self, lr: float, weight: float = 0.5):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.lr, self.weight = float(lr), float(weight)
        self.z: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None,
             lr_scale: float = 1.0) -> None:
        hi = params.numel() if hi is None else hi
        if self.z is None:
            self.z = params.clone()
        z = self.z[lo:hi]
        z.add_(delta, alpha=-self.lr * lr_scale)
        params[lo:hi].mul_(1 - self.weight).add_(z, alpha=self.weight)

    def state_dict(self) -> dict:
        return {"z": None if self.z is None else self.z.clone()}

    def load_state_dict(self, state: dict) -> None:
        z = state.get("z")
        self.z = None if z is None else z.to(torch.float32).clone()


def build_outer_optimizer(outer: str, lr: float, momentum: float, weight: float):
    if outer == "nesterov":
        return OuterSGD(lr, momentum, nesterov=momentum > 0)
    if outer == "sgd":
        return OuterSGD(lr, momentum, nesterov=False)
    if outer == "primal":
        return PrimalAveraging(lr, weight)
    raise ValueError(f"outer optimizer must be nesterov, sgd or primal; got {outer!r}")
