"""ZeRO-1 (inner strategy `zero1`, SOTA-028) on 2 and 4 gloo ranks: parameters after k AdamW steps equal
plain DDP + AdamW; each rank holds about 1/n of the optimizer state; bytes per step are DDP's plus the
analytic parameter all-gather; optimizer.state_dict() gathers the full state in DDP's layout and
load_state_dict() keeps only the owned part, so training continues identically after a reload."""

import copy
import os
import re

import pytest
import torch

from harness.world import spawn_ranks
from islands.models import ByteTransformer, sequence_loss
from islands.sync.zero1 import param_gather_bytes, partition

STEPS, BATCH, CONTEXT = 4, 2, 16


def tiny_model():
    torch.manual_seed(0)
    return ByteTransformer(d_model=32, n_layers=2, n_heads=2, context=CONTEXT)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def batches(n):
    g = torch.Generator().manual_seed(42)
    return [torch.randint(0, 256, (n * BATCH, CONTEXT + 1), generator=g) for _ in range(2 * STEPS)]


def _train(model, opt, strategy, rank, steps):
    for b in steps:
        mine = b[rank * BATCH : (rank + 1) * BATCH]
        sequence_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
        strategy.after_backward(model, 0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the trainer clips: needs the full gradient
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state_bytes(opt):
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _worker(rank, env, queue, n):
    os.environ.update(env, RANK=str(rank))
    torch.set_num_threads(1)
    from islands.runtime.world import close_world, init_world
    from islands.sync.ddp import DDP
    from islands.sync.zero1 import ZeRO1

    world = init_world(islands=1, timeout_s=30)
    data = batches(n)
    runs = {}
    for name, make in (("ddp", DDP), ("zero1", ZeRO1)):
        world.ledger.reset()
        model = tiny_model()
        opt = adamw(model)
        strategy = make()
        model = strategy.wrap(model, opt, world)
        _train(model, opt, strategy, rank, data[:STEPS])
        ledger = world.ledger.snapshot()
        state_bytes = _state_bytes(opt)
        full = opt.state_dict()  # collective under zero1
        runs[name] = {
            "model": model,
            "opt": opt,
            "strategy": strategy,
            "ledger": ledger,
            "state_bytes": state_bytes,
            "full_state": full,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    z, d = runs["zero1"], runs["ddp"]
    out = {
        "max_param_diff": max((a - b).abs().max().item() for a, b in zip(z["params"], d["params"])),
        "state_bytes": {k: runs[k]["state_bytes"] for k in runs},
        "sent": {k: runs[k]["ledger"]["sent"] for k in runs},
        "received": {k: runs[k]["ledger"]["received"] for k in runs},
        "calls": z["ledger"]["calls"],
    }
    # the gathered state is DDP's state, in DDP's layout
    zs, ds = z["full_state"], d["full_state"]
    out["same_keys"] = sorted(zs["state"]) == sorted(ds["state"]) and zs["param_groups"] == ds["param_groups"]
    out["max_state_diff"] = max(
        (zs["state"][i][k].float() - ds["state"][i][k].float()).abs().max().item()
        for i in ds["state"]
        for k in ds["state"][i]
    )
    # reload: DDP's full state into a fresh zero1 optimizer keeps only the owned part; training then goes on
    # exactly as a fresh DDP loaded from the same state (both fresh: same DDP bucket history)
    sd = {k.removeprefix("module."): v.detach().clone() for k, v in d["model"].state_dict().items()}
    resumed = {}
    for name, make in (("ddp", DDP), ("zero1", ZeRO1)):
        model = tiny_model()
        model.load_state_dict(sd)
        opt = adamw(model)
        strategy = make()
        model = strategy.wrap(model, opt, world)
        opt.load_state_dict(copy.deepcopy(ds))  # torch's state_dict shares the live tensors; a checkpoint is a copy
        if name == "zero1":
            owned = {id(p) for i, p in enumerate(opt.param_groups[0]["params"]) if strategy.partition.owner[i] == rank}
            out["owned_after_load"] = {id(p) for p in opt.state} == owned and len(owned) > 0
        _train(model, opt, strategy, rank, data[STEPS:])
        resumed[name] = [p.detach().clone() for p in model.parameters()]
    out["max_resumed_diff"] = max((a - b).abs().max().item() for a, b in zip(resumed["zero1"], resumed["ddp"]))
    queue.put((rank, out))
    close_world(world)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def results(request):
    return request.param, spawn_ranks(_worker, request.param, request.param, timeout=120)


def test_parameters_equal_ddp_adamw(results):
    n, got = results
    for rank, out in got:
        assert out["max_param_diff"] <= 1e-6, f"n={n} rank {rank}: zero1 differs from ddp by {out['max_param_diff']}"


def test_each_rank_holds_about_one_nth_of_the_optimizer_state(results):
    n, got = results
    total = sum(out["state_bytes"]["zero1"] for _, out in got)
    ddp = got[0][1]["state_bytes"]["ddp"]
    assert total == ddp  # every slot held exactly once across the island
    for rank, out in got:
        share = out["state_bytes"]["zero1"] / ddp
        assert share <= 1 / n + 0.15, f"n={n} rank {rank} holds {share:.3f} of DDP's optimizer state"


def test_bytes_are_ddp_plus_the_parameter_gather(results):
    n, got = results
    numels = [p.numel() for p in tiny_model().parameters()]
    sent, received = param_gather_bytes(numels, n)
    for _rank, out in got:
        z, d = out["sent"], out["sent"]["ddp"]
        assert z["zero1"]["grad_all_reduce"] == d["grad_all_reduce"] == STEPS * 4 * sum(numels)
        assert z["zero1"]["zero1_param_gather"] == STEPS * sent
        assert out["received"]["zero1"]["zero1_param_gather"] == STEPS * received
        assert out["calls"]["zero1_param_gather"] == STEPS  # one collective per step


def test_full_state_dict_is_ddps_and_reload_continues(results):
    n, got = results
    for _rank, out in got:
        assert out["same_keys"]
        assert out["max_state_diff"] <= 1e-6
        assert out["owned_after_load"]
        assert out["max_resumed_diff"] <= 1e-6


def test_partition_is_balanced_and_deterministic():
    numels = [p.numel() for p in tiny_model().parameters()]
    for n in (1, 2, 3, 4):
        owner = partition(numels, n)
        assert owner == partition(numels, n)
        loads = [sum(x for x, o in zip(numels, owner) if o == r) for r in range(n)]
        assert max(loads) - min(loads) <= max(numels)  # greedy: no rank exceeds another by more than one tensor
    assert partition([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="n >= 1"):
        partition([1], 0)


def test_config_wires_zero1_and_rejects_what_it_cannot_combine():
    from islands.app.build import build_inner, build_task
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping
    from islands.runtime.world import World
    from islands.sync.zero1 import ZeRO1

    cfg = validate(from_mapping(dict(workers=2, global_batch=4, inner="zero1", bucket_mb=1.0)))
    inner = build_inner(cfg, World.single(), build_task(cfg))
    assert isinstance(inner, ZeRO1) and inner.ddp.bucket_mb == 1.0
    with pytest.raises(ConfigError, match=re.escape("inner.strategy=zero1")):
        validate(from_mapping(dict(workers=2, global_batch=4, inner="zero1", compress="topk:ratio=0.01")))
