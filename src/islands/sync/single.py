"""The reference: one process, no communication."""

from islands.sync.base import NoOp, refuse_alone_in_elastic


class Single(NoOp):
    name = "single"

    def wrap(self, model, optimizer, world):
        refuse_alone_in_elastic(self, world)
        return model
