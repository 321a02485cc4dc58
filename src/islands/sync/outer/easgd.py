"""Elastic averaging SGD (LIT-370): islands are pulled toward a centre that is pulled toward them.

Synchronous form, every `every` steps, with n islands and alpha = beta / n (LIT-370 holds the
total elastic strength beta = n * alpha fixed as n grows; our default beta 0.9 keeps the centre
update a contraction, 0 < beta <= 1):
    centre <- centre + alpha * sum_i (x_i - centre) = centre + beta * (mean(x) - centre)
    x_i    <- x_i - alpha * (x_i - centre_old)
One all-reduce of the parameters per round gives mean(x); every island updates the identical
centre. The centre is the global model that evaluation reports. Islands never jump to the centre,
so they may explore apart; that is the point of the method.
"""

from __future__ import annotations

from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.exchange import Exchange


class EASGD(OuterStrategy):
    name = "easgd"

    def __init__(self, total_steps: int, every: int = 4, beta: float = 0.9, aggregate: str = "mean"):
        super().__init__(total_steps)
        if every < 1 or not 0 < beta <= 1:
            raise ValueError(f"need every >= 1 and beta in (0, 1]; got every={every}, beta={beta}")
        self.every, self.beta = int(every), float(beta)
        self.exchange = Exchange("outer_params", aggregate=aggregate)

    def after_step(self, model, optimizer, step):
        if (step + 1) % self.every == 0 or self.is_last(step):
            self.elastic_round()

    def elastic_round(self) -> None:
        alpha = self.beta / self.comm.size
        x = self.local.read()
        mean = self.exchange.mean(self.comm, x)
        centre_old = self.global_flat
        x.sub_(x - centre_old, alpha=alpha)
        self.global_flat = centre_old + self.beta * (mean - centre_old)
        self.local.write(x)
        self.publish()
        self.rounds += 1

    def extra_state(self) -> dict:
        return {"exchange": self.exchange.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.exchange.load_state_dict(state.get("exchange", {}))
