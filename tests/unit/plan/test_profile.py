"""The profile's pieces: the Trainer's own step times (its strategy's hooks included), an outer strategy's local work
per round timed side by side with plain steps, the probe copy of a strategy, and the round timings' cache."""

import json
import time

import pytest
import torch

import islands
from islands.plan.api import Profiler, candidate, job_config
from islands.plan.profile import (
    cached_round_seconds,
    profile_step,
    round_probe,
    round_seconds,
    round_steps,
    step_times,
)
from islands.sync.base import NoOp
from islands.sync.outer import make_outer
from islands.sync.single import Single

SLEEP_S = 0.05  # far above a tiny model's step, so a shared machine's jitter cannot hide it


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))


class SlowBackward(NoOp):
    """A strategy hook that costs SLEEP_S after every backward (as DDP's all-reduce or a compressor would)."""

    name = "slow-backward"

    def after_backward(self, model, step):
        time.sleep(SLEEP_S)


class SlowRound(NoOp):
    """A strategy whose round (every `h` steps, after the optimizer) costs SLEEP_S."""

    name = "slow-round"

    def __init__(self, h: int):
        self.h = h

    def after_step(self, model, optimizer, step):
        if (step + 1) % self.h == 0:
            time.sleep(SLEEP_S)


def _trainer(strategy=None) -> islands.Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(4)]
    return islands.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.cross_entropy,
        data,
        strategy=strategy if strategy is not None else islands.Stack(Single()),
    )


def test_step_times_are_the_trainers_own_clock_after_warmup():
    t = _trainer()
    times = step_times(t, warmup=3, steps=5, min_s=0.0)
    assert len(times) == 5 and t.step == 8
    assert times == t.body.readout.seconds[3:]


def test_step_times_keep_going_until_the_minimum_time():
    t = _trainer(SlowBackward())
    times = step_times(t, warmup=1, steps=2, min_s=3 * SLEEP_S)
    assert len(times) >= 4  # 2 steps take 2 x SLEEP_S < min_s: one more chunk of 2
    assert len(times) % 2 == 0


def test_profile_step_includes_the_strategys_hooks():
    """The profile times what the Trainer runs, hooks included: a strategy that sleeps after backward shows in the
    step (a bare forward/backward would miss it) and in the backward part, not in forward or the optimizer."""
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    plain = profile_step(_trainer(), batch, steps=4, warmup=1, settings="plain", min_s=0)
    slow = profile_step(_trainer(SlowBackward()), batch, steps=4, warmup=1, settings="slow", min_s=0)
    assert slow.step_s >= plain.step_s + SLEEP_S * 0.9
    assert slow.backward_s >= SLEEP_S * 0.9
    assert slow.forward_s < SLEEP_S / 2 and slow.optimizer_s < SLEEP_S / 2
    assert slow.steps == len(slow.step_samples) >= 4
    assert slow.param_bytes == slow.grad_bytes == (8 * 2 + 2) * 4  # gradients of the activation-peak step counted
    assert slow.batch_size == 4


def test_profile_is_cached_by_fingerprint_and_settings():
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    first = profile_step(_trainer(), batch, steps=2, warmup=1, settings="a", min_s=0)
    again = profile_step(_trainer(), batch, steps=2, warmup=1, settings="a", min_s=0)
    other = profile_step(_trainer(), batch, steps=2, warmup=1, settings="b", min_s=0)
    assert not first.cached and again.cached and not other.cached
    assert again.step_samples == first.step_samples and again.fingerprint == first.fingerprint != other.fingerprint


def test_round_seconds_is_the_extra_work_of_a_round():
    h = 3
    extra = round_seconds(_trainer(SlowRound(h)), _trainer(), h, cycles=4)
    assert SLEEP_S * 0.8 <= extra <= SLEEP_S * 2


def test_round_seconds_of_a_strategy_without_extra_work_is_small():
    assert round_seconds(_trainer(NoOp()), _trainer(), 2, cycles=4) < SLEEP_S / 2


def test_round_probe_is_a_shorter_copy():
    outer = make_outer("streaming-diloco:inner_steps=50")  # 4 fragments, tau=1
    h = round_steps(outer)
    assert h == 8
    probe = round_probe(outer, h)
    assert probe.inner_steps == 8 and outer.inner_steps == 50 and probe is not outer
    assert probe.exchange is not outer.exchange  # its compressor's state is its own
    assert round_steps(make_outer("diloco:inner_steps=10")) == 2


def test_round_probe_runs_the_real_strategy_on_one_worker():
    """The probe copy trains under the Trainer on World.single (its collectives the identity) and runs its rounds
    every h steps: after whole rounds the model is the outer step's global model."""
    h = 2
    outer = round_probe(make_outer("diloco:inner_steps=50"), h)
    t = _trainer(islands.Stack(Single(), outer))
    start = outer.global_flat.clone()
    assert round_seconds(t, _trainer(), h, cycles=2) >= 0.0
    assert t.step == 3 * h
    assert not torch.equal(outer.global_flat, start)  # rounds moved the global model
    assert torch.equal(outer.local.read(), outer.global_flat)  # and the last one, at step 3h, set local = global


def test_round_timings_are_cached_per_label(tmp_path):
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    prof = profile_step(_trainer(), batch, steps=2, warmup=1, min_s=0)
    value, cached = cached_round_seconds(prof, "slow", lambda: _trainer(SlowRound(2)), _trainer, 2)
    assert not cached and value > 0

    def never():
        raise AssertionError("a cached round is not measured again")

    again, cached = cached_round_seconds(prof, "slow", never, never, 2)
    assert cached and again == value
    _, cached = cached_round_seconds(prof, "other", lambda: _trainer(NoOp()), _trainer, 2)
    assert not cached
    assert cached_round_seconds(prof, "slow", never, never, 2)[0] == value  # the other label kept it


def test_the_planner_times_a_round_once_for_every_h(tmp_path):
    """A round's work does not depend on H: diloco at H = 10 and 50 share one timing (the probe copy's), and the
    candidates carry it; the flat strategy has none. So does the extra work of combining 2 islands' payloads."""
    cfg = job_config({"task": "digits", "workers": 2, "islands": 2, "steps": 8, "progress": False})
    profiler = Profiler.of(cfg)
    prof = profiler.step(steps=2)
    specs = ("ddp", "diloco:inner_steps=10", "diloco:inner_steps=50")
    cands = profiler.rounds([candidate(s, cfg, profiler.task.model) for s in specs], prof, islands=2)
    kept = json.loads((tmp_path / "cache" / f"{prof.fingerprint}-rounds.json").read_text())
    assert list(kept) == ["diloco:inner_steps=<probe 2>", "diloco:inner_steps=<probe 2>|combine x2"]
    assert cands[0].round_s == 0.0 and cands[1].round_s == cands[2].round_s == kept["diloco:inner_steps=<probe 2>"]
    assert cands[0].gather_s == 0.0 and cands[1].gather_s == cands[2].gather_s == kept[f"{list(kept)[1]}"]
