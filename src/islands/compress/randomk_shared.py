"""Random-k with a shared seed: every rank keeps the same k positions in a round, so only values travel.

RandomK (randomk.py) draws positions per rank and must send them (and all-gather). Here the positions
of round t for tensor `name` come from a generator seeded by (seed, t, name), identical on every rank, so
the k kept values of all ranks line up and are summed by one all-reduce: k values per tensor on the
wire (4k bytes in fp32), no indices, and the payload is SUMMABLE. The positions ride along in
`Payload.shared` (known everywhere, never resent). The round counter t lives in the per-name state, so
it is checkpointed and a resumed run draws the same positions.

Scaling, stated: `rescale=0` (default) sends the kept values as they are. The decoded tensor is then
biased (it drops n - k entries) but contractive, ||x - C(x)||^2 = ||x||^2 - ||x_kept||^2, and error
feedback is exact (the residual is x with the kept entries set to zero), so error feedback is on by
default. `rescale=1` multiplies the kept values by n/k, which makes the decoded tensor an unbiased
estimate of x but not contractive; error feedback is then refused (ef=0 is required).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from islands.compress import pages
from islands.compress.base import Agreed, Combine, CompressorBase, Payload, as_fp32, name_seed, numel_of


class SharedRandomK(CompressorBase):
    name = "randomk-shared"
    combine = Combine.SUMMABLE

    def __init__(self, ratio: float = 0.01, seed: int = 0, rescale: bool = False, ef: bool = True):
        """The same random positions on every rank each round, so only values travel, summed by one all-reduce. `ratio`:
        fraction of the entries sent. `seed`: with the round and the tensor's name, seeds the positions (identical on
        every rank). `rescale`: multiply the values by n/k (unbiased, and then error feedback must be off). `ef`: error
        feedback around it (on by default: unscaled, it is contractive and its residual exact)."""
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{self.name} ratio (fraction of entries sent) must be in (0, 1], got {ratio!r}")
        if rescale and ef:
            raise ValueError(
                f"{self.name}: rescale=1 makes it unbiased but not contractive, so error feedback would "
                "grow without bound; use rescale=0 (the default) with ef=1, or rescale=1 with ef=0"
            )
        self.ratio, self.seed, self.rescale, self.ef = float(ratio), int(seed), bool(rescale), bool(ef)
        self.contractive = not self.rescale

    def k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, min(numel, math.ceil(self.ratio * numel - 1e-9)))

    def init_state(self, name: str, tensor: Tensor) -> dict:
        return {"round": 0}

    def positions(self, name: str, round_: int, numel: int, device: torch.device | str = "cpu") -> Tensor:
        """The k positions of round `round_` for tensor `name`, sorted: the same on every rank. A uniformly random
        k-subset: for small k, the distinct values of a few uniform draws (given its size, a uniform subset) thinned
        to k by a random permutation, which costs O(k log k) where a permutation of all n would cost O(n)."""
        g = torch.Generator(device="cpu").manual_seed(name_seed(self.seed * 1_000_003 + round_, name))
        k = self.k(numel)
        if 8 * k >= numel:
            idx = torch.randperm(numel, generator=g)[:k]
        else:
            idx = torch.zeros(0, dtype=torch.int64)
            while idx.numel() < k:
                idx = torch.unique(torch.cat([idx, torch.randint(0, numel, (k + k // 8 + 16,), generator=g)]))
            idx = idx[torch.randperm(idx.numel(), generator=g)[:k]]
        return idx.sort().values.to(device)

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        x = as_fp32(tensor).reshape(-1)
        n = x.numel()
        idx = self.positions(state.get("_name", ""), state["round"], n, x.device)
        state["round"] += 1
        values = x[idx]
        if self.rescale and n:
            values = values * (n / idx.numel())
        return Payload([values], tensor.shape, tensor.dtype, shared=[idx])

    def decompress(self, payload: Payload) -> Tensor:
        (values,), (idx,) = payload.tensors, payload.shared
        out = pages.zeros(numel_of(payload.shape), device=values.device)
        out[idx] = values.to(torch.float32)
        return out.reshape(payload.shape).to(payload.dtype)

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor:
        """Exact: x with the kept entries zeroed (unscaled, the sent values are x's own there)."""
        if self.rescale:
            return super().subtract_sent(x, payload)
        if x.is_contiguous():  # in place: the payload holds copies of x's values, never x's memory
            x.view(-1)[payload.shared[0]] = 0.0
            return x
        out = x.reshape(-1).clone()
        out[payload.shared[0]] = 0.0
        return out.reshape(x.shape)

    def payload_nbytes(self, shape, dtype: torch.dtype) -> int:
        return 4 * self.k(numel_of(shape))
