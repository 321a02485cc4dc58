"""The Trainer's callbacks (islands.loop.callbacks and the user's own), in their order, and what the loop asks of
them: the three hooks, their parts of the run record, their checkpointed states, the checkpoint driver.

A callback without `order` counts as 50 (lower first); on_fit_end follows `end_order` where one is given.
Adding one makes a new list, so a hook that adds a callback does not change the list being run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def order(cb: Any, end: bool = False) -> int:
    return getattr(cb, "end_order", getattr(cb, "order", 50)) if end else getattr(cb, "order", 50)


class CallbackList(list):
    """A list of callbacks, sorted by `order` when made."""

    def __init__(self, callbacks: Iterable = ()):
        super().__init__(sorted(callbacks, key=order))

    def added(self, callback: Any) -> CallbackList:
        """A new list with `callback` in its `order` among these."""
        return CallbackList([*self, callback])

    def fit_start(self, trainer: Any) -> None:
        for cb in self:
            if hasattr(cb, "on_fit_start"):
                cb.on_fit_start(trainer)

    def step_end(self, trainer: Any) -> None:
        """on_step_end(trainer, loss); one that says it does not read the loss gets None (no wait on the device)."""
        for cb in self:
            if hasattr(cb, "on_step_end"):
                cb.on_step_end(trainer, trainer.loss if getattr(cb, "reads_loss", True) else None)

    def fit_end(self, trainer: Any) -> None:
        for cb in sorted(self, key=lambda c: order(c, end=True)):
            if hasattr(cb, "on_fit_end"):
                cb.on_fit_end(trainer)

    def records(self) -> dict:
        """Each callback's part of the run record (its `record()`, under `record_key` or its lowercase class name)."""
        parts = {}
        for cb in self:
            extra = getattr(cb, "record", None)
            if callable(extra):
                part = extra()
                if part is not None:
                    parts[getattr(cb, "record_key", type(cb).__name__.lower())] = part
        return parts

    def states(self) -> dict:
        """What a checkpoint keeps under "callbacks": class name -> state_dict(), of those that can load it back."""
        return {
            type(cb).__name__: cb.state_dict()
            for cb in self
            if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")
        }

    def load_states(self, saved: dict) -> None:
        for cb in self:
            state = saved.get(type(cb).__name__)
            if state is not None and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state)

    def driver(self) -> Any:
        """The checkpoint driver of a Checkpointing callback, if any."""
        for cb in self:
            driver = getattr(cb, "driver", None)
            if driver is not None:
                return driver
        return None
