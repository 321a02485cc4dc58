"""1-bit Adam (LIT-278, SOTA-215) and its negative control, NaiveCompressedAdam.

Both run `warmup_steps` of ordinary Adam on gradients averaged uncompressed (fp32 all-reduce), then
switch to 1-bit communication (signs packed 8 per byte + one fp32 scale per tensor, error-compensated
per parameter, averaged across ranks through a Comm's all-gather). They differ only in WHAT is
compressed after warm-up:
  OneBitAdam           freezes Adam's variance v and compresses the momentum m, which is then a
                       linear function of the gradients, so the error compensation stays valid.
  NaiveCompressedAdam  keeps updating v and compresses Adam's update m / (sqrt(v) + eps) directly.
Give the optimizer the LOCAL gradients (no DDP averaging): it does the communication itself.
With comm=None (one process) the compression is still applied, so its effect can be studied alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.identity import NoCompression
from islands.compress.optimizer_base import CommunicatingOptimizer
from islands.compress.sign import ScaledSign
from islands.runtime.contracts import Collectives


class _CompressedAdamBase(CommunicatingOptimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        warmup_steps=100,
        comm: Collectives | None = None,
    ):
        if lr <= 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(
                f"need lr > 0, eps > 0, weight_decay >= 0; got lr={lr}, eps={eps}, weight_decay={weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (v needs data before it is frozen), got {warmup_steps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.warmup_steps = int(warmup_steps)
        self.comm = comm
        self._sign = ScaledSign()

    def _one_bit(self, named: list[tuple[str, Tensor, dict]], values: dict[str, Tensor]) -> dict[str, Tensor]:
        """Error-compensated 1-bit average of `values`: send sign(v + e), keep e = v + e - sent."""
        corrected = {}
        for n, p, _ in named:
            st = self.state[p]
            corrected[n] = values[n] + st["error"]
            st["error"] = corrected[n] - self._sign.decompress(self._sign.compress(corrected[n], {"_name": n}))
        return self._average(corrected, self._sign)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        named = self._named()
        if not named:
            return loss
        for _, p, _ in named:
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["error"] = torch.zeros_like(p, dtype=torch.float32)
            st["step"] += 1
        grads = {n: p.grad.detach().to(torch.float32) for n, p, _ in named}
        warm = self.state[named[0][1]]["step"] <= self.warmup_steps
        if warm:
            grads = self._average(grads, NoCompression())
        self._update(named, grads, warm)
        return loss

    def _decay(self, p: Tensor, group: dict) -> None:
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled (AdamW)


class OneBitAdam(_CompressedAdamBase):
    """Adam whose variance freezes after `warmup_steps`; then 1-bit error-compensated momentum."""

    name = "onebit-adam"  # its optimizer spec's name (islands.compress.optim); DDP records "synced-by-<name>"

    def _update(self, named, grads, warm):
        if not warm:
            ms = {}
            for n, p, group in named:
                st = self.state[p]
                ms[n] = st["exp_avg"].mul(group["betas"][0]).add_(grads[n], alpha=1 - group["betas"][0])
            averaged = self._one_bit(named, ms)
        for n, p, group in named:
            st = self.state[p]
            b1, b2 = group["betas"]
            if warm:
                st["exp_avg"].mul_(b1).add_(grads[n], alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(grads[n], grads[n], value=1 - b2)
            else:
                st["exp_avg"] = averaged[n].to(torch.float32)
            # v stops at warmup_steps, and so does its bias correction
            bias2 = 1 - b2 ** min(st["step"], self.warmup_steps)
            bias1 = 1 - b1 ** st["step"]
            denom = (st["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
            self._decay(p, group)
            p.add_((st["exp_avg"] / bias1 / denom).to(p.dtype), alpha=-group["lr"])


class NaiveCompressedAdam(_CompressedAdamBase):
    """NEGATIVE CONTROL ONLY (SOTA-215): compresses Adam's update directly after warm-up.

    The error compensation assumes the residual means the same thing next step; dividing by a still
    moving sqrt(v) breaks that, and training suffers. It exists so the experiment can show it.
    """

    name = "naive-compressed-adam"

    def _update(self, named, grads, warm):
        updates = {}
        for n, p, group in named:
            st = self.state[p]
            b1, b2 = group["betas"]
            st["exp_avg"].mul_(b1).add_(grads[n], alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(grads[n], grads[n], value=1 - b2)
            denom = (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt_().add_(group["eps"])
            updates[n] = st["exp_avg"] / (1 - b1 ** st["step"]) / denom
        if not warm:
            updates = self._one_bit(named, updates)
        for n, p, group in named:
            self._decay(p, group)
            p.add_(updates[n].to(p.dtype), alpha=-group["lr"])
