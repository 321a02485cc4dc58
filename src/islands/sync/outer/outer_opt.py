"""DiLoCo's outer-optimizer part: an optimizer over flat fp32 slices and what scales its lr.

The pseudo-gradient of a round is  delta = global_at_round_start - mean_over_islands(local_at_end),
so a step with lr 1 and no momentum lands exactly on the islands' average (up to fp32 rounding of
global - delta). Slices let Streaming DiLoCo step one fragment at a time; the state is flat too,
so a fragment's momentum lives at the same offsets as its parameters.

Two kinds of optimizer step a slice:
  islands' own       OuterSGD (heavy ball or Nesterov), PrimalAveraging: step(params, delta, lo, hi, lr_scale)
  any torch.optim    a factory, `lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`,
                     adapted by TorchOuter: one torch parameter per fragment holds the global slice, its .grad is
                     set to the averaged delta and optimizer.step() runs (the pseudo-gradient form); the other
                     fragments' parameters have no .grad that step, so their state stays as it was.
OuterStep is the part DiLoCo holds: the optimizer plus the two lr factors that were strings on DiLoCo before,
`sqrt_islands` (lr_scale=sqrt-islands) and `follow_inner_lr` (outer_schedule=inner).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Protocol, cast, runtime_checkable

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

    def step(
        self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None, lr_scale: float = 1.0
    ) -> None: ...

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
    def step(
        self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None, lr_scale: float = 1.0
    ) -> None:
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
    def step(
        self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None, lr_scale: float = 1.0
    ) -> None:
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


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class TorchOuter:
    """Any torch.optim optimizer as an outer optimizer over flat slices: `factory(params)` builds it (the user's own
    lr, momentum, betas) once the fragments are known (`bind`). A step of slice [lo, hi) copies the global slice
    into its fragment's parameter, sets that parameter's .grad to the averaged delta, runs optimizer.step() with
    the lr times `lr_scale`, and copies the result back. The state is the optimizer's state_dict (copied, so a
    saved state is never changed by a later step)."""

    def __init__(self, factory: OptimizerFactory):
        if isinstance(factory, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer takes a factory, e.g. lambda params: torch.optim.SGD(params, lr=0.7, "
                "momentum=0.9, nesterov=True): the outer parameters are DiLoCo's global fragments, "
                "which exist only once the strategy is wrapped"
            )
        if not callable(factory):
            raise TypeError(
                f"outer_optimizer must be an outer optimizer (OuterSGD, PrimalAveraging) or a "
                f"torch.optim factory; got {type(factory).__name__}"
            )
        self.factory = factory
        self.slices: dict[tuple[int, int], torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    def bind(self, bounds: list[tuple[int, int]]) -> None:
        """One parameter per fragment [lo, hi), in fragment order (the optimizer's state is indexed by it)."""
        self.slices = {(lo, hi): torch.nn.Parameter(torch.zeros(hi - lo)) for lo, hi in bounds}
        self.optimizer = self.factory(list(self.slices.values()))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the outer optimizer factory returned {type(self.optimizer).__name__}, not a torch.optim.Optimizer"
            )

    @torch.no_grad()
    def step(
        self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None, lr_scale: float = 1.0
    ) -> None:
        hi = params.numel() if hi is None else hi
        if self.optimizer is None:
            raise RuntimeError("TorchOuter.step before bind: the strategy binds it to its fragments in setup")
        param = self.slices[(lo, hi)]
        param.copy_(params[lo:hi])
        param.grad = delta.to(torch.float32).clone()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        if lr_scale != 1.0:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr * lr_scale
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            param.grad = None
        params[lo:hi].copy_(param)

    def state_dict(self) -> dict:
        return {} if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is None:
            raise RuntimeError("TorchOuter.load_state_dict before bind")
        if state:
            self.optimizer.load_state_dict(copy.deepcopy(state))


class OuterStep:
    """DiLoCo's outer-optimizer part: `optimizer` (OuterSGD, PrimalAveraging, any object with the OuterOptimizer
    step, or a torch.optim factory) and its lr factors. `sqrt_islands`: the lr times sqrt(M), M islands in the
    exchange, read at each step (elastic-safe; the spec's lr_scale=sqrt-islands). `follow_inner_lr`: the lr times
    inner lr now / inner lr at wrap, so the outer step follows the inner warm-up and decay (outer_schedule=inner).

    Why sqrt(M): each of M islands runs Adam on 1/M of the global batch. Where gradient noise dominates a
    coordinate, Adam's second moment grows ~M-fold, so the signal in each island's step shrinks ~1/sqrt(M) against
    DDP's Adam on the full batch, while the islands' independent noise shrinks 1/sqrt(M) in the average. Scaling
    the averaged delta by sqrt(M) restores both to DDP's size (our derivation; measured in docs/outer-strategies.md).
    """

    def __init__(
        self,
        optimizer: OuterOptimizer | OptimizerFactory | None = None,
        sqrt_islands: bool = False,
        follow_inner_lr: bool = False,
    ):
        if optimizer is None:
            optimizer = build_outer_optimizer(DEFAULT_OUTER, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, 0.5)
        self.opt: OuterOptimizer | TorchOuter
        if isinstance(optimizer, (OuterOptimizer, TorchOuter)) and not isinstance(optimizer, torch.optim.Optimizer):
            self.opt = optimizer
        else:  # a factory; TorchOuter refuses anything else (a built torch optimizer) with its message
            self.opt = TorchOuter(cast(OptimizerFactory, optimizer))
        self.sqrt_islands, self.follow_inner_lr = bool(sqrt_islands), bool(follow_inner_lr)
        self.base_lr = 1.0  # the inner optimizer's lr at wrap (bind): what follow_inner_lr measures against

    def bind(self, bounds: list[tuple[int, int]], inner: torch.optim.Optimizer) -> None:
        # follow_inner_lr: the trainer builds the optimizer at its peak lr and only then schedules it, so the lr
        # seen here is the reference the inner schedule is measured against.
        self.base_lr = float(inner.param_groups[0]["lr"])
        if isinstance(self.opt, TorchOuter):
            self.opt.bind(bounds)

    def factor(self, comm, inner: torch.optim.Optimizer) -> float:
        """sqrt(M) with sqrt_islands, M read from the Comm at each step; times inner lr now / at wrap with
        follow_inner_lr; else 1."""
        factor = float(comm.size) ** 0.5 if self.sqrt_islands else 1.0
        if self.follow_inner_lr:  # follow the inner warm-up + cosine
            factor *= float(inner.param_groups[0]["lr"]) / self.base_lr
        return factor

    def step(self, params: torch.Tensor, delta: torch.Tensor, lo: int, hi: int, factor: float) -> None:
        self.opt.step(params, delta, lo, hi, lr_scale=factor)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
