"""The Trainer's callbacks: a CallbackList sorted by `order`, also when the user assigns a plain list."""

import torch
from torch import nn

from islands import Trainer
from islands.runtime.world import World


class Seen:
    def __init__(self, name, order, log):
        self.name, self.order, self.log = name, order, log

    def on_fit_start(self, trainer):
        self.log.append(self.name)


def test_a_plain_list_assigned_to_callbacks_runs_in_order():
    model = nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, data, world=World.single()
    )
    log: list[str] = []
    trainer.callbacks = [Seen("late", 5, log), Seen("early", -5, log)]  # a plain list, out of order
    trainer.fit(2)
    assert log == ["early", "late"]
    assert trainer.step == 2
