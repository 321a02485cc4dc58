"""Centered clipping (Karimireddy, He and Jaggi, 2021): clip every input around the last aggregate.

    v <- v + (1/n) * sum_i (x_i - v) * min(1, tau / |x_i - v|)      repeated `iters` times

The centre v carries over between rounds (it is the previous result), which is what makes the
method use history, and also what makes it fragile: one Inf input turns x_i - v into Inf, the
clip factor into 0, their product into NaN, and the centre stays NaN for ever. Here that cannot
happen: inputs with NaN/Inf are dropped before `combine` (see base.py), the update runs in float64,
and the new centre is stored only after it is checked finite. The first round has no history; the
centre starts at the coordinate-wise median of that round's inputs, which is robust and finite.
"""

from __future__ import annotations

import torch

from islands.aggregate.base import BaseAggregator
from islands.aggregate.coordinate import CoordinateMedian


class CenteredClipping(BaseAggregator):
    name = "cclip"

    def __init__(self, tau: float = 1.0, iters: int = 1):
        super().__init__()
        if not (isinstance(tau, (int, float)) and tau > 0):
            raise ValueError(f"cclip tau (clipping radius) must be a number > 0, got {tau!r}")
        # One iteration per round suffices once the centre carries history (the paper's L = 1).
        if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
            raise ValueError(f"cclip iters must be an integer >= 1, got {iters!r}")
        self.tau, self.iters = float(tau), iters
        self.centre: torch.Tensor | None = None

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.to(torch.float64)
        n, d = x.shape
        if self.centre is None:
            v = CoordinateMedian().combine(x)
        elif self.centre.numel() != d:
            raise ValueError(
                f"cclip centre holds {self.centre.numel()} values but inputs have {d}; "
                "use one CenteredClipping per tensor shape, or call reset()"
            )
        else:
            v = self.centre.to(device=x.device, dtype=torch.float64)
        for _ in range(self.iters):
            step = torch.zeros_like(v)
            for i in range(n):  # row order, so every rank sums identically
                diff = x[i] - v
                norm = float(torch.linalg.vector_norm(diff))
                scale = 1.0 if norm <= self.tau else self.tau / norm
                step = step + diff * (scale / n)
            v = v + step
        out = v.to(rows.dtype)
        if not torch.isfinite(out).all():
            raise FloatingPointError("cclip produced a non-finite centre; the previous centre is kept")
        self.centre = out.detach().clone()
        return out

    def reset(self) -> None:
        self.centre = None

    def state_dict(self) -> dict:
        return {"centre": None if self.centre is None else self.centre.clone()}

    def load_state_dict(self, state: dict) -> None:
        centre = state.get("centre")
        if centre is not None and not torch.isfinite(centre).all():
            raise ValueError("refusing to load a cclip centre holding NaN or Inf")
        self.centre = None if centre is None else centre.clone()

    def __repr__(self) -> str:
        return f"cclip:tau={self.tau:g},iters={self.iters}"
