"""ZeRO stage 1 inside an island: each rank keeps and updates only its slice of the optimizer state
(SOTA-028, LIT-027).

Gradients are averaged exactly as in DDP (DDP's bucketed, counted hook), so every rank still holds the
full averaged gradient and the trainer's gradient clipping sees the true global norm. The optimizer
keeps all its parameter groups, but each parameter has one owner rank (a deterministic greedy
partition balanced by element count); on the other ranks its gradient is dropped just before the
step, so the optimizer neither updates it nor allocates state for it. After the step every rank packs
its owned, updated parameters into one flat buffer and one counted all-gather replicates them
(`zero1_param_gather`).

Bytes per step per rank (Comm's payload definitions, fp32, P = all parameter elements, M = the largest
partition's elements, n ranks):
    grad_all_reduce      sent = received = 4 P             (DDP's, unchanged)
    zero1_param_gather   sent = 4 M, received = 4 (n-1) M (M >= P/n; the balance pads the rest)
So on a ring the wire bytes are DDP's plus about (n-1)/n * 4P: 1.5x DDP's (a reduce-scatter in place of
the all-reduce would bring it back to 1.0x, but then the trainer's clipping would see partial gradients).

Checkpoints see the optimizer of plain DDP: `optimizer.state_dict()` becomes a collective over the
island that gathers every owner's state into torch's ordinary layout, and `load_state_dict` keeps only
the owned parameters' state. So a ZeRO-1 checkpoint loads into DDP or single runs and back, on any
world size.
"""

from __future__ import annotations

import pickle

import torch

from islands.runtime.comm import Comm
from islands.sync.base import NoOp
from islands.sync.ddp import DDP, unwrap

PARAM_KIND = "zero1_param_gather"
STATE_KIND = "zero1_state_gather"


def partition(numels: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the least loaded rank (ties: lower index).

    Deterministic from the sizes alone, so every rank computes the same partition without talking.
    """
    if n < 1:
        raise ValueError(f"partition needs n >= 1 ranks; got {n}")
    owner = [0] * len(numels)
    load = [0] * n
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


def param_gather_bytes(numels: list[int], n: int, elem_bytes: int = 4) -> tuple[int, int]:
    """(sent, received) of the parameter all-gather per step on every rank: the largest partition, padded."""
    owner = partition(numels, n)
    largest = max((sum(x for x, o in zip(numels, owner) if o == r) for r in range(n)), default=0)
    return largest * elem_bytes, (n - 1) * largest * elem_bytes


class OptimizerPartition:
    """Restricts an optimizer to the parameters this rank owns and keeps the replicas in step.

    Installs four hooks on the optimizer: before the step (drop non-owned gradients), after the step
    (all-gather the owned parameters), after state_dict (gather the full state), before load_state_dict
    (keep the owned state). The optimizer object and its parameter groups stay what the caller built.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Comm):
        if any(optimizer.state.values()):
            raise ValueError("zero1 must wrap the optimizer before it has taken a step")
        self.optimizer, self.comm = optimizer, comm
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise TypeError(f"zero1 packs parameters into one flat buffer; they must share a dtype, got {dtypes}")
        self.n, self.rank = comm.size, comm.rank
        self.numels = [p.numel() for p in self.params]
        self.owner = partition(self.numels, self.n)
        self.owned = [i for i, o in enumerate(self.owner) if o == self.rank]
        self.largest = max(sum(x for x, o in zip(self.numels, self.owner) if o == r) for r in range(self.n))
        optimizer.register_step_pre_hook(self._drop_foreign_grads)
        optimizer.register_step_post_hook(self._replicate_params)
        optimizer.register_state_dict_post_hook(self._gather_state)
        optimizer.register_load_state_dict_pre_hook(self._keep_owned_state)

    # ---- the step -------------------------------------------------------------------------------
    def _drop_foreign_grads(self, optimizer, args, kwargs):
        for p, o in zip(self.params, self.owner):
            if o != self.rank:
                p.grad = None  # the optimizer skips parameters without a gradient: no update, no state

    @torch.no_grad()
    def _replicate_params(self, optimizer, args, kwargs):
        mine = [self.params[i].detach().reshape(-1) for i in self.owned]
        flat = self.params[0].new_zeros(self.largest)
        if mine:
            torch.cat(mine, out=flat[: sum(t.numel() for t in mine)])
        parts = self.comm.all_gather(flat, kind=PARAM_KIND)
        for r in range(self.n):
            if r == self.rank:
                continue
            offset = 0
            for i, o in enumerate(self.owner):
                if o == r:
                    p = self.params[i]
                    p.copy_(parts[r][offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    # ---- checkpoints: the full state in torch's ordinary layout ----------------------------------
    def _gather_objects(self, obj) -> list:
        """Small metadata from every rank, as bytes through the counted Comm."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.comm.all_gather(torch.tensor([data.numel()]), kind=STATE_KIND)
        padded = torch.zeros(int(max(s.item() for s in sizes)), dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = self.comm.all_gather(padded, kind=STATE_KIND)
        return [pickle.loads(parts[r][: int(sizes[r].item())].numpy().tobytes()) for r in range(self.n)]

    def _gather_state(self, optimizer, state_dict: dict) -> dict:
        """Collective over the island: every rank must call optimizer.state_dict() together."""
        local = state_dict["state"]  # integer keys in param_groups order, owned parameters only
        meta = {
            i: {
                k: (("tensor", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("value", v))
                for k, v in s.items()
            }
            for i, s in local.items()
        }
        metas = self._gather_objects(meta)
        dtypes = sorted({d[2] for m in metas for s in m.values() for d in s.values() if d[0] == "tensor"})
        full: dict[int, dict] = {}
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            lengths = [
                sum(_numel(d[1]) for s in m.values() for d in s.values() if d[0] == "tensor" and d[2] == dtype_name)
                for m in metas
            ]
            flat = torch.zeros(max(lengths), dtype=dtype)
            mine = [
                v.reshape(-1)
                for i in sorted(local)
                for k, v in sorted(local[i].items())
                if isinstance(v, torch.Tensor) and str(v.dtype) == dtype_name
            ]
            if mine:
                torch.cat(mine, out=flat[: lengths[self.rank]])
            parts = self.comm.all_gather(flat, kind=STATE_KIND)
            for r, m in enumerate(metas):
                offset = 0
                for i in sorted(m):
                    for k, d in sorted(m[i].items()):
                        if d[0] == "tensor" and d[2] == dtype_name:
                            size = _numel(d[1])
                            full.setdefault(i, {})[k] = parts[r][offset : offset + size].clone().view(d[1])
                            offset += size
        for m in metas:
            for i, s in m.items():
                for k, d in s.items():
                    if d[0] == "value":
                        full.setdefault(i, {})[k] = d[1]
        state_dict["state"] = {i: full[i] for i in sorted(full)}
        return state_dict

    def _keep_owned_state(self, optimizer, state_dict: dict) -> dict:
        owned = set(self.owned)
        return {**state_dict, "state": {i: s for i, s in state_dict["state"].items() if int(i) in owned}}


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


class ZeRO1(NoOp):
    """DDP's gradient exchange plus an optimizer partitioned over the island's ranks (SOTA-028)."""

    name = "zero1"

    def __init__(self, bucket_mb: float = 25.0):
        """`bucket_mb`: the size of DDP's gradient buckets (the exchange is DDP's plain counted mean)."""
        self.ddp = DDP(bucket_mb=bucket_mb)
        self.partition: OptimizerPartition | None = None

    def wrap(self, model, optimizer, world):
        model = self.ddp.wrap(model, optimizer, world)
        if world.workers_per_island > 1:  # an island of one has nothing to partition
            self.partition = OptimizerPartition(optimizer, world.comm("local"))
        return model

    def eval_model(self, model):
        return unwrap(model)

    def state_dict(self) -> dict:
        return self.ddp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ddp.load_state_dict(state)
