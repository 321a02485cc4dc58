"""Outer strategies across two gloo ranks (two islands of one worker), one spawned world for all checks.

Stated equivalence: DiLoCo with H=1, outer SGD lr 1 and momentum 0 computes
    global - mean(global - x_i) = mean(x_i)
every step, which is synchronous parameter averaging (local-sgd every=1). In fp32 the subtraction
rounds, so the two may differ by about one ulp of the parameters per sync. The inner optimizer for
this check is plain SGD (lr 0.1), which carries such differences forward without amplifying them
(Adam divides by sqrt(v) and can blow a 1e-9 gradient difference up to lr size); over 6 steps we
require max |difference| <= 1e-6 with parameters of order 0.01 to 1.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from harness.outer import batch, run_world, tiny_model

STEPS = 6


class Run:
    """A tiny model, AdamW and one outer strategy, stepped by hand (the trainer's hook order)."""

    def __init__(self, world, spec: str, inner: str = "adamw"):
        from islands.sync.outer import make_outer

        self.world = world
        self.model = tiny_model()
        if inner == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.strategy = make_outer(spec, warmup=2)
        self.strategy.wrap(self.model, self.opt, world)

    def step(self, i: int) -> None:
        from islands.models import sequence_loss

        b = batch(self.world.rank, i)
        sequence_loss(self.model(b[:, :-1]), b[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step(self.model, self.opt, i)

    def finish(self) -> None:
        self.strategy.finish(self.model)  # after the last step: the final synchronisation

    def snapshot(self) -> dict:
        return copy.deepcopy(
            {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "strategy": self.strategy.state_dict()}
        )

    def restore(self, snap: dict) -> None:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        self.strategy.load_state_dict(snap["strategy"])

    def global_np(self) -> np.ndarray:
        return self.strategy.global_flat.numpy().copy()

    def local_np(self) -> np.ndarray:
        return self.strategy.local.read().numpy().copy()


def _scenario(world, spec: str, steps: int, inner: str = "adamw") -> dict:
    before = world.ledger.snapshot()
    run = Run(world, spec, inner)
    for i in range(steps):
        run.step(i)
    run.finish()
    after = world.ledger.snapshot()
    sent = {k: after["sent"].get(k, 0) - before["sent"].get(k, 0) for k in after["sent"]}
    # wrap's agreement on the start: an 8-byte digest, nothing more, as every rank seeds alike here
    assert sent.pop("outer_init", 0) == 8, sent
    s = run.strategy
    moments = [
        run.opt.state[p][k].numpy().copy().ravel()
        for p in run.model.parameters()
        for k in ("exp_avg", "exp_avg_sq")
        if k in run.opt.state[p]
    ]
    return {
        "global": run.global_np(),
        "local": run.local_np(),
        "sent": {k: v for k, v in sent.items() if v},
        "rounds": s.rounds,
        "sends": list(getattr(getattr(s, "schedule", s), "sends", [])),
        "numel": s.global_flat.numel(),
        "bounds": list(getattr(getattr(s, "schedule", s), "bounds", [])),
        "moments": np.concatenate(moments) if moments else None,
        "exchange_sent": list(s.exchange.sent) if hasattr(s, "exchange") else [],
    }


def cut_and_resume(world, spec: str, cut: int, steps: int, at_cut=lambda run: None) -> tuple[Run, Run]:
    """(a, b): a runs all `steps`; b is restored from a's snapshot after `cut` steps and runs the rest; both
    finished. `at_cut(a)` looks at a just before the snapshot (shared by the outer tests' resume scenarios)."""
    a = Run(world, spec)
    for i in range(cut):
        a.step(i)
    at_cut(a)
    snap = a.snapshot()
    for i in range(cut, steps):
        a.step(i)
    a.finish()
    b = Run(world, spec)
    b.restore(snap)
    for i in range(cut, steps):
        b.step(i)
    b.finish()
    return a, b


def _resume(world, spec: str, cut: int, steps: int) -> dict:
    a, b = cut_and_resume(world, spec, cut, steps)
    return {"a": a.global_np(), "b": b.global_np(), "a_local": a.local_np(), "b_local": b.local_np()}


SCENARIOS = {
    "local-sgd-1": ("local-sgd:every=1", STEPS, "sgd"),
    "diloco-h1-sgd": ("diloco:inner_steps=1,outer_lr=1,momentum=0", STEPS, "sgd"),
    "diloco": ("diloco:inner_steps=3", 7),  # rounds end at 3, 6 and (shortened, final) 7
    "diloco-primal": ("diloco:inner_steps=2,outer=primal,weight=0.5", 4),
    "diloco-inner-state": ("diloco:inner_steps=2,sync_inner_state=1", 4),
    "streaming": ("streaming-diloco:inner_steps=4,fragments=2,tau=1,bits=4,block=16", 9),
    "streaming-replay": ("streaming-diloco:inner_steps=4,fragments=2,tau=1,block=16,landing=replay", 9),
    "streaming-zstd": ("streaming-diloco:inner_steps=4,fragments=2,tau=1,bits=4,block=16,entropy=zstd", 9),
    "streaming-f1-fp32": ("streaming-diloco:inner_steps=3,fragments=1,tau=0,bits=32", 7),
    "overlap": ("overlap-local-sgd:tau=2,pull=0.5", 7),
    "easgd": ("easgd:every=2,beta=0.9", 5),
    "slowmo": ("slowmo:every=2,momentum=0.5", 4),
    "post-local": ("post-local-sgd:every=2", 6),  # switch = warmup = 2: syncs after 1, 2, 4, 6
    "diloco-median": ("diloco:inner_steps=2,aggregate=median", 4),
}
# LIT-212's outer step in the resumes: its momentum buffer is state that must come back bit for bit
PAPER = "outer=nesterov,outer_lr=0.7,momentum=0.9"
RESUMES = {
    "diloco": (f"diloco:inner_steps=2,{PAPER}", 3, 6),
    "diloco-default": ("diloco:inner_steps=2", 3, 6),
    # cut with a fragment in flight
    "streaming": (f"streaming-diloco:inner_steps=4,fragments=2,tau=1,block=16,{PAPER}", 5, 9),
    "overlap": ("overlap-local-sgd:tau=2", 3, 6),
    "streaming-replay": (f"streaming-diloco:inner_steps=4,fragments=2,tau=1,block=16,landing=replay,{PAPER}", 5, 9),
}


def _all(world) -> dict:
    torch.manual_seed(world.rank)
    out = {name: _scenario(world, *args) for name, args in SCENARIOS.items()}
    out["resume"] = {name: _resume(world, *args) for name, args in RESUMES.items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(_all, size=2, islands=2)


def test_diloco_h1_lr1_m0_reproduces_synchronous_averaging(ranks):
    for r in ranks:
        ref, got = r["local-sgd-1"], r["diloco-h1-sgd"]
        diff = np.abs(ref["global"] - got["global"]).max()
        assert diff <= 1e-6, f"DiLoCo(H=1, lr=1, m=0) drifted {diff} from parameter averaging"
        assert np.array_equal(got["global"], got["local"])  # every island restarts from the average
    # and it is not trivially equal to a run without synchronisation: the islands' data differ
    assert not np.array_equal(ranks[0]["easgd"]["local"], ranks[1]["easgd"]["local"])


def test_streaming_with_one_fragment_no_overlap_fp32_is_plain_diloco(ranks):
    for r in ranks:
        assert np.array_equal(r["streaming-f1-fp32"]["global"], r["diloco"]["global"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_ranks_agree_bitwise_on_global_params_after_sync(ranks, name):
    a, b = ranks[0][name]["global"], ranks[1][name]["global"]
    assert a.tobytes() == b.tobytes(), f"{name}: ranks differ by {np.abs(a - b).max()}"


def test_inner_state_sync_averages_adam_moments_only_when_asked(ranks):
    assert ranks[0]["diloco-inner-state"]["moments"].tobytes() == ranks[1]["diloco-inner-state"]["moments"].tobytes()
    assert not np.array_equal(ranks[0]["diloco"]["moments"], ranks[1]["diloco"]["moments"])  # SOTA-219 default


def test_bytes_counted_equal_analytic(ranks):
    from islands.sync.outer.quant4 import Quant4

    for r in ranks:
        n4 = 4 * r["diloco"]["numel"]  # fp32 payload of one full exchange
        assert r["local-sgd-1"]["sent"] == {"outer_params": STEPS * n4}
        assert r["diloco-h1-sgd"]["sent"] == {"outer_delta": STEPS * n4}
        assert r["diloco"]["rounds"] == 3 and r["diloco"]["sent"] == {"outer_delta": 3 * n4}
        assert r["diloco-inner-state"]["sent"] == {"outer_delta": 2 * n4, "outer_inner_state": 2 * 2 * n4}
        assert r["post-local"]["sent"] == {"outer_params": 4 * n4}
        assert r["overlap"]["sent"] == {"outer_params": 4 * n4}  # rounds after 2, 4, 6, then the final step 7
        assert r["diloco-median"]["sent"] == {"outer_delta": 2 * n4}  # all-gather: own vector sent once
        s = r["streaming"]
        # fragment 0 sends after 2 and 6 steps, fragment 1 after 4 and 8, both again in the final flush at 9
        assert s["sends"] == [3, 3]
        q = Quant4(16)
        expect = sum(3 * q.payload_nbytes(hi - lo) for lo, hi in s["bounds"])
        assert s["sent"] == {"outer_delta": expect}
        assert expect * 8 < 3 * 2 * n4  # 4-bit payloads: well under the fp32 bytes of the same sends


def test_zstd_stage_is_lossless_and_counted(ranks):
    for r in ranks:
        plain, z = r["streaming"], r["streaming-zstd"]
        # the entropy stage changes bytes, never values: the same run lands on the same global model
        assert z["global"].tobytes() == plain["global"].tobytes()
        sends = sum(z["sends"])
        assert z["sent"]["outer_delta_len"] == 8 * sends  # one int64 length per exchange
        assert len(z["exchange_sent"]) == sends
        assert z["sent"]["outer_delta"] + z["sent"]["outer_delta_len"] == sum(z["exchange_sent"])
    # padded to the longest rank's payload: both ranks count the same bytes per exchange
    assert ranks[0]["streaming-zstd"]["exchange_sent"] == ranks[1]["streaming-zstd"]["exchange_sent"]


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_restores_outer_state_bitwise(ranks, name):
    for r in ranks:
        res = r["resume"][name]
        assert res["a"].tobytes() == res["b"].tobytes()
        assert res["a_local"].tobytes() == res["b_local"].tobytes()


def test_overlap_pull_keeps_islands_apart_but_close(ranks):
    a, b = ranks[0]["easgd"]["local"], ranks[1]["easgd"]["local"]
    assert 0 < np.abs(a - b).max() < 1.0
    assert math.isfinite(float(ranks[0]["overlap"]["global"].sum()))
