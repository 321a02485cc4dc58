"""A DDP communication hook that compresses each bucket with any Compressor (LIT-219, SOTA-047/048).

Unlike torch's PowerSGD hook, state is keyed by parameter NAME: a bucket's flat buffer is cut into
its parameters (bucket.parameters() in buffer order, each occupying numel entries) and averaged with
`compress_and_average`, so any number of buckets works on gloo and rebuilt buckets lose nothing.

Overlap with backward: with `overlap=True` every bucket's work runs on one worker thread in the order
DDP hands buckets over. One thread means every rank issues its collectives in the same order (the
failure mode of launching collectives from future callbacks), while backward keeps computing.
"""

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import Tensor

from islands.compress.average import compress_and_average
from islands.compress.base import Compressor
from islands.compress.error_feedback import with_error_feedback
from islands.runtime.comm import Comm, as_comm


class CompressionHookState:
    """The `state` object DDP passes to the hook; checkpoint it with state_dict()/load_state_dict()."""

    def __init__(
        self, compressor: Compressor, comm: Comm, named_parameters: Iterable[tuple[str, Tensor]], overlap: bool = True
    ):
        self.compressor = compressor
        self.comm = comm
        self.by_id: dict[int, str] = {}
        self.by_ptr: dict[int, str] = {}
        for name, p in named_parameters:
            self.by_id[id(p)] = name
            self.by_ptr[p.data_ptr()] = name
        if not self.by_id:
            raise ValueError("ddp_comm_hook needs the model's named_parameters(); got none")
        self.overlap = overlap
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="islands-compress") if overlap else None

    def name_of(self, p: Tensor) -> str:
        name = self.by_id.get(id(p)) or self.by_ptr.get(p.data_ptr())
        if name is None:
            raise KeyError(
                f"a bucket parameter of shape {tuple(p.shape)} is not in the named_parameters given to ddp_comm_hook"
            )
        return name

    def split(self, buffer: Tensor, params: list[Tensor]) -> dict[str, Tensor]:
        """Bucket buffer -> {parameter name: gradient view}, in buffer order."""
        total = sum(p.numel() for p in params)
        if total != buffer.numel():
            raise RuntimeError(f"bucket buffer has {buffer.numel()} entries but its parameters hold {total}")
        out, offset = {}, 0
        for p in params:
            out[self.name_of(p)] = buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    named = state.split(buffer, list(bucket.parameters()))
    fut: torch.futures.Future = torch.futures.Future()

    def work() -> None:
        try:
            compress_and_average(named, state.comm, state.compressor, out=named)  # the bucket, averaged in place
            fut.set_result(buffer)
        except BaseException as exc:  # noqa: BLE001 - surfaces in loss.backward() on this rank
            fut.set_exception(exc)

    if state._executor is not None:
        state._executor.submit(work)
    else:
        work()
    return fut


def ddp_comm_hook(compressor: Compressor, comm, named_parameters: Iterable[tuple[str, Tensor]], overlap: bool = True):
    """(state, hook) for `ddp_model.register_comm_hook(state, hook)`; bytes go to comm's ledger.

    `comm`: an islands Comm, or a torch process group (or None for the default group), as torch's own hooks
    take. `named_parameters`: the model's `named_parameters()` (of the module DDP wraps, or the DDP module).
    A compressor built with error feedback (`ef`, on by default for the biased ones) gets it here.
    """
    return CompressionHookState(with_error_feedback(compressor), as_comm(comm), named_parameters, overlap), _hook
