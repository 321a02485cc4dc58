"""Attack roles: what one Byzantine rank sends in place of its honest tensor.

Each role is a small object with `forge(tensor, rank, view) -> tensor`; `view` is a HonestView for
the omniscient roles (ALIE, IPM) and None for the rest. Roles never modify their input. Which ranks
play a role, and how the honest view is obtained, is the AttackPlan's business (faults/attacks.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class HonestView:
    """What colluding attackers know: coordinate-wise statistics of the honest ranks' tensors."""

    mean: torch.Tensor
    std: torch.Tensor  # population std (correction 0), defined for a single honest rank too
    honest: int  # how many honest tensors the statistics cover
    byzantine: int  # how many Byzantine ranks take part in the same exchange

    @staticmethod
    def of(tensors: Sequence[torch.Tensor], byzantine: int) -> HonestView:
        if not tensors:
            raise ValueError("an omniscient attack needs at least one honest rank in the same group")
        x = torch.stack([t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors])
        return HonestView(x.mean(0), x.std(0, correction=0), len(tensors), byzantine)


class Attack(Protocol):
    name: str
    omniscient: bool  # True: forge() needs a HonestView (costs one all-gather under "attack")

    def forge(self, tensor: torch.Tensor, rank: int, view: HonestView | None) -> torch.Tensor: ...


class SignFlip:
    name, omniscient = "sign-flip", False

    def forge(self, tensor, rank, view):
        return -tensor


@dataclass
class Scaled:
    factor: float
    name, omniscient = "scaled", False

    def forge(self, tensor, rank, view):
        return tensor * self.factor


class GaussianNoise:
    """Sends its honest tensor plus N(0, sigma^2) noise; one seeded generator per Byzantine rank."""

    name, omniscient = "gaussian", False

    def __init__(self, sigma: float, seed: int = 0):
        if not sigma > 0:
            raise ValueError(f"gaussian sigma must be > 0, got {sigma!r}")
        self.sigma, self.seed = float(sigma), int(seed)
        self.generators: dict[int, torch.Generator] = {}

    def _generator(self, rank: int) -> torch.Generator:
        if rank not in self.generators:
            g = torch.Generator(device="cpu")
            g.manual_seed(self.seed * 1_000_003 + rank)  # distinct, reproducible stream per rank
            self.generators[rank] = g
        return self.generators[rank]

    def forge(self, tensor, rank, view):
        noise = torch.randn(tensor.shape, generator=self._generator(rank), dtype=torch.float32)
        return tensor + (self.sigma * noise).to(device=tensor.device, dtype=tensor.dtype)

    def state_dict(self) -> dict:
        return {"generators": {r: g.get_state() for r, g in self.generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        for r, s in state.get("generators", {}).items():
            self._generator(int(r)).set_state(s)


def alie_z(n: int, f: int) -> float:
    """ALIE's z_max (Baruch et al., 2019): the largest z for which the lie still has a majority
    behind it. s = floor(n/2 + 1) - f honest workers must be "on the attackers' side";
    z = Phi^-1((n - s) / n). Zero or less means no room to lie; we clamp at 0."""
    if not 0 < f < n:
        raise ValueError(f"ALIE needs 0 < f < n, got n={n}, f={f}")
    s = (n // 2 + 1) - f
    p = (n - s) / n
    return max(0.0, statistics.NormalDist().inv_cdf(p)) if p < 1 else float("inf")


class ALIE:
    """'A little is enough': every Byzantine rank sends mean - z * std of the honest tensors."""

    name, omniscient = "alie", True

    def __init__(self, z: float | None = None):
        if z is not None and not z >= 0:
            raise ValueError(f"alie z must be >= 0 (or omitted to use the paper's z_max), got {z!r}")
        self.z = z

    def z_for(self, view: HonestView) -> float:
        return self.z if self.z is not None else alie_z(view.honest + view.byzantine, view.byzantine)

    def forge(self, tensor, rank, view):
        lie = view.mean - self.z_for(view) * view.std
        return lie.to(device=tensor.device, dtype=tensor.dtype)


@dataclass
class InnerProductManipulation:
    """IPM (Xie, Koyejo and Gupta, 2019): send -eps times the honest mean, so the aggregate's inner
    product with the true direction turns negative once eps is large enough for the aggregator."""

    eps: float = 0.1
    name, omniscient = "ipm", True

    def forge(self, tensor, rank, view):
        return (-self.eps * view.mean).to(device=tensor.device, dtype=tensor.dtype)


@dataclass
class NonFinite:
    """Sends a tensor full of NaN (or +Inf): a diverged or bit-flipped worker."""

    value: float = float("nan")
    name, omniscient = "nan", False

    def forge(self, tensor, rank, view):
        return torch.full_like(tensor, self.value)


class SilentDropout:
    """A worker that stopped computing but keeps answering. mode="zeros" (default) sends zeros, as if
    its buffer were never filled; mode="stale" repeats the first tensor it ever sent, for ever."""

    name, omniscient = "dropout", False

    def __init__(self, mode: str = "zeros"):
        if mode not in ("zeros", "stale"):
            raise ValueError(f"dropout mode must be 'zeros' or 'stale', got {mode!r}")
        self.mode = mode
        self.stale: dict[int, torch.Tensor] = {}

    def forge(self, tensor, rank, view):
        if self.mode == "zeros":
            return torch.zeros_like(tensor)
        frozen = self.stale.setdefault(rank, tensor.detach().clone())
        if frozen.shape != tensor.shape:
            raise ValueError(
                f"stale dropout on rank {rank}: first tensor was {tuple(frozen.shape)}, now {tuple(tensor.shape)}"
            )
        return frozen.clone()

    def state_dict(self) -> dict:
        return {"stale": {r: t.clone() for r, t in self.stale.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.stale = {int(r): t.clone() for r, t in state.get("stale", {}).items()}


@dataclass
class Straggler:
    """Sends its honest tensor, but only after sleeping `delay` seconds."""

    delay: float
    name, omniscient = "straggler", False

    def __post_init__(self):
        if not 0 <= self.delay < float("inf"):
            raise ValueError(f"straggler delay must be a finite number of seconds >= 0, got {self.delay!r}")

    def forge(self, tensor, rank, view):
        time.sleep(self.delay)
        return tensor


class LabelFlip:
    """Data-side: a Byzantine rank trains on flipped targets (y -> C - 1 - y); tensors pass unchanged.

    `classes` is C; None takes the task's class count where the job knows it (the built-in tasks)."""

    name, omniscient = "label-flip", False

    def __init__(self, classes: int | None = None):
        if classes is not None and classes < 2:
            raise ValueError(f"label-flip classes must be >= 2, got {classes}")
        self.classes = classes

    def forge(self, tensor, rank, view):
        return tensor


def flip_targets(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """y -> C - 1 - y for integer targets in [0, C); negative targets (ignore_index) stay as they are.
    With C = 256 this is byte -> 255 - byte for byte-level language-model targets."""
    if targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"label flipping needs integer class targets, got {targets.dtype}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if targets.numel() and int(targets.max()) >= num_classes:
        raise ValueError(f"target {int(targets.max())} is outside [0, {num_classes}); check num_classes")
    return torch.where(targets >= 0, num_classes - 1 - targets, targets)
