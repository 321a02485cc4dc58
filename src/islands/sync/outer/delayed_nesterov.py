"""The delayed Nesterov outer step of asynchronous local SGD (arXiv 2401.09135, "DN").

Why: with asynchronous islands every pushed pseudo-gradient is applied on its own, and a Nesterov momentum that is
updated at every push compounds stale directions (the paper's finding for naive async DiLoCo). The delayed form keeps
the momentum for N pushes and updates it once from their mean, while every push still moves the model by its own
gradient term, so islands always pull a model that holds their work:

    each push g (scaled by lr_scale):   params -= lr * g / N ;   acc += g ;   count += 1
    at every N-th push:                 m = momentum * m + acc / N ;   params -= lr * momentum * m ;   acc = 0

Over N pushes the model moves by lr * (mean(g) + momentum * m_new): exactly one synchronous Nesterov outer step on
the mean of the N pseudo-gradients (OuterSGD(lr, momentum, nesterov=True) on that mean). N = 1 is Nesterov at every
push (the paper's failing baseline). State per slice [lo, hi), so the server's parameter-range shards and DiLoCo's
fragments each keep their own count.
"""

from __future__ import annotations

import torch


class DelayedNesterov:
    """The OuterOptimizer protocol (outer_opt.py): step(params, delta, lo, hi, lr_scale), state_dict, load_state_dict.
    `lr`: the outer lr; `momentum` in [0, 1); `buffer` N >= 1: pushes per momentum update (the paper sets it near
    the number of islands)."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, buffer: int = 1):
        if not lr > 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer (pushes per momentum update) must be an int >= 1, got {buffer!r}")
        self.lr, self.momentum, self.buffer = float(lr), float(momentum), buffer
        self.m: torch.Tensor | None = None  # the momentum, over the whole vector
        self.acc: torch.Tensor | None = None  # the scaled pushes since the last momentum update
        self.count: dict[tuple[int, int], int] = {}  # pushes since the last update, per slice

    @torch.no_grad()
    def step(
        self, params: torch.Tensor, delta: torch.Tensor, lo: int = 0, hi: int | None = None, lr_scale: float = 1.0
    ) -> None:
        hi = params.numel() if hi is None else hi
        if self.m is None or self.acc is None:
            self.m, self.acc = torch.zeros_like(params), torch.zeros_like(params)
        g = delta.to(torch.float32) * lr_scale
        params[lo:hi].sub_(g, alpha=self.lr / self.buffer)
        self.acc[lo:hi].add_(g)
        n = self.count.get((lo, hi), 0) + 1
        if n == self.buffer:
            m = self.m[lo:hi]
            m.mul_(self.momentum).add_(self.acc[lo:hi], alpha=1.0 / self.buffer)
            params[lo:hi].sub_(m, alpha=self.lr * self.momentum)
            self.acc[lo:hi].zero_()
            n = 0
        self.count[(lo, hi)] = n

    def state_dict(self) -> dict:
        return {
            "momentum_buffer": None if self.m is None else self.m.clone(),
            "accumulated": None if self.acc is None else self.acc.clone(),
            "count": [[lo, hi, n] for (lo, hi), n in sorted(self.count.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        m, acc = state.get("momentum_buffer"), state.get("accumulated")
        self.m = None if m is None else m.to(torch.float32).clone()
        self.acc = None if acc is None else acc.to(torch.float32).clone()
        self.count = {(int(lo), int(hi)): int(n) for lo, hi, n in state.get("count", [])}
