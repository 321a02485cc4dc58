"""islands' DDP start-up (islands.sync.ddp.start_ddp): torch's DDP without its constructor's own synchronisation,
which held the GIL long enough to silence a worker's heartbeat; the same result through plain collectives: every
rank starts from the first rank's parameters and buffers (floating, integer and bool alike), and ranks whose
models differ are all refused with the reason."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.world import leave_group, spawn_ranks


class Model(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body, self.bn = nn.Linear(4, width), nn.BatchNorm1d(width)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.bool))

    def forward(self, x):
        return self.bn(self.body(x))


def _worker(rank: int, env: dict, queue, widths: list[int]) -> None:
    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=int(env["WORLD_SIZE"]))
    from islands.sync.ddp import start_ddp

    torch.manual_seed(rank)  # every rank builds different values
    model = Model(widths[rank])
    with torch.no_grad():
        model.bn.running_mean.fill_(rank + 1.0)
        model.bn.num_batches_tracked.fill_(10 * rank)
        model.seen[rank % 3] = True
    try:
        ddp = start_ddp(model, None, 25.0)
    except ValueError as e:
        queue.put((rank, "refused", str(e)))
        dist.destroy_process_group()
        return
    state = {k: v.tolist() for k, v in model.state_dict().items()}  # plain lists: tensors would travel as handles
    loss = ddp(torch.ones(8, 4) * (rank + 1)).square().mean()
    loss.backward()  # DDP's own gradient all-reduce still runs
    grads = [p.grad.tolist() for p in model.parameters()]
    queue.put((rank, "ok", state, grads))
    del ddp, loss  # before the group: harness.world.leave_group
    leave_group()


def test_every_rank_starts_from_the_first_ranks_parameters_and_buffers_and_trains_in_step():
    (r0, ok0, s0, g0), (r1, ok1, s1, g1) = spawn_ranks(_worker, 2, [6, 6], timeout=120)
    assert ok0 == ok1 == "ok"
    assert s0 == s1  # bitwise: the floats are compared as Python floats
    assert s1["bn.running_mean"][0] == 1.0 and s1["bn.num_batches_tracked"] == 0
    assert s1["seen"] == [True, False, False]
    assert g0 == g1  # gradients averaged by DDP's hook


def test_ranks_whose_models_differ_are_all_refused_with_the_reason():
    reports = spawn_ranks(_worker, 2, [6, 7], timeout=120)
    assert [r[1] for r in reports] == ["refused", "refused"], reports
    assert "differ in shape or dtype across the ranks" in reports[1][2]
