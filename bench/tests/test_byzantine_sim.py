"""The in-process n-worker simulation behind `islands bench byzantine`, and the experiment's verdicts."""

from __future__ import annotations

import math

import pytest
import torch

from islands.app.validate import validate
from islands.config import from_mapping
from islands_bench.byzantine_sim import simulated_job
from islands_bench.experiments import byzantine as B

CFG = dict(
    task="digits", workers=8, steps=50, global_batch=64, warmup=5, lr=0.01, eval_every=0, progress=False, probe=False
)


@pytest.fixture(scope="module")
def runs() -> dict:
    cfg = validate(from_mapping(CFG))
    return {
        "clean": simulated_job(cfg, "mean", "none").run(cfg.train.steps),
        "mean": simulated_job(cfg, "mean", "scaled:factor=-10,count=2").run(cfg.train.steps),
        "median": simulated_job(cfg, "median", "scaled:factor=-10,count=2").run(cfg.train.steps),
    }


@pytest.mark.integration  # three simulated 8-worker runs: long for the quick lane
def test_two_of_eight_scaled_attackers_wreck_mean_but_not_median(runs):
    clean, mean, median = runs["clean"], runs["mean"], runs["median"]
    assert clean.final_val_accuracy > 0.85
    assert mean.final_val_accuracy < 0.3  # pushed uphill: worse than the clean run by far
    assert median.final_val_accuracy > clean.final_val_accuracy - 0.1
    assert mean.byzantine == median.byzantine == 2 and clean.byzantine == 0
    for r in runs.values():
        assert r.steps == CFG["steps"] and not r.diverged and not r.error
        assert r.aggregate_step_seconds > 0 and r.mean_step_seconds > 0 and r.cost_vs_mean > 0


@pytest.mark.integration  # needs the three runs above
def test_nan_senders_are_dropped_every_step_and_training_is_unharmed(runs):
    cfg = validate(from_mapping({**CFG, "steps": 10}))
    r = simulated_job(cfg, "mean", "nan:count=3").run(10)
    assert r.dropped_inputs == 3 * 10 and not r.diverged and math.isfinite(r.final_val_loss)


def test_simulation_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="straggler changes time"):
        simulated_job(validate(from_mapping(CFG)), "median", "straggler:delay=1,count=1")
    with pytest.raises(ValueError, match="at least 2 workers"):
        simulated_job(validate(from_mapping({**CFG, "workers": 1})), "median", "none")


def _cell(f, attack, aggregator, acc, diverged=False, error=""):
    return {
        "task": "digits",
        "f": f,
        "attack_name": attack,
        "aggregator": aggregator,
        "final_val_accuracy": acc,
        "final_val_loss": 1.0,
        "diverged": diverged,
        "error": error,
    }


def test_pivot_picks_the_best_robust_aggregator_and_judges_against_the_clean_mean():
    cells = [
        _cell(0, "none", "mean", 0.90),
        _cell(0, "none", "median", 0.88),
        _cell(2, "scaled", "mean", 0.10),
        _cell(2, "scaled", "median", 0.86),
        _cell(2, "alie", "mean", 0.89),
        _cell(2, "alie", "median", 0.99, diverged=True),
    ]
    rows, clean = B.pivot(cells, "digits")
    assert clean == 0.90
    scaled = next(r for r in rows if r["attack"] == "scaled")
    assert scaled["best"] == "median" and scaled["best_ok"] and not scaled["mean_ok"]
    alie = next(r for r in rows if r["attack"] == "alie")
    assert alie["median"] == 0.0 and not alie["best_ok"]  # a diverged run scores the worst value
    assert alie["mean_ok"]


def test_loss_metrics_compare_the_other_way():
    assert B.within(1.04, 1.0, higher=False) and not B.within(1.06, 1.0, higher=False)
    assert B.within(0.96, 1.0, higher=True) and not B.within(0.94, 1.0, higher=True)
    assert B.relative(math.inf, 2.0, higher=False) == 0.0


def test_specs_the_grid_builds_all_parse():
    from islands.aggregate import parse_aggregator
    from islands.faults.attacks import parse_attack

    for f in (0, 1, 2, 3):
        for label in B.AGGREGATORS:
            parse_aggregator(B.aggregator_spec(label, f))
        for attack in B.ATTACKS:
            assert parse_attack(B.attack_spec(attack, f), B.N).f == f


@pytest.mark.slow  # a real 4-rank gloo job
@pytest.mark.integration
def test_a_simulated_run_matches_the_real_four_rank_job(tmp_path):
    """The simulation stands for a real job: the same config trained by 4 gloo ranks (islands' launcher,
    median over a sign-flipping rank) ends at the simulation's parameters."""
    from islands.app.launch import launch
    from islands.checkpoint import CheckpointStore

    steps = 4
    cfg = validate(
        from_mapping(
            dict(
                task="digits",
                workers=4,
                steps=steps,
                global_batch=16,
                hidden=16,
                warmup=1,
                eval_every=0,
                eval_batches=1,
                log_every=steps,
                probe=False,
                progress=False,
                timeout=30.0,
                aggregate="median",
                attack="sign-flip:count=1",
                ckpt_every=steps,
                ckpt_async=False,
            )
        )
    )
    assert launch(cfg, tmp_path / "run") == 0
    real = CheckpointStore(tmp_path / "run" / "ckpt", clean=False).load()
    assert real.step == steps
    sim = simulated_job(cfg, "median", "sign-flip:count=1")
    sim.run(steps)
    mine = dict(sim.model.named_parameters())
    assert set(mine) == set(real.tree["model"])
    for name, theirs in real.tree["model"].items():
        torch.testing.assert_close(mine[name].detach(), theirs, rtol=0, atol=1e-6)
