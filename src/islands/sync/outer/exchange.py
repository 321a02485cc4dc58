"""The one way outer strategies meet: the mean (or robust aggregate) of a flat vector across islands.

Every byte goes through the `comm` handed to each call (the strategy's `self.comm`, the cross-island
Comm), so a different Comm (an elastic one) can be swapped in without touching the strategies. Paths:
  plain mean      one all-reduce (sum) of the fp32 vector, divided by comm.size
  aggregator      all-gather, then the same robust aggregator on every rank (islands.aggregate)
  compressor      islands.compress.compress_and_average (error-feedback state is per `name`); given a
                  `base` (the last synchronised point, the same bits on every rank), what is compressed
                  is flat - base, and the result is base + mean(flat - base): the local SGD family
                  sends its parameters this way, as a pseudo-gradient, since a compressor that keeps the
                  largest entries of the parameters themselves would keep the wrong ones
  payload codec   a compressor of the PayloadCodec kind (Quant4: 4-bit payloads): all-gather of the payloads;
                  each rank decodes all and averages in rank order
  variable-length codec (Quant4Zstd)  all-gather of each rank's payload length (int64, ledger kind
                  "<kind>_len"), then of the payloads zero-padded to the longest
`sent` lists the bytes this rank handed to the Comm in each exchange of the plain, codec and compressor
paths (length gathers, NaN flags included): the per-synchronisation peak is max(sent).
Every path leaves identical bits on every rank. `start` runs the same exchange on a background
thread so local steps can proceed while it is in flight (LIT-323, LIT-214).

One `compressor=` names how a payload is compressed: an islands.compress compressor (error feedback per island)
or a PayloadCodec (quant4.py, zstd4.py). The older `codec=` spelling lives at the string edge only
(streaming-diloco's bits=4/entropy=zstd and diloco's codec build a PayloadCodec compressor: options.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

from islands.aggregate.coordinate import Mean
from islands.aggregate.distributed import robust_all_reduce
from islands.compress.average import compress_and_average
from islands.compress.error_feedback import with_error_feedback
from islands.sync.outer.quant4 import PayloadCodec


@runtime_checkable
class Stateful(Protocol):
    """A part whose state a checkpoint keeps (a compressor's error feedback, a stateful aggregator)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


T = TypeVar("T")


class Pending(Generic[T]):
    """An exchange in flight; wait() returns its result (and re-raises its error). Made with a future or, for one
    restored from a checkpoint, with its value; T: what it yields (a tensor; Adaptive's round: speeds and mean)."""

    def __init__(self, future: Future[T] | None = None, value: T | None = None):
        self._future, self._value = future, value

    def wait(self) -> T:
        if self._value is None:
            assert self._future is not None, "a Pending holds a future or a value"
            self._value = self._future.result()
            self._future = None
        return self._value


class Exchange:
    def __init__(self, kind: str = "outer_delta", aggregator=None, compressor=None):
        """`kind`: the ledger kind of its bytes (DiLoCo's deltas: outer_delta). `aggregator`: a robust aggregator
        (Mean or None: the plain mean); `compressor`: compresses the vector on the wire, an islands.compress
        compressor (error feedback per island where it asks for it) or a PayloadCodec (Quant4, Quant4Zstd)."""
        if isinstance(aggregator, Mean):
            aggregator = None
        if compressor is not None and aggregator is not None and not isinstance(compressor, PayloadCodec):
            raise ValueError(
                "a compressor and a robust aggregator together are not supported: a robust aggregator "
                "needs each island's uncompressed delta; pick one"
            )
        self.kind = kind
        self.aggregator = aggregator
        self.codec = compressor if isinstance(compressor, PayloadCodec) else None
        self.compressor = with_error_feedback(compressor) if compressor is not None and self.codec is None else None
        self._pool: ThreadPoolExecutor | None = None
        self.sent: list[int] = []  # bytes this rank sent per exchange (all but the aggregator path, comm.size > 1)

    def mean(self, comm, flat: torch.Tensor, name: str = "params", base: torch.Tensor | None = None) -> torch.Tensor:
        """Collective: every rank of comm calls it with a vector of the same size, in the same order. `base`: see the
        module docstring (used by the compressor path only; the other paths average `flat` itself)."""
        flat = flat.detach().to(torch.float32).contiguous()
        if self.compressor is not None:
            if base is not None:
                flat = flat - base
            sent: list[int] = []
            mean = compress_and_average({name: flat}, comm, self.compressor, sent=sent)[name].to(torch.float32)
            self._count(comm, sent[0])
            return mean if base is None else mean.add_(base)
        if self.codec is not None:
            return self._gathered(comm, flat, self.codec)
        if self.aggregator is not None:
            return robust_all_reduce(flat, comm, self.aggregator, kind=self.kind)
        out = flat.clone()
        comm.all_reduce(out, kind=self.kind)
        self._count(comm, out.numel() * 4)
        return out.div_(comm.size)

    def _count(self, comm, nbytes: int) -> None:
        if comm.size > 1:
            self.sent.append(int(nbytes))

    def _gathered(self, comm, flat: torch.Tensor, codec: PayloadCodec) -> torch.Tensor:
        payload = codec.encode(flat)
        if codec.variable_length:
            payloads = self._gather_variable(comm, payload)
        else:
            payloads = comm.all_gather(payload, kind=self.kind)
            self._count(comm, payload.numel())
        decoded = [codec.decode(p, flat.numel()) for p in payloads]
        if self.aggregator is not None:
            return self.aggregator.aggregate(decoded).to(torch.float32)
        acc = torch.zeros_like(flat)
        for d in decoded:  # fixed rank order: the same sum, bit for bit, on every rank
            acc += d
        return acc.div_(len(decoded))

    def _gather_variable(self, comm, payload: torch.Tensor) -> list[torch.Tensor]:
        """All-gather uint8 payloads of different lengths: lengths first, then payloads padded to the longest."""
        while True:
            lengths = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64), kind=f"{self.kind}_len")
            lengths = [int(n.item()) for n in lengths]
            epoch = comm.epoch
            longest = max(lengths)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: payload.numel()] = payload
            gathered = comm.all_gather(padded, kind=self.kind)
            self._count(comm, 8 + longest)
            # an elastic Comm whose members changed between the two gathers (islands.runtime.elastic): the
            # lengths are the old members'; every survivor sees the same committed epochs, so all redo both
            if comm.epoch == epoch:
                return [g[:n] for g, n in zip(gathered, lengths)]

    def run(self, fn):
        """fn() in the order of this exchange's collectives: on its background thread, after every exchange
        started before, when it has one (two threads issuing collectives on one group would interleave them
        differently on different ranks); at once otherwise."""
        if self._pool is None:
            return fn()
        return self._pool.submit(fn).result()

    def submit(self, fn: Callable[[], T]) -> Pending[T]:
        """fn() on the background thread, after every exchange started before (as run), without waiting for it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="islands-outer")
        return Pending(self._pool.submit(fn))

    def start(
        self, comm, flat: torch.Tensor, name: str = "params", base: torch.Tensor | None = None
    ) -> Pending[torch.Tensor]:
        """Begin mean() on a background thread; exchanges run one at a time, in call order."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="islands-outer")
        flat = flat.detach().to(torch.float32).clone()  # the caller keeps training on its own copy
        base = base.detach().to(torch.float32).clone() if base is not None else None
        return Pending(self._pool.submit(self.mean, comm, flat, name, base))

    def state_dict(self) -> dict:
        return {
            key: part.state_dict()
            for key, part in (("compressor", self.compressor), ("aggregator", self.aggregator))
            if isinstance(part, Stateful)
        }

    def load_state_dict(self, state: dict) -> None:
        for key, part in (("compressor", self.compressor), ("aggregator", self.aggregator)):
            if key in state and isinstance(part, Stateful):
                part.load_state_dict(state[key])
