"""Pipelined forward/backward over 3 gloo ranks equals the unsplit model; bytes are the analytic ones."""

from __future__ import annotations

import numpy as np
import torch

from harness.outer import run_world

BATCH = 4


def _lm():
    from islands.models import ByteTransformer

    torch.manual_seed(0)
    model = ByteTransformer(16, 3, 2, 8).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (BATCH, 8), generator=g)
    return model, x, torch.randint(0, 256, (BATCH, 8), generator=g)


def _mlp():
    from islands.models import MLP

    torch.manual_seed(0)
    model = MLP(64, 12, 10).double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(BATCH, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (BATCH,), generator=g)


# (model, cuts, schedule, microbatches); balanced uses FLOP costs so every rank cuts the same way
CASES = [
    ("lm", "equal", "gpipe", 4),
    ("lm", "equal", "1f1b", 4),
    ("lm", "graph", "gpipe", 2),
    ("lm", "graph", "1f1b", 4),
    ("lm", "balanced", "gpipe", 4),
    ("lm", "balanced", "1f1b", 1),
    ("mlp", "equal", "1f1b", 2),
    ("mlp", "graph", "gpipe", 4),
    ("mlp", "balanced", "1f1b", 4),
]


def _setup(name: str, cuts: str, stages: int):
    from islands.models import sequence_loss
    from islands.parallel.pipeline import balanced_cuts, equal_cuts, graph_cuts, piece_costs, pieces_of

    model, x, y = (_lm if name == "lm" else _mlp)()
    loss_fn = sequence_loss if name == "lm" else torch.nn.functional.cross_entropy
    pieces = pieces_of(model)
    if cuts == "equal":
        starts = equal_cuts(pieces, stages)
    elif cuts == "graph":
        starts = graph_cuts(pieces, stages, x[:1])
    else:
        starts = balanced_cuts(pieces, stages, piece_costs(pieces, x[:2], "flop", loss_fn=loss_fn, target=y[:2]))
    return model, pieces, starts, x, y, loss_fn


def _pipelined(world):
    from islands.parallel.pipeline import PipelineRunner, build_stages

    comm = world.comm("global")
    out = []
    for name, cuts, schedule, m in CASES:
        model, pieces, starts, x, y, loss_fn = _setup(name, cuts, world.size)
        stage = build_stages(pieces, starts)[world.rank]
        runner = PipelineRunner(pieces, stage, comm, schedule, loss_fn)
        before = {k: dict(getattr(world.ledger, k)) for k in ("sent", "received")}
        loss = runner.step(x, y, m)
        names = {id(p): n for n, p in model.named_parameters()}
        delta = {
            k: {kind: v - before[k].get(kind, 0) for kind, v in getattr(world.ledger, k).items()}
            for k in ("sent", "received")
        }
        out.append(
            {
                "starts": starts,
                "loss": None if loss is None else float(loss),
                "grads": {names[id(p)]: p.grad.numpy().copy() for p in stage.parameters()},
                "bytes": delta,
                "peak": runner.meter.peak,
                "live": runner.meter.live,
            }
        )
    return out


def check_equal_to_unsplit(ranks):
    from islands.parallel.pipeline import output_bytes

    for c, (name, cuts, _schedule, _m) in enumerate(CASES):
        model, pieces, starts, x, y, loss_fn = _setup(name, cuts, 3)
        loss = loss_fn(model(x), y)
        loss.backward()
        got = [r[c] for r in ranks]
        assert all(g["starts"] == starts for g in got), (c, [g["starts"] for g in got])
        assert got[0]["loss"] is None and got[1]["loss"] is None
        np.testing.assert_allclose(got[2]["loss"], loss.item(), rtol=1e-10, atol=1e-12)
        # every parameter in exactly one stage, with the unsplit model's gradient
        seen = [n for g in got for n in g["grads"]]
        assert sorted(seen) == sorted(n for n, _ in model.named_parameters()), (c, seen)
        full = dict(model.named_parameters())
        for g in got:
            for n, grad in g["grads"].items():
                np.testing.assert_allclose(grad, full[n].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{c} {n}")
        # bytes: each cut sends the whole batch's activation forward and its gradient back, nothing else
        cut = output_bytes(pieces, x)  # bytes after each piece for the whole batch
        for s, g in enumerate(got):
            fwd = cut[starts[s + 1] - 1] if s < 2 else 0
            back = cut[starts[s] - 1] if s > 0 else 0
            assert g["bytes"]["sent"].get("pipeline_activation", 0) == fwd, (c, s)
            assert g["bytes"]["sent"].get("pipeline_gradient", 0) == back, (c, s)
            assert g["bytes"]["received"].get("pipeline_activation", 0) == back, (c, s)
            assert g["bytes"]["received"].get("pipeline_gradient", 0) == fwd, (c, s)
            assert sum(g["bytes"]["sent"].values()) == fwd + back
            assert g["live"] == 0 and g["peak"] > 0  # every micro-batch released after its backward


def _held(world):
    """Peak held bytes per stage, per schedule, M=4, run twice."""
    from islands.parallel.pipeline import PipelineRunner, build_stages

    out = {}
    for schedule in ("gpipe", "1f1b"):
        model, pieces, starts, x, y, loss_fn = _setup("lm", "equal", world.size)
        stage = build_stages(pieces, starts)[world.rank]
        peaks = []
        for _ in range(2):
            runner = PipelineRunner(pieces, stage, world.comm("global"), schedule, loss_fn)
            runner.step(x, y, 4)
            peaks.append(runner.meter.peak)
        out[schedule] = (peaks, sorted(runner.meter.released.values()))
    return out


TRAIN = {
    "task": "digits",
    "hidden": 16,
    "global_batch": 12,
    "steps": 3,
    "warmup": 1,
    "eval_every": 0,
    "probe": False,
    "progress": False,
    "grad_clip": 0.05,
    "seed": 3,
}


def _train(world):
    """A whole `inner=pipeline` job: 3 stages, gpipe, graph cuts, 3 micro-batches, clipped by the global norm."""
    from islands.app.build import build_trainer
    from islands.app.validate import validate
    from islands.config import from_mapping

    cfg = validate(
        from_mapping(
            {
                **TRAIN,
                "workers": 3,
                "inner": "pipeline",
                "stages": 3,
                "microbatches": "3",
                "cuts": "graph",
                "pipeline_schedule": "gpipe",
            }
        )
    )
    trainer = build_trainer(cfg, world)
    losses = [trainer.train_step() for _ in range(cfg.train.steps)]
    inner = trainer.strategy.inner  # the pipeline is a strategy that supplies its own forward and backward
    return {
        "type": type(inner).__name__,
        "losses": losses,
        "val": trainer.evaluate()["val_loss"],
        "plan": inner.describe(),
        "kinds": sorted(world.ledger.sent),
    }


def _both(world):
    return _pipelined(world), _held(world), _train(world)


def test_pipeline_on_three_gloo_ranks():
    ranks = run_world(_both, size=3, islands=1)
    check_equal_to_unsplit([r[0] for r in ranks])
    check_held_bytes([r[1] for r in ranks])
    check_training_equals_one_process([r[2] for r in ranks])


def check_training_equals_one_process(ranks):
    """Same batches, same AdamW, same clipping: the pipeline job's losses are the single process's."""
    from islands.app.build import build_trainer
    from islands.app.validate import validate
    from islands.config import from_mapping
    from islands.runtime.world import World

    torch.set_num_threads(1)
    single = build_trainer(validate(from_mapping({**TRAIN, "workers": 1})), World.single())
    ref = [single.train_step() for _ in range(3)]
    for r in ranks:
        assert r["type"] == "PipelineStages" and r["plan"]["microbatches"] == 3
        np.testing.assert_allclose(r["losses"], ref, rtol=1e-5)
        np.testing.assert_allclose(r["val"], single.evaluate()["val_loss"], rtol=1e-5)
    assert [r["plan"]["stage"] for r in ranks] == [0, 1, 2]
    assert "pipeline_grad_norm" in ranks[0]["kinds"] and "pipeline_eval_gather" in ranks[0]["kinds"]


def check_held_bytes(ranks):
    """gpipe holds all M=4 micro-batches at once, 1f1b at most K - s on stage s; exact, so runs repeat."""
    for s, r in enumerate(ranks):
        for schedule, in_flight in (("gpipe", 4), ("1f1b", min(4, 3 - s))):
            peaks, per_mb = r[schedule]
            assert peaks[0] == peaks[1] and len(per_mb) == 4 and len(set(per_mb)) == 1, (s, schedule, r)
            assert peaks[0] == in_flight * per_mb[0], (s, schedule, peaks, per_mb)
