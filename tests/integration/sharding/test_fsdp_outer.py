"""FSDP inside each island, DiLoCo across islands (2 islands x 2 gloo workers).

The outer exchange runs per shard: worker j of every island all-reduces its shard j with the others holding
shard j. Averaging shard-wise is averaging whole tensors, so the global model must equal DDP-inside DiLoCo's
on the same data (to float tolerance: reduce-scatter and all-reduce sum in different orders). The model has an
odd first dimension (7 rows over 2 workers: 4 + 3) and a one-row layer whose second shard is empty, so FSDP's
padding matters, and a BatchNorm (buffers)."""

import io

import pytest
import torch
import torch.nn as nn

from harness.outer import run_world
from islands.compress.average import FINITE_FLAG_NBYTES

H, STEPS, STOP = 3, 9, 4  # DiLoCo rounds end after steps 3, 6, 9; the resume test stops mid-round (after 4)
OUTER = f"diloco:inner_steps={H},outer=nesterov,outer_lr=0.7,momentum=0.9"
# fp16 casts each value alone: per shard or whole, the same payload, so fsdp must still equal ddp
COMPRESSED = OUTER + ",compressor=(fp16)"


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 1))


def data(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(6, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _build(world, inner: str, outer: str = OUTER):
    from islands.inner import DDP, FSDP
    from islands.sync.outer import make_outer
    from islands.sync.stack import Stack

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = Stack(FSDP() if inner == "fsdp" else DDP(), make_outer(outer))
    return strategy.wrap(model, opt, world), opt, strategy


def _steps(model, opt, strategy, world, steps):
    for step in steps:
        x, y = strategy.on_batch(data(world.rank, step), step)
        nn.functional.mse_loss(model(x), y).backward()
        strategy.after_backward(model, step)
        opt.step()
        strategy.after_step(model, opt, step)
        opt.zero_grad()


def _global(strategy, model) -> dict:
    """The full global model (a collective under fsdp), as numpy."""
    return {k: v.detach().clone().numpy() for k, v in strategy.eval_model(model).state_dict().items()}


def _run(world, inner: str, outer: str = OUTER):
    before = world.ledger.sent.get("outer_delta", 0)  # one ledger per process: every run records into it
    model, opt, strategy = _build(world, inner, outer)
    _steps(model, opt, strategy, world, range(STEPS))  # the last step ends a round: finish sends nothing more
    strategy.finish(model)
    outer = strategy.outer
    return {
        "global": _global(strategy, model),
        "rounds": outer.rounds,
        "outer_sent": world.ledger.sent.get("outer_delta", 0) - before,
        "shard_numel": outer.global_flat.numel(),
        "sent": list(outer.exchange.sent),
    }


def _run_both(world):
    runs = {inner: _run(world, inner) for inner in ("fsdp", "ddp")}
    runs.update({f"{inner}-fp16": _run(world, inner, COMPRESSED) for inner in ("fsdp", "ddp")})
    runs["refusals"] = [_refusal(world, outer) for outer in ("local-sgd:every=2", OUTER + ",warm_start=2")]
    return runs


def _refusal(world, outer: str) -> str:
    """A library user's Stack(FSDP(), <unsupported outer>) fails at wrap, on every rank, before any collective."""
    try:
        _build(world, "fsdp", outer)
    except ValueError as e:
        return str(e)
    return "wrapped"


def test_a_stack_refuses_an_outer_strategy_not_wired_for_shards(both):
    for rank in both:
        local_sgd, warm = rank["refusals"]
        assert "'local-sgd' is not wired for sharded parameters" in local_sgd and "diloco:inner_steps=H" in local_sgd
        assert "warm_start=2 is not wired" in warm


@pytest.fixture(scope="module")
def both():
    return run_world(_run_both, size=4, islands=2)


@pytest.mark.parametrize("run", ["", "-fp16"])
def test_fsdp_diloco_equals_ddp_diloco(both, run):
    for rank in both:
        fsdp, ddp = rank["fsdp" + run]["global"], rank["ddp" + run]["global"]
        assert fsdp.keys() == ddp.keys()
        for k in fsdp:
            if "running" in k:  # DDP re-broadcasts rank 0's statistics every forward, FSDP does not (see docs)
                continue
            torch.testing.assert_close(torch.from_numpy(fsdp[k]), torch.from_numpy(ddp[k]), rtol=1e-5, atol=1e-5)
        assert rank["fsdp" + run]["rounds"] == rank["ddp" + run]["rounds"] == STEPS // H
    start = make_model().state_dict()
    assert not torch.allclose(torch.from_numpy(both[0]["fsdp" + run]["global"]["0.weight"]), start["0.weight"])
    if run:  # the compressed payload is really in use: the model differs from the uncompressed run's
        assert both[0]["fsdp"]["global"]["0.weight"].tobytes() != both[0]["fsdp" + run]["global"]["0.weight"].tobytes()


@pytest.mark.parametrize("run", ["fsdp", "fsdp-fp16"])
def test_every_worker_of_every_island_holds_the_same_global_model(both, run):
    first = both[0][run]["global"]
    for rank in both[1:]:
        for k, v in rank[run]["global"].items():
            assert v.tobytes() == first[k].tobytes(), k
    assert int(first["1.num_batches_tracked"]) == STEPS


def test_outer_bytes_are_each_workers_shard(both):
    """Each worker sends its shard per round: rows ceil(7/2)=4 then 3 of Linear(5, 7) and BatchNorm(7); of the
    one-row Linear(7, 1) worker 0 holds all, worker 1 nothing. DDP inside sends the whole model from every worker."""
    whole = 7 * 5 + 7 + 7 + 7 + 7 + 1
    shard = {0: 4 * 5 + 4 + 4 + 4 + 7 + 1, 1: 3 * 5 + 3 + 3 + 3}
    assert shard[0] + shard[1] == whole
    for rank, r in enumerate(both):
        j = rank % 2
        assert r["fsdp"]["shard_numel"] == shard[j]
        assert r["fsdp"]["outer_sent"] == STEPS // H * shard[j] * 4 == sum(r["fsdp"]["sent"])
        assert r["ddp"]["outer_sent"] == STEPS // H * whole * 4
        # the compressor runs on the shard: 2 bytes a value, plus compress_and_average's 4-byte finite flag
        assert r["fsdp-fp16"]["sent"] == [shard[j] * 2 + FINITE_FLAG_NBYTES] * (STEPS // H)


# topk keeps error feedback per worker: under fsdp a residual of the worker's own shard, which must survive too
RESUMED = {"plain": OUTER, "topk": OUTER + ",compressor=(topk:ratio=0.5)"}


def _resume(world):
    return {name: _resume_one(world, outer) for name, outer in RESUMED.items()}


def _resume_one(world, outer):
    """Save between steps 4 and 5 (mid-round: local work the global model lacks), rebuild everything, load, go on."""
    from islands.checkpoint.policy.checkpointer import LoopState

    model, opt, strategy = _build(world, "fsdp", outer)
    _steps(model, opt, strategy, world, range(STOP))
    buf = io.BytesIO()
    torch.save(LoopState(world, STOP, 0.0, model, opt, strategy).state_dict(), buf)
    _steps(model, opt, strategy, world, range(STOP, STEPS))  # the uninterrupted run goes on
    strategy.finish(model)
    straight = _global(strategy, model)

    model, opt, strategy = _build(world, "fsdp", outer)  # a new model, optimizer and strategy: what a restart builds
    buf.seek(0)
    LoopState(world, 0, 0.0, model, opt, strategy).load_state_dict(torch.load(buf, weights_only=False))
    _steps(model, opt, strategy, world, range(STOP, STEPS))
    strategy.finish(model)
    return {"straight": straight, "resumed": _global(strategy, model)}


def test_a_mid_round_save_and_load_resumes_bitwise():
    ranks = run_world(_resume, size=4, islands=2)
    for name in RESUMED:
        for rank in ranks:
            run = rank[name]
            assert run["straight"].keys() == run["resumed"].keys()
            for k, v in run["straight"].items():
                assert v.tobytes() == run["resumed"][k].tobytes(), (name, k)
    assert ranks[0]["plain"]["straight"]["0.weight"].tobytes() != ranks[0]["topk"]["straight"]["0.weight"].tobytes()


@pytest.mark.parametrize(
    "outer, refused",
    [
        ("diloco:inner_steps=5", None),
        ("diloco:inner_steps=5,outer=nesterov,outer_lr=0.7,momentum=0.9,compressor=(fp16)", None),
        ("local-sgd:every=4", "'local-sgd' is not wired for sharded parameters"),
        ("diloco:inner_steps=6,fragments=2", "fragments=2 is not wired"),
        ("diloco:inner_steps=6,overlap=eager", "overlap=eager is not wired"),
        ("diloco:inner_steps=6,aggregator=(median)", "aggregator="),
        ("diloco:inner_steps=6,warm_start=10", "warm_start=10 is not wired"),
        ("slowmo:every=6", "'slowmo' is not wired"),
    ],
)
def test_validate_takes_fsdp_with_plain_diloco_only(outer, refused):
    from islands.app.validate import sharding
    from islands.config import from_mapping

    cfg = from_mapping({"workers": 4, "islands": 2, "global_batch": 32, "inner": "fsdp", "outer": outer})
    message = sharding(cfg)
    if refused is None:
        assert message is None
    else:
        assert refused in message and "diloco:inner_steps=H" in message, message


def test_validate_takes_fsdp_in_elastic_jobs_and_refuses_shard_groups_across_the_outer_exchange():
    from islands.app.validate import elastic, sharding
    from islands.config import from_mapping

    cfg = from_mapping(
        dict(workers=4, islands=2, global_batch=32, inner="fsdp", outer="diloco:inner_steps=5", elastic=True)
    )
    assert (
        sharding(cfg) is None and elastic(cfg) is None
    )  # tests/integration/elastic/test_elastic_islands.py runs such jobs
    cfg = from_mapping(
        dict(workers=8, islands=2, global_batch=32, inner="fsdp", outer="diloco:inner_steps=5", shard_group="2")
    )
    assert "leave shard_group ''" in sharding(cfg)


@pytest.mark.slow  # two launcher jobs of 4 gloo ranks: ~30 s on a 2-core host
def test_islands_train_fsdp_diloco_resumes_mid_round_to_the_same_loss(tmp_path):
    """The whole path: `islands train --inner fsdp --outer diloco:...` through the launcher and the Trainer's own
    checkpoints; a resume from a mid-round save (step 4, rounds end at 3 and 6) ends at the same bits."""
    import json

    from harness.cli import TINY_FLAGS, islands_cli

    job = [
        *TINY_FLAGS,
        "--global-batch",
        "8",
        "--workers",
        "4",
        "--islands",
        "2",
        "--inner",
        "fsdp",
        "--outer",
        "diloco:inner_steps=3",
        "--steps",
        "8",
        "--eval-every",
        "4",
    ]
    assert islands_cli("train", *job, "--ckpt-every", "4", "--run-dir", str(tmp_path / "a")) == 0
    assert (
        islands_cli(
            "train", *job, "--resume", str(tmp_path / "a" / "ckpt" / "step-000004"), "--run-dir", str(tmp_path / "b")
        )
        == 0
    )
    a, b = (json.loads((tmp_path / r / "run.json").read_text()) for r in "ab")
    assert a["summary"]["strategy"] == "fsdp+diloco"
    assert b["checkpoint"]["resumed_from"]["step"] == 4
    assert a["summary"]["final_val_loss"] == b["summary"]["final_val_loss"]
    val = a["series"]["val"]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    for ledger in a["comm"]["per_rank"]:  # each worker sent its shard in each of the 3 rounds (6 + the final sync)
        assert ledger["calls"]["outer_delta"] == 3 and ledger["sent"]["outer_delta"] > 0
