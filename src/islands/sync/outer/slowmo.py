"""SlowMo (LIT-373): an outer heavy-ball momentum step over the islands' averaged iterates.

Every H steps: delta = global - mean(local), buf = momentum * buf + delta, global -= slow_lr * buf,
and every island restarts from global. It is the DiLoCo engine with heavy-ball instead of Nesterov
momentum and SlowMo's own defaults (slow_lr 1, momentum 0.5); with momentum 0 and slow_lr 1 it is
local SGD. LIT-373 divides the delta by the inner learning rate and multiplies the step by it
again; with a constant inner rate the two cancel, and ours changes every step, so we leave both out.
"""

from __future__ import annotations

from islands.sync.outer.diloco import DiLoCo


class SlowMo(DiLoCo):
    name = "slowmo"

    def __init__(self, total_steps: int, every: int = 8, slow_lr: float = 1.0, momentum: float = 0.5,
                 compress: str = "none", aggregate: str = "mean"):
        super().__init__(total_steps, inner_steps=every, outer="sgd", outer_lr=slow_lr, momentum=momentum,
                         compress=compress, aggregate=aggregate)
