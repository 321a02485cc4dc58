"""Buffers through the parameter server (issue #36): BatchNorm's running statistics and step counters ride on each
push and come back with each answer, so the islands share them during the run as a synchronous DiLoCo round shares
them (base.OuterStrategy.synced_buffers), not only once at the job's end.

    mine = IslandBuffers.of(model.buffers())         # None when the model has no buffer to carry: nothing is sent
    Message(PUSH, ..., buffers=mine.read())          # one float64 vector: the floating values, then the integer ones
    table = BufferTable(mine.layout)                 # on the server (thread mode's loop; process mode's shard 0,
                                                     # journaled with the pushes: ps_journal.DurableShard)
    table.put(island, vector)                        # each island's latest, replaced by its next push
    table.mean()                                     # floating values: their mean over the islands that pushed;
                                                     # integer ones (num_batches_tracked): the largest; None before any
    mine.adopt(vector)                               # the island takes them as its own (then as the global model's)

float64 carries fp32, fp16 and bf16 values and integer counts below 2**53 exactly, so one vector serves both kinds
and the server needs only the layout (how many of each) to tell them apart. Boolean buffers (constant masks) are not
carried: neither a mean nor a count. Buffers are small next to the parameters (a ResNet-50's BatchNorm statistics
are 53k values against 25.6M parameters), so they travel uncompressed, whatever codec the pushes use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

Layout = tuple[int, int]  # (floating values, integer values) in a buffer vector
NO_BUFFERS: Layout = (0, 0)


def _carried(b: torch.Tensor) -> bool:
    return b.dtype != torch.bool and not b.is_complex()


class IslandBuffers:
    """An island's buffers seen as one float64 vector (module docstring), in the model's buffer order."""

    def __init__(self, buffers: Iterable[torch.Tensor]):
        kept = [b for b in buffers if _carried(b)]
        self.floating = [b for b in kept if b.is_floating_point()]
        self.counts = [b for b in kept if not b.is_floating_point()]

    @classmethod
    def of(cls, buffers: Iterable[torch.Tensor]) -> IslandBuffers | None:
        """The carried buffers, or None when there are none (a model without buffers sends what it sent before)."""
        mine = cls(buffers)
        return mine if mine.floating or mine.counts else None

    @property
    def layout(self) -> Layout:
        return sum(b.numel() for b in self.floating), sum(b.numel() for b in self.counts)

    @property
    def numel(self) -> int:
        return sum(self.layout)

    def read(self) -> torch.Tensor:
        """A float64 copy on the CPU: the floating buffers' values, then the integer ones'."""
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in self.floating + self.counts])

    @torch.no_grad()
    def adopt(self, vector: torch.Tensor) -> None:
        """Write a vector of this layout into the buffers (each keeps its dtype and device: float64 rounds to fp32
        to nearest, counts are whole numbers)."""
        if vector.numel() != self.numel:
            raise ValueError(f"a buffer vector of {vector.numel()} values for buffers of {self.numel}")
        every = self.floating + self.counts
        for b, part in zip(every, vector.split([b.numel() for b in every])):
            b.copy_(part.view(b.shape))


def pushed_vector(island: int, buffers: torch.Tensor | None, numel: int) -> torch.Tensor:
    """The float64 buffer vector a push of a model with `numel` buffer values carries (an island's link checks it
    before sending anything); ValueError for a push without it or with another length."""
    if buffers is None or buffers.numel() != numel:
        raise ValueError(f"island {island}: a push without its {numel} buffer values")
    return buffers.to(torch.float64)


class BufferTable:
    """The server's side: each island's latest buffer vector, and what a pull answers with (module docstring). An
    island that left or lapsed keeps its last vector in the mean, as its last push stays in the model."""

    def __init__(self, layout: Layout):
        self.floating, self.counts = (int(n) for n in layout)
        if self.floating < 0 or self.counts < 0 or self.floating + self.counts == 0:
            raise ValueError(f"a buffer table needs a layout of (floating, integer) values, not all 0; got {layout}")
        self.latest: dict[int, torch.Tensor] = {}

    @property
    def numel(self) -> int:
        return self.floating + self.counts

    def kept(self, island: int, vector: torch.Tensor) -> torch.Tensor:
        """The float64 copy put() keeps; ValueError for another length (a journaled push checks it before its
        record is written: a record that cannot be applied would stop every rebuild)."""
        if vector.numel() != self.numel:
            raise ValueError(f"island {island} pushed {vector.numel()} buffer values to a server of {self.numel}")
        return vector.detach().reshape(-1).to(torch.float64).clone()

    def put(self, island: int, vector: torch.Tensor) -> None:
        self.latest[int(island)] = self.kept(island, vector)

    def mean(self) -> torch.Tensor | None:
        """The floating values' mean over the islands that pushed (summed in island order: the same wherever it
        runs), the integer values' largest; None while no island has pushed."""
        if not self.latest:
            return None
        rows = [self.latest[i] for i in sorted(self.latest)]
        out = torch.zeros(self.numel, dtype=torch.float64)
        f = self.floating
        for row in rows:
            out[:f] += row[:f]
        out[:f] /= len(rows)
        if self.counts:
            out[f:] = torch.stack([row[f:] for row in rows]).amax(0)
        return out

    def state_dict(self) -> dict:
        return {"layout": [self.floating, self.counts], "latest": {i: v.clone() for i, v in self.latest.items()}}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["layout"]) != (self.floating, self.counts):
            raise ValueError(
                f"parameter server checkpoint holds buffers of layout {tuple(state['layout'])}, this server "
                f"{(self.floating, self.counts)}: another model"
            )
        self.latest = {int(i): v.to(torch.float64).clone() for i, v in state["latest"].items()}
