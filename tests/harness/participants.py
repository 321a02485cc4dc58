"""Stand-ins for an outer strategy as the elastic membership sees it, for tests that drive a Membership on a store in a
dict: a holder (runtime.contracts.Holder) that is its own round-counting participant (ElasticParticipant), and one
that is also served (ServedParticipant: its joiner's step comes from its service)."""

from __future__ import annotations


class Outer:
    """The holder and its round-counting participant (runtime.contracts.Holder and ElasticParticipant)."""

    rounds = 0

    def eval_model(self, model):
        return model

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def settle(self) -> None:
        pass

    def joined(self) -> None:
        pass


class Served(Outer):
    """A holder and a served participant: its own rounds, its joiner's step from its service."""

    def __init__(self, step: int = 0):
        self.step = step

    def entry_step(self) -> int:
        return self.step
