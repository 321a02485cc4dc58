"""Optimizer state of sharded (DTensor) models in a form any world size can load.

FSDP2 (islands.sync.sharded) keeps each rank's optimizer state as DTensor shards along dim 0, keyed
by parameter object. A checkpoint holds the full tensors instead, keyed by parameter name -- the FQN
form of torch.distributed.checkpoint.state_dict (get/set_optimizer_state_dict do the name mapping,
wrap don't fork) -- so N ranks' checkpoint loads on M ranks: each takes its own rows in torch.chunk
layout, the one FSDP2 shards with. Every rank gathers the same full state, so the saved parts are
replicated and islands.checkpoint.policy.resume's N -> M path accepts them.

The gathers go through the island's counted Comm (ledger kind "ckpt_shard_gather"); DCP's own
full_state_dict gather would hand bytes to torch.distributed outside the ledger. Loading slices
locally: no collective.

Models without DTensor parameters keep torch's plain `optimizer.state_dict()` (integer keys); a
name-keyed state (an FSDP checkpoint) also loads into them, and a plain one into a sharded model, so
fsdp <-> ddp/single resumes work both ways.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from islands.runtime.comm import Comm
from islands.runtime.compiled import uncompiled

GATHER_KIND = "ckpt_shard_gather"


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter is a DTensor (FSDP2 wrapped it)."""
    dtensor = _dtensor_type()
    return any(isinstance(p, dtensor) for p in model.parameters())


def _check_layout(t, where: str) -> None:
    """FSDP2's layouts: Shard(0) over a 1-D mesh, or replicated over the outer dimensions of a
    hybrid (HSDP, SOTA-119) mesh and Shard(0) over its last."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    if placements[-1] != Shard(0) or any(p != Replicate() for p in placements[:-1]):
        raise ValueError(
            f"{where}: only FSDP2 layouts (Shard(0) on the last mesh dimension, Replicate on the others) "
            f"can be checkpointed; got placements {placements} on a {t.device_mesh.ndim}-D mesh"
        )


def _shard_comm(mesh, world):
    """A counted Comm over the ranks that hold the pieces of one replica: the mesh's last dimension."""
    if mesh.ndim == 1:
        return world.comm("local") if mesh.size() == world.comm("local").size else Comm(mesh.get_group(0), world.ledger)
    return Comm(mesh.get_group(mesh.ndim - 1), world.ledger)


def _gather_full(t, comm, where: str) -> torch.Tensor:
    """The full tensor of a sharded DTensor: pad the local rows to ceil(d0 / n), all-gather, trim."""
    _check_layout(t, where)
    n = comm.size
    local = t.to_local().detach()
    rows = math.ceil(t.shape[0] / n)
    padded = local.new_zeros((rows, *t.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    whole = torch.cat(comm.all_gather(padded, kind=GATHER_KIND))
    return whole[: t.shape[0]].clone()


def _own_rows(full: torch.Tensor, param) -> object:
    """This rank's Shard(0) slice of `full` as a DTensor laid out like `param`."""
    from torch.distributed.tensor import DTensor

    mesh = param.device_mesh
    n, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    rows = math.ceil(full.shape[0] / n)
    local = full[rank * rows : rank * rows + rows].to(param.to_local().device).clone()
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world) -> dict:
    """What a checkpoint stores. Sharded models: collective over each sharding group (every rank must call it)."""
    model = uncompiled(model)  # names without torch.compile's `_orig_mod.`: compiled and eager runs load each other's
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dtensor = _dtensor_type()
    # name keys, DTensor values; no collective. torch types each value as the union of every state shape
    sharded = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer))
    comms: dict[int, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for fqn, slots in sharded["state"].items():  # same order on every rank: the model's parameter order
        state[fqn] = {}
        for k, v in slots.items():
            if isinstance(v, dtensor):
                comm = comms.setdefault(id(v.device_mesh), _shard_comm(v.device_mesh, world))
                v = _gather_full(v, comm, f"optimizer state {fqn}.{k}")
            state[fqn][k] = v
    return {"state": state, "param_groups": sharded["param_groups"]}


def _name_keyed(state: dict) -> bool:
    groups = state.get("param_groups") or []
    first = next((p for g in groups for p in g.get("params", [])), None)
    return isinstance(first, str)


def _to_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """torch's integer-keyed optimizer state -> parameter names (ids follow param_groups order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if None in order:
        raise ValueError("optimizer steps a parameter the model does not name; cannot map its state to names")

    def name(i):
        if not isinstance(i, int) or not 0 <= i < len(order):
            raise ValueError(f"optimizer state names parameter id {i!r}; this optimizer has {len(order)} parameters")
        return order[i]

    return {
        "state": {name(i): dict(s) for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]],
    }


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state written by `optimizer_state_dict` on any world size (or torch's plain form)."""
    model = uncompiled(model)
    sharded = is_sharded(model)
    if not sharded and not _name_keyed(state):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not _name_keyed(state):
        state = _to_names(model, optimizer, state)
    if sharded:
        params = dict(model.named_parameters())
        dtensor = _dtensor_type()
        out = {}
        for fqn, slots in state["state"].items():
            p = params.get(fqn)
            if p is None:
                raise ValueError(f"optimizer state for {fqn!r}, which this model does not have")
            out[fqn] = {
                k: _own_rows(v, p)
                if isinstance(p, dtensor)
                and isinstance(v, torch.Tensor)
                and v.dim() > 0
                and tuple(v.shape) == tuple(p.shape)
                else v
                for k, v in slots.items()
            }
        state = {"state": out, "param_groups": state["param_groups"]}
    set_optimizer_state_dict(model, optimizer, state)
