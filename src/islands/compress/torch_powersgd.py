"""torch's own layer-wise PowerSGD DDP hook, as a reference to measure ours against (SOTA-075).

    islands.inner.DDP(compressor=TorchPowerSGD(rank=4, start=2))      compressor="torch-powersgd:rank=4,start=2"

torch's hook calls torch.distributed itself, so its bytes cannot pass through our Comm. We count
them analytically, per bucket and step, by torch's own rules (`_should_compress` with its
min_compression_rate): before `start` steps the whole bucket is all-reduced; after, uncompressed
tensors plus the P and Q factors (all in the gradient dtype). Time in flight is the span from the
hook's start until its future resolves (compression included, as for our hook).

Known defects worked around (FACTS.md): on gloo it crashes once DDP has two or more buckets, so the
DDP strategy is given one bucket large enough for the whole model and the hook refuses a second
bucket with a clear error; its state is per bucket index (lost if buckets are rebuilt).
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

from islands.runtime.comm import Comm

NAME = "torch-powersgd"
SINGLE_BUCKET_MB = 4096.0  # "one bucket for everything" on any model this project trains


def bucket_nbytes(gradients: list[torch.Tensor], rank: int, min_rate: float, compressing: bool) -> int:
    """Bytes one rank hands to all-reduce for one bucket, by torch's hook's own rules."""
    if not compressing:
        return sum(g.numel() * g.element_size() for g in gradients)
    total = 0
    for g in gradients:
        size = g.element_size()
        n = g.shape[0] if g.dim() else 1
        m = g.numel() // max(n, 1)
        r = min(n, m, rank)
        worth, whole, low = tp._should_compress(n, m, r, min_rate)
        total += (low if worth else whole) * size
    return total


class TorchPowerSGDState:
    """torch's PowerSGDState plus our ledger; checkpointing is torch's (pickled state, per bucket)."""

    def __init__(self, comm: Comm, rank: int, start: int, min_rate: float, seed: int = 0):
        self.comm = comm
        self.rank, self.min_rate = rank, min_rate
        self.torch_state = tp.PowerSGDState(
            process_group=comm.group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start,
            min_compression_rate=min_rate,
            random_seed=seed,
        )

    def state_dict(self) -> dict:
        return {"iter": self.torch_state.iter}

    def load_state_dict(self, state: dict) -> None:
        self.torch_state.iter = int(state["iter"])  # error and Q memories restart empty (torch keeps them per bucket)


def _counted_hook(state: TorchPowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    if bucket.index() > 0:
        raise RuntimeError(
            f"{NAME}: DDP made a second bucket; torch's PowerSGD hook crashes on gloo with two or "
            f"more buckets, so run it with bucket_mb >= the model's gradient size (e.g. {SINGLE_BUCKET_MB:g})"
        )
    ts = state.torch_state
    compressing = ts.iter >= ts.start_powerSGD_iter  # the same test torch's hook makes
    sent = bucket_nbytes(list(bucket.gradients()), state.rank, state.min_rate, compressing)
    ledger = state.comm.ledger
    kind = "torch_powersgd" if compressing else "torch_powersgd_vanilla"
    ledger.record(kind, sent, sent)
    ledger.begin()
    fut = tp.powerSGD_hook(ts, bucket)

    def done(f):
        ledger.end()
        return f.value()

    return fut.then(done)


class TorchPowerSGD:
    """torch's own PowerSGD DDP hook (`powerSGD_hook`), counted in our ledger: the A/B reference for ours.

    Not a Compressor: it replaces DDP's bucket hook as a whole, so `islands.inner.DDP(compressor=...)`
    asks it for `make_hook(comm, model)` and runs DDP with one bucket (`bucket_mb`; FACTS.md: torch's
    hook crashes on gloo with two or more buckets). `start` >= 2 is torch's minimum with error feedback.
    """

    name = NAME
    bucket_mb = SINGLE_BUCKET_MB

    def __init__(self, rank: int = 4, start: int = 2, min_rate: float = 2.0, seed: int = 0):
        if rank < 1 or start < 2 or min_rate <= 0:
            raise ValueError(
                f"{NAME}: need rank >= 1, start >= 2 (torch's minimum with error feedback), min_rate > 0; "
                f"got rank={rank}, start={start}, min_rate={min_rate}"
            )
        self.rank, self.start, self.min_rate, self.seed = int(rank), int(start), float(min_rate), int(seed)

    def make_hook(self, comm: Comm, model: torch.nn.Module):
        return TorchPowerSGDState(comm, self.rank, self.start, self.min_rate, self.seed), _counted_hook


# DDP checks the hook's return annotation as an object; postponed annotations would hand it a string.
_counted_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
