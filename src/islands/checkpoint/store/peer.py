"""Peer copies of the in-memory level (SOTA-057): rank r's packed checkpoint is also held by rank (r+1) % n.

A memory checkpoint dies with its process. Shipping it to the next rank means a single lost rank
can be restored from its successor's memory instead of from disk, so the work lost to a process
failure is bounded by the memory level's interval rather than the disk level's (LIT-059's argument
for a cheap, frequent tier). Both directions are collectives over a counted Comm (ledger kind
`ckpt_replicate`): every rank calls them at the same steps, in the same order.

`replicate(step, data)` sends this rank's bytes to its successor and keeps its predecessor's.
`recover()` is the way back: each rank returns the copy it holds to its owner and receives its own.
A rank that lost its memory (a replacement process) passes nothing and gets its state back.
"""

from __future__ import annotations

import numpy as np
import torch

from islands.runtime.comm import Comm

KIND = "ckpt_replicate"


class PeerReplica:
    """Holds the predecessor's newest memory checkpoint; ships this rank's to the successor."""

    def __init__(self, comm: Comm, kind: str = KIND):
        self.comm, self.kind = comm, kind
        self.held: bytes | None = None  # the predecessor's packed checkpoint
        self.held_step: int | None = None
        self.bytes_sent = self.bytes_received = 0

    @property
    def successor(self) -> int:
        return (self.comm.rank + 1) % self.comm.size

    @property
    def predecessor(self) -> int:
        return (self.comm.rank - 1) % self.comm.size

    def _shift(self, data: bytes | None, step: int | None, to: int, frm: int) -> tuple[bytes | None, int | None]:
        """Send (data, step) to rank `to`, receive the same from rank `frm`: sizes first, then bytes."""
        n = 0 if data is None else len(data)
        head = torch.tensor([n, -1 if step is None else step], dtype=torch.int64)
        got_head = self.comm.exchange({to: head}, [frm], kind=self.kind)[frm]
        m, got_step = int(got_head[0]), int(got_head[1])
        sends = {to: torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())} if data else {}  # data: n bytes
        recv = [frm] if m else []
        if sends or recv:
            got = self.comm.exchange(sends, recv, like=torch.empty(m, dtype=torch.uint8), kind=self.kind)
        self.bytes_sent += n
        self.bytes_received += m
        if not m:
            return None, None
        return got[frm].numpy().tobytes(), (None if got_step < 0 else got_step)

    def replicate(self, step: int, data: bytes) -> None:
        """Collective: ship `data` (this rank's checkpoint of `step`) on; keep the predecessor's."""
        if self.comm.size < 2:
            return
        self.held, self.held_step = self._shift(data, step, self.successor, self.predecessor)

    def recover(self) -> tuple[bytes | None, int | None]:
        """Collective: every rank gets back the copy its successor holds (bytes, step), or (None, None)."""
        if self.comm.size < 2:
            return None, None
        return self._shift(self.held, self.held_step, self.predecessor, self.successor)

    def forget(self) -> None:
        """Drop the held copy, as a replacement process starts with empty memory."""
        self.held, self.held_step = None, None
