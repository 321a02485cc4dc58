"""The reference: one process, no communication."""

from islands.sync.base import NoOp


class Single(NoOp):
    name = "single"
