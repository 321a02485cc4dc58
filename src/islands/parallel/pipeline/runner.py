"""Run one pipeline stage's schedule for a batch: forwards, backwards, and the tensors between stages.

Activations go to the next stage and gradients to the previous one point to point through the counted
Comm (kinds `pipeline_activation` and `pipeline_gradient`), so the ledger holds every byte. Sends are
started and awaited at the end of the step, receives block: with blocking sends, 1F1B's steady state
(stage s sends an activation forward while stage s+1 sends a gradient back) could wait on itself.

Every rank calls `step(x, y)` with the same batch. Only stage 0 reads x's values and only the last stage
reads y; the other stages use x's shape to know what arrives (pieces keep the batch as dimension 0).
The loss of micro-batch i is weighted by its share of the batch, so the summed loss and the gradients
equal those of one pass over the whole batch (mean-reduced loss, equal micro-batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from islands.parallel.pipeline.memory import SavedTensorMeter
from islands.parallel.pipeline.pieces import Stage
from islands.parallel.pipeline.schedule import schedule_for
from islands.runtime.contracts import Collectives, PointToPoint

ACTIVATION, GRADIENT = "pipeline_activation", "pipeline_gradient"


@runtime_checkable
class StagePeers(PointToPoint, Protocol):
    """What the runner sends through: a point-to-point Comm that also starts a send without awaiting it (Comm,
    SimComm, AuthenticatedComm)."""

    def exchange_async(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ) -> tuple[dict[int, torch.Tensor], Callable[[], None]]: ...


def split_batch(t: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """M equal micro-batches along dimension 0, each its own storage (so held bytes are its own)."""
    if t.shape[0] % microbatches:
        raise ValueError(
            f"a batch of {t.shape[0]} does not split into {microbatches} equal micro-batches; "
            f"choose a divisor of {t.shape[0]}"
        )
    return [c.clone() for c in t.chunk(microbatches)]


class PipelineRunner:
    def __init__(
        self,
        pieces: list[nn.Module],
        stage: Stage,
        comm: Collectives | None,
        schedule: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        if stage.count > 1 and comm is None:
            raise ValueError("a pipeline of more than one stage needs a Comm over its stages' ranks")
        if comm is not None and comm.size != stage.count:
            raise ValueError(
                f"the Comm joins {comm.size} ranks but the pipeline has {stage.count} stages; "
                "run one stage per rank of the group"
            )
        self.comm: StagePeers | None = None  # None: one stage, nothing to send
        if stage.count > 1:
            if not isinstance(comm, StagePeers):
                raise TypeError(
                    f"a pipeline's stages send point to point (exchange_async); {type(comm).__name__} does not"
                )
            self.comm = comm
        self.pieces, self.stage, self.loss_fn = pieces, stage, loss_fn
        self.schedule_name = schedule
        self.plan = schedule_for(schedule)
        self.meter = SavedTensorMeter(stage.parameters())
        self._shapes: dict[tuple, tuple] = {}
        self.wait_seconds = 0.0  # last step: time blocked on a message (the bubble plus transfer time)

    def _peers(self) -> StagePeers:
        assert self.comm is not None  # only a pipeline of 2+ stages talks, and __init__ made it have a Comm
        return self.comm

    def _boundary(self, sample: torch.Tensor) -> tuple:
        """(input shape, input dtype, output shape, output dtype) of this stage for one sample."""
        key = (tuple(sample.shape), sample.dtype)
        if key not in self._shapes:
            with torch.no_grad():
                x = sample
                for piece in self.pieces[: self.stage.start]:
                    x = piece(x)
                inp = x
                for piece in self.pieces[self.stage.start : self.stage.stop]:
                    x = piece(x)
            self._shapes[key] = (tuple(inp.shape[1:]), inp.dtype, tuple(x.shape[1:]), x.dtype)
        return self._shapes[key]

    def step(self, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> torch.Tensor | None:
        """One batch through the pipeline; gradients accumulate on this stage's parameters.
        Returns the batch's loss on the last stage (detached), None elsewhere."""
        st = self.stage
        batch = x.shape[0]
        xs = split_batch(x, microbatches) if st.is_first else None
        ys = split_batch(y, microbatches) if st.is_last else None
        b = batch // microbatches
        if batch % microbatches:
            raise ValueError(f"a batch of {batch} does not split into {microbatches} equal micro-batches")
        in_shape, in_dtype, out_shape, out_dtype = self._boundary(x[:1])
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        waits, loss_sum = [], None
        self.wait_seconds = 0.0
        for kind, i in self.plan(st.index, st.count, microbatches):
            if kind == "F":
                if xs is not None:  # the first stage
                    inp = xs[i]
                else:
                    like = torch.empty((b, *in_shape), dtype=in_dtype)
                    inp = self._recv(st.index - 1, like, ACTIVATION)
                    inp.requires_grad_(inp.is_floating_point())
                with self.meter.forward_of(i):
                    out = st(inp)
                    if ys is not None:  # the last stage
                        out = self.loss_fn(out, ys[i]) * (b / batch)
                self.meter.hold(i, inp)
                if not st.is_last:
                    self.meter.hold(i, out)
                    waits.append(self._peers().exchange_async({st.index + 1: out.detach()}, [], kind=ACTIVATION)[1])
                held[i] = (inp, out)
            else:
                inp, out = held.pop(i)
                if st.is_last:
                    out.backward()
                    loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
                else:
                    like = torch.empty((b, *out_shape), dtype=out_dtype)
                    grad = self._recv(st.index + 1, like, GRADIENT)
                    torch.autograd.backward(out, grad)
                self.meter.release(i)
                if not st.is_first:
                    assert inp.grad is not None  # a received activation requires grad; backward has run
                    waits.append(self._peers().exchange_async({st.index - 1: inp.grad}, [], kind=GRADIENT)[1])
        t = time.perf_counter()
        for wait in waits:
            wait()
        self.wait_seconds += time.perf_counter() - t
        return loss_sum

    def _recv(self, peer: int, like: torch.Tensor, kind: str) -> torch.Tensor:
        t = time.perf_counter()
        got = self._peers().exchange({}, [peer], like=like, kind=kind)[peer]
        self.wait_seconds += time.perf_counter() - t
        return got
