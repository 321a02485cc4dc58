"""Pick the largest per-worker micro-batch whose memory fits a budget (SOTA-031, ZeRO LIT-027).

Memory of one step = state (parameters, gradients, optimizer moments; independent of batch) + the peak of
bytes saved for backward, which is affine in the micro-batch size b: fixed + per_sample * b. Both terms are
counted exactly (islands.memory.accounting), not read from RSS, so the choice is the same on a busy and an
idle machine. The sizer measures the peak at b = 1 and b = 2, predicts the largest b under the budget, then
measures that b and steps down if the prediction was optimistic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from islands.data.batches import concat, size, split
from islands.memory.accounting import SavedTensorMeter, StateBytes, state_bytes
from islands.memory.step import ForwardBackward

MB = 1e6  # budgets are given in decimal megabytes, like every byte count the bench reports


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    state: StateBytes
    fixed_bytes: int  # activation bytes independent of batch (e.g. bf16 weight copies under autocast)
    per_sample_bytes: int
    micro_batch: int
    peak_bytes: int  # measured activation peak at micro_batch

    @property
    def total_bytes(self) -> int:
        return self.state.total + self.peak_bytes

    def as_dict(self) -> dict:
        out = asdict(self)
        out["state"] = {**asdict(self.state), "total": self.state.total}
        out["total_bytes"] = self.total_bytes
        return out


def activation_peak(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    make_batch: Callable[[int], object],
    samples: int,
    step: ForwardBackward,
) -> int:
    """Peak bytes held for backward over one forward and backward of `samples` samples (grads are cleared).
    `make_batch(b)` returns a batch of b samples in any structure the loop takes (islands.data.batches)."""
    params = list(model.parameters())
    batch = make_batch(samples)
    with SavedTensorMeter(exclude=params) as meter:
        step(model, batch, loss_fn)
    for p in params:
        p.grad = None  # leave the model as the trainer expects it before its first step
    return meter.peak


def plan_micro_batch(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    make_batch: Callable[[int], object],
    batch: int,
    budget_bytes: int,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str = "fp32",
) -> MemoryPlan:
    """The largest micro-batch in 1..batch whose state + activation peak fits `budget_bytes`.

    Raises ValueError when not even one sample fits, saying how much would.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0; got {budget_bytes}")
    step = ForwardBackward(micro_batch=0, precision=precision)
    state = state_bytes(model, optimizer)
    measured = {1: activation_peak(model, loss_fn, make_batch, 1, step)}
    if state.total + measured[1] > budget_bytes:
        need = state.total + measured[1]
        raise ValueError(
            f"memory budget {budget_bytes / MB:.2f} MB does not fit one sample: parameters, gradients and "
            f"optimizer state take {state.total / MB:.2f} MB and one sample's activations {measured[1] / MB:.2f} MB; "
            f"raise the budget to at least {need / MB:.2f} MB, or cut activations with activation_checkpointing "
            f"or precision=bf16"
        )
    if batch == 1:
        return MemoryPlan(budget_bytes, state, measured[1], 0, 1, measured[1])
    measured[2] = activation_peak(model, loss_fn, make_batch, 2, step)
    per_sample = max(measured[2] - measured[1], 1)
    fixed = measured[1] - per_sample
    b = max(1, min(batch, (budget_bytes - state.total - fixed) // per_sample))
    while True:
        if b not in measured:
            measured[b] = activation_peak(model, loss_fn, make_batch, b, step)
        if b == 1 or state.total + measured[b] <= budget_bytes:
            return MemoryPlan(budget_bytes, state, fixed, per_sample, int(b), measured[b])
        b -= 1  # the affine prediction was optimistic; the measurement decides


def synthetic_batches(task: str, context: int, device: torch.device | str = "cpu", seed: int = 0):
    """Batches of the task's shapes from a private generator: sizing must not move the training RNG."""
    gen = torch.Generator().manual_seed(seed)

    def make(b: int):
        if task == "lm":
            x = torch.randint(0, 256, (b, context), generator=gen)
            y = torch.randint(0, 256, (b, context), generator=gen)
        else:
            x = torch.randn(b, 64, generator=gen)
            y = torch.randint(0, 10, (b,), generator=gen)
        return x.to(device), y.to(device)

    return make


def batches_like(batch) -> Callable[[int], object]:
    """make_batch(b) from one real batch: its first b samples, repeated when b exceeds it (a user's data has no
    synthetic twin; the sizer needs shapes, not values)."""
    have = size(batch)

    def make(b: int):
        if b <= have:
            return split(batch, [b, have - b])[0] if b < have else batch
        reps = -(-b // have)
        return split(concat([batch] * reps), [b, reps * have - b])[0]

    return make
