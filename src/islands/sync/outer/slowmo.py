"""SlowMo (LIT-373): an outer heavy-ball momentum step over the islands' averaged iterates.

Every H steps: delta = global - mean(local), buf = momentum * buf + delta, global -= slow_lr * buf,
and every island restarts from global. It is the DiLoCo engine with heavy-ball instead of Nesterov
momentum and SlowMo's own defaults (slow_lr 1, momentum 0.5); with momentum 0 and slow_lr 1 it is
local SGD. LIT-373 divides the delta by the inner learning rate and multiplies the step by it
again; with a constant inner rate the two cancel, and ours changes every step, so we leave both out.
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.outer_opt import OuterSGD


class SlowMo(DiLoCo):
    name = "slowmo"

    def __init__(
        self,
        every: int = 8,
        slow_lr: float = 1.0,
        momentum: float = 0.5,
        compressor: Compressor | None = None,
        aggregator: Aggregator | None = None,
    ):
        """`every` H: local steps between outer steps. `slow_lr`: the outer (slow) learning rate. `momentum`: slow
        heavy-ball momentum over the averaged iterates. `compressor`/`aggregator`: as DiLoCo's."""
        super().__init__(
            inner_steps=every,
            outer_optimizer=OuterSGD(slow_lr, momentum),
            exchange=Exchange("outer_delta", aggregator=aggregator, compressor=compressor),
        )
