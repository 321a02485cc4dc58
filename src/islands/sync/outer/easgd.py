"""Elastic averaging SGD (LIT-370): islands are pulled toward a centre that is pulled toward them.

Synchronous form, every `every` steps, with n islands and alpha = beta / n (LIT-370 holds the
total elastic strength beta = n * alpha fixed as n grows; our default beta 0.9 keeps the centre
update a contraction, 0 < beta <= 1):
    centre <- centre + alpha * sum_i (x_i - centre) = centre + beta * (mean(x) - centre)
    x_i    <- x_i - alpha * (x_i - centre_old)
One all-reduce of the parameters per round gives mean(x); every island updates the identical
centre. The centre is the global model that evaluation reports. Islands never jump to the centre,
so they may explore apart; that is the point of the method. With a compressor, each island sends
x_i - centre (error feedback per island) and mean(x) is read as centre + mean(x_i - centre).
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.exchange import Exchange


class EASGD(OuterStrategy):
    name = "easgd"

    def __init__(
        self,
        every: int = 4,
        beta: float = 0.9,
        aggregator: Aggregator | None = None,
        compressor: Compressor | None = None,
    ):
        """`every`: local steps between elastic updates. `beta`: total elastic strength; each worker's pull is
        beta / islands (LIT-370), in (0, 1]. `aggregator`: a robust aggregator across islands. `compressor`:
        compresses each island's distance from the centre (error feedback per island)."""
        super().__init__()
        if every < 1 or not 0 < beta <= 1:
            raise ValueError(f"need every >= 1 and beta in (0, 1]; got every={every}, beta={beta}")
        self.every, self.beta = int(every), float(beta)
        self.exchange = Exchange("outer_params", aggregator=aggregator, compressor=compressor)

    def after_step(self, model, optimizer, step):
        self.tick(step)
        if (step + 1) % self.every == 0:
            self.elastic_round()
            self.synced()

    def final_sync(self) -> None:
        self.elastic_round()

    def elastic_round(self) -> None:
        alpha = self.beta / self.comm.size
        x = self.local.read()
        mean = self.exchange.mean(self.comm, x, base=self.global_flat)
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
