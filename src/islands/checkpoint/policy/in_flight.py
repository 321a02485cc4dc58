"""The checkpoint driver's saves in flight (islands.checkpoint.policy.driver): each save is snapshotted once and
persisted in the background by an AsyncCheckpointer (one persist at a time); this keeps their handles until
they are known durable, adds up what training stalled for and what the persists cost, and tells apart a
save a membership change abandoned (elastic: counted, not fatal) from one that failed (raised).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from islands.checkpoint.policy.elastic_saves import MembershipChanged
from islands.checkpoint.policy.sharded_state import is_sharded
from islands.checkpoint.store import SaveResult
from islands.checkpoint.store.async_writer import AsyncCheckpointer, SaveHandle, Sink


class InFlightSaves:
    def __init__(self, sink: Sink, asynchronous: bool):
        """`sink`: what the persist thread hands each snapshot to; `asynchronous`: False makes every save
        wait for its persist (and count all of it as stall)."""
        self.writer = AsyncCheckpointer(sink, when_busy="wait")
        self.asynchronous = asynchronous
        self.handles: list[SaveHandle] = []
        self.stall_s = self.persist_s = 0.0
        self.disk_bytes = {"written": 0, "deduped": 0, "shared": 0}  # see SaveResult
        self.abandoned: list[int] = []  # steps whose save a membership change abandoned (elastic)
        self.abandoned_why: list[str] = []
        self._reserve_tried = False

    @property
    def busy(self) -> bool:
        """A persist is running."""
        return self.writer.in_flight is not None

    def reserve_once(self, tree: Callable[[], dict], save_due: bool, model: torch.nn.Module) -> None:
        """After the first step (the optimizer has its state by then), make the staging buffers of the
        snapshots in the background, unless a save is due at once (it would only wait for them) or the
        state is sharded (its tree is gathered: a collective, not worth a second one at the start)."""
        if self._reserve_tried:
            return
        self._reserve_tried = True
        if self.asynchronous and not save_due and not is_sharded(model):
            self.writer.reserve(tree())

    def start(
        self, tree: dict, step: int, names: list[str], wait: bool, **kwargs
    ) -> tuple[SaveHandle, SaveHandle | None]:
        """Snapshot `tree` as step `step` of the levels `names`; returns its handle and the save before it.
        `wait`: wait for this persist even when saving asynchronously."""
        previous = self.handles[-1] if self.handles else None
        handle = self.writer.save(tree, step, levels=names, **kwargs)
        handle.levels = names
        if not self.asynchronous or wait:
            handle.wait()
            if not self.asynchronous:
                handle.stall_s += handle.persist_s  # a blocking save stalls for all of it
        return handle, previous

    def track(self, handle: SaveHandle, previous: SaveHandle | None) -> None:
        """Keep `handle` (dropping finished ones), count its stall and, once done, the previous save's cost."""
        self.handles = [h for h in self.handles if not h.done()] + [handle]
        self.stall_s += handle.stall_s
        self.account(previous)

    def account(self, previous: SaveHandle | None) -> None:
        if previous is not None and previous.done():
            self.persist_s += previous.persist_s
            results: dict = previous.result or {}
            for res in results.values():  # disk levels: this rank's bytes, per save
                if isinstance(res, SaveResult):
                    for key in self.disk_bytes:
                        self.disk_bytes[key] += getattr(res, f"bytes_{key}")

    def raise_failed(self, abandoned: Callable[[SaveHandle], None]) -> None:
        """Drop the saves a membership change abandoned (each handed to `abandoned`); raise a failed one's error."""
        for h in list(self.handles):
            if h.done() and isinstance(h.error, MembershipChanged):  # elastic: abandoned, not fatal
                self.abandoned.append(h.step)
                self.abandoned_why.append(f"step {h.step}: {h.error}")
                self.handles.remove(h)
                abandoned(h)
            elif h.done() and h.error is not None:
                raise RuntimeError(f"checkpoint of step {h.step} failed: {h.error!r}") from h.error

    def drain(self) -> None:
        """Wait until no persist runs; the wait counts as stall."""
        start = time.perf_counter()
        self.writer.wait()
        self.stall_s += time.perf_counter() - start

    def close(self) -> None:
        """Wait for every persist and stop the writer; the last save's cost is counted."""
        self.writer.close()
        if self.handles:
            self.account(self.handles[-1])
