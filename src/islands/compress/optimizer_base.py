"""What the optimizers that communicate themselves share (1-bit Adam, its control, split-moment AdamW).

They take LOCAL gradients and average what they need through a Comm, compressed; with comm=None (one
process) the compression round trip alone is applied, so its effect can be studied without a world.
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.average import compress_and_average
from islands.runtime.contracts import Collectives


class CommunicatingOptimizer(torch.optim.Optimizer):
    comm: Collectives | None

    @staticmethod
    def _closure_loss(closure):
        """torch.optim's closure contract: re-evaluate the loss with gradients on, if given one."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _named(self) -> list[tuple[str, Tensor, dict]]:
        """(stable name "group.index", parameter, its group) for every parameter that has a gradient."""
        return [
            (f"{gi}.{pi}", p, g)
            for gi, g in enumerate(self.param_groups)
            for pi, p in enumerate(g["params"])
            if p.grad is not None
        ]

    def _average(self, tensors: dict[str, Tensor], compressor) -> dict[str, Tensor]:
        if self.comm is None:
            return {
                n: compressor.decompress(compressor.compress(t, compressor.state(n, t))).float()
                for n, t in tensors.items()
            }
        return compress_and_average(tensors, self.comm, compressor)
