"""AdamW for compressed data parallelism, with its two moments fed from different sources.

Error feedback makes the SUM of what a compressor sends track the sum of the true gradients (SOTA-214),
so Adam's first moment, a linear filter of the gradients, survives compression. Its second moment
does not: the EMA of the squared COMPRESSED gradient is not the EMA of the squared gradient, because
error feedback sends a coordinate's mass late and in bursts (the nonlinearity 1-bit Adam works around
by freezing the variance, LIT-278 / SOTA-215). Here the first moment takes the compressed, error-fed
average; the second moment takes one of:

  "compressed"  the same compressed average (what AdamW behind a compressing DDP hook does)
  "exact"       the uncompressed average, all-reduced in fp32 every step: a diagnostic ORACLE that
                costs ddp's bytes; it says how much of a gap the variance explains
  "local"       each worker's own uncompressed gradient, squared into a local EMA every step (free),
                whose mean over workers is all-reduced every `variance_every` steps in bf16; between
                refreshes every worker uses the last mean, so parameters stay bitwise identical

Give it LOCAL gradients (`islands.inner.DDP` then only broadcasts the start, as for the 1-bit optimizers). It clips the
averaged gradient by its global norm (`clip`), as a ddp run clips after its all-reduce; run the
trainer with grad_clip=0 so local gradients are not clipped first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from islands.compress.base import CompressorBase, check_finite
from islands.compress.optimizer_base import CommunicatingOptimizer
from islands.runtime.contracts import Collectives

VARIANCE_SOURCES = ("compressed", "exact", "local")


class SplitMomentAdamW(CommunicatingOptimizer):
    name = "split-adamw"  # its optimizer spec's name (islands.compress.optim); DDP records "synced-by-<name>"

    def __init__(
        self,
        params,
        compressor: CompressorBase,
        comm: Collectives | None,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        variance: str = "local",
        variance_every: int = 20,
        clip: float = 0.0,
    ):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or clip < 0:
            raise ValueError(
                f"need lr > 0, eps > 0, weight_decay >= 0, clip >= 0; got lr={lr}, eps={eps}, "
                f"weight_decay={weight_decay}, clip={clip}"
            )
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if variance not in VARIANCE_SOURCES:
            raise ValueError(f"variance must be one of {VARIANCE_SOURCES}, got {variance!r}")
        if not isinstance(variance_every, int) or variance_every < 1:
            raise ValueError(
                f"variance_every (steps between variance all-reduces) must be an int >= 1, got {variance_every!r}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.compressor = compressor
        self.comm = comm
        self.variance = variance
        self.variance_every = variance_every
        self.clip = float(clip)

    def _mean(self, tensors: dict[str, Tensor], dtype: torch.dtype, kind: str) -> dict[str, Tensor]:
        """Uncompressed mean over the group, fused into one all-reduce in `dtype`."""
        if self.comm is None or self.comm.size == 1:
            return {n: t.to(dtype).to(torch.float32) for n, t in tensors.items()}
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors.values()])
        self.comm.all_reduce(flat, op=dist.ReduceOp.SUM, kind=kind)
        flat = flat.to(torch.float32) / self.comm.size
        out, offset = {}, 0
        for n, t in tensors.items():
            out[n] = flat[offset : offset + t.numel()].reshape(t.shape)
            offset += t.numel()
        return out

    def _clip_scale(self, tensors: dict[str, Tensor]) -> float:
        if not self.clip:
            return 1.0
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors.values()])))
        return min(1.0, self.clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        named = self._named()
        if not named:
            return loss
        local = {n: p.grad.detach().to(torch.float32) for n, p, _ in named}
        for n, g in local.items():
            check_finite(n, g)
        avg = self._average(local, self.compressor)
        scale = self._clip_scale(avg)
        for _n, p, _group in named:
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if self.variance == "local":
                    st["local_sq"] = torch.zeros_like(p, dtype=torch.float32)
            st["step"] += 1
        step = self.state[named[0][1]]["step"]
        if self.variance == "exact":
            second = self._mean(local, torch.float32, "variance_oracle")
            sq = {n: (g * self._clip_scale(second)).square() for n, g in second.items()}
        else:
            sq = {n: (g * scale).square() for n, g in (local if self.variance == "local" else avg).items()}
        for n, p, group in named:
            st = self.state[p]
            b1, b2 = group["betas"]
            st["exp_avg"].mul_(b1).add_(avg[n], alpha=(1 - b1) * scale)
            target = st["local_sq"] if self.variance == "local" else st["exp_avg_sq"]
            target.mul_(b2).add_(sq[n], alpha=1 - b2)
        if self.variance == "local" and (step == 1 or step % self.variance_every == 0):
            # the shared variance: the mean of the workers' local EMAs, refreshed every K steps in bf16
            shared = self._mean({n: self.state[p]["local_sq"] for n, p, _ in named}, torch.bfloat16, "variance_mean")
            for n, p, _ in named:
                self.state[p]["exp_avg_sq"] = shared[n]
                self.state[p]["variance_step"] = step
        for _n, p, group in named:
            st = self.state[p]
            b1, b2 = group["betas"]
            v_step = st.get("variance_step", step)  # a refreshed mean carries the bias of its own step
            denom = (st["exp_avg_sq"] / (1 - b2**v_step)).sqrt_().add_(group["eps"])
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled (AdamW)
            p.addcdiv_((st["exp_avg"] / (1 - b1**step)).to(p.dtype), denom.to(p.dtype), value=-group["lr"])
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["compressor"] = self.compressor.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.compressor.load_state_dict(state_dict.pop("compressor"))
        super().load_state_dict(state_dict)
