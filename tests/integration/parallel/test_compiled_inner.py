"""Inner strategies with a model compiled by torch.compile, before or after `wrap` (docs/own-model.md, "Compiled
models"): DDP with its counted all-reduce hook and with a compressor's comm hook (PowerSGD, whose per-parameter
state is keyed by name), ZeRO-1 and FSDP2 train as the eager model does, and what they checkpoint (the model, the
strategy's state, FSDP's name-keyed optimizer state) has the eager names. Under FSDP also compiled as the Trainer's
`compile=` does ("islands": islands.runtime.compiled.Compile, each FSDP unit's forward in place), with each nn.Linear
its own unit as the default wrap policy makes every layer of an nn.Sequential: the units compile and the model keeps
the eager state_dict keys. Processes because DDP, ZeRO-1 and FSDP need a torch process group of 2 ranks; one world
runs every case, about 4 s of CPU per rank (aot_eager: islands' plumbing, not inductor's code, is under test;
tests/unit/loop/test_compile.py has the inductor run and the outer strategies).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 6
BACKEND = "aot_eager"
MODES = ("eager", "before", "after")
FSDP_MODES = (*MODES, "islands")  # "islands": compiled by islands' Compile, per FSDP unit


class _Net(nn.Module):
    """A module of the test's own: compiled after DDP's or FSDP's wrap, torch starts tracing again in the model's
    forward only when that is user code (a bare nn.Sequential inside DDP runs eagerly; docs/own-model.md)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _strategies():
    import islands

    return {
        "ddp": lambda: islands.Stack(inner=islands.inner.DDP()),
        "ddp-powersgd": lambda: islands.Stack(inner=islands.inner.DDP(compressor=islands.compress.PowerSGD(rank=2))),
        "zero1": lambda: islands.Stack(inner=islands.inner.ZeRO1()),
        "fsdp": lambda: islands.Stack(inner=islands.inner.FSDP()),
        # every nn.Linear its own unit: torch's own layers, which a whole-model compile runs eagerly under FSDP
        "fsdp-layers": lambda: islands.Stack(inner=islands.inner.FSDP(wrap=islands.inner.ParamThreshold(1))),
    }


def _modes(name: str) -> tuple[str, ...]:
    return FSDP_MODES if name.startswith("fsdp") else MODES


def _train(world, make, mode: str):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from islands.checkpoint.policy.sharded_state import optimizer_state_dict
    from islands.loop.step_body import compile_units
    from islands.runtime.compiled import Compile

    torch._dynamo.reset()  # each compiled case compiles its own graphs (none cached from the case before)
    counters.clear()
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = make()
    if mode == "before":
        model = torch.compile(model, backend=BACKEND)
    model = strategy.wrap(model, opt, world)
    if mode == "after":
        model = torch.compile(model, backend=BACKEND)
    units = compile_units(strategy, model) if mode == "islands" else []
    if mode == "islands":  # as the Trainer's compile= does it
        model = Compile(BACKEND).apply(model, units)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * world.rank + step)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        strategy.after_backward(model, step)
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
        losses.append(loss.item())
    strategy.finish(model)
    state = strategy.state_dict()["inner"]
    hook = state.get("hook", {}).get("compressor", {})
    optim = optimizer_state_dict(model, opt, world)  # collective under FSDP
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "units": len(units),
        "keys": list(model.state_dict()),  # the trained module's own (a whole-model compile adds _orig_mod.)
        "losses": losses,
        "model": {k: v.detach().numpy().copy() for k, v in strategy.eval_model(model).state_dict().items()},
        "hook_keys": sorted(str(k) for k in hook),
        "optimizer_keys": sorted(str(k) for k in optim["state"]),
    }


def _all_cases(world) -> dict:
    return {(name, mode): _train(world, make, mode) for name, make in _strategies().items() for mode in _modes(name)}


def test_compiled_models_train_and_save_as_eager_ones_under_inner_strategies():
    from harness.outer import run_world

    for rank, cases in enumerate(run_world(_all_cases, size=2, islands=1)):
        for name in _strategies():
            eager = cases[(name, "eager")]
            for mode in _modes(name)[1:]:
                got, what = cases[(name, mode)], f"rank {rank}, {name}, compiled {mode} wrap"
                assert got["graphs"] >= 1 and eager["graphs"] == 0, what  # compiled, not an eager fallback
                np.testing.assert_allclose(got["losses"], eager["losses"], rtol=1e-5, atol=1e-6, err_msg=what)
                assert list(got["model"]) == list(eager["model"]), what  # no _orig_mod. / module. prefixes
                for k, v in eager["model"].items():
                    np.testing.assert_allclose(got["model"][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {k}")
                assert got["hook_keys"] == eager["hook_keys"], what  # PowerSGD's state: the eager names
                assert got["optimizer_keys"] == eager["optimizer_keys"], what
        assert cases[("ddp-powersgd", "eager")]["hook_keys"], "PowerSGD kept no per-parameter state to compare"
        assert all(not k.isdigit() for k in cases[("fsdp", "eager")]["optimizer_keys"])  # FSDP's are names
        for name, units in (("fsdp", 1), ("fsdp-layers", 3)):  # the root alone; the root, a and b
            got, what = cases[(name, "islands")], f"rank {rank}, {name} compiled per unit"
            assert got["units"] == units and got["keys"] == cases[(name, "eager")]["keys"], what  # in place
        # the nn.Linear units compile too: a graph each, and one for the root's own code between them (the relu)
        assert cases[("fsdp-layers", "islands")]["graphs"] == 3, f"rank {rank}"


def _digits_job(run_dir, *argv: str) -> dict:
    """`islands train --task digits` on 2 gloo workers under fsdp (the launcher in this process); its run.json."""
    import json

    from harness.cli import islands_cli

    code = islands_cli(
        "train",
        "--task",
        "digits",
        "--workers",
        "2",
        "--inner",
        "fsdp",
        "--steps",
        str(STEPS),
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-probe",
        "--no-progress",
        "--run-dir",
        str(run_dir),
        *argv,
        timeout=180,
    )
    assert code == 0, f"islands train {' '.join(argv)} exited {code}"
    return json.loads((run_dir / "run.json").read_text())


@pytest.mark.slow  # two 2-worker jobs, dynamo tracing each rank's units (~25 s on 2 cores)
def test_cli_compile_under_fsdp_compiles_the_digits_mlp_per_unit_and_trains_as_eager(tmp_path):
    """The digits MLP is a module whose forward calls an nn.Sequential; fsdp's default policy makes each nn.Linear a
    unit. Compiled as a whole it compiled nothing ("nothing compiled", graphs 0); per unit every layer compiles."""
    eager = _digits_job(tmp_path / "eager")
    compiled = _digits_job(tmp_path / "compiled", "--compile", "--compile-backend", BACKEND)
    part = compiled["compile"]
    assert "compile" not in eager and part["backend"] == BACKEND
    assert part["units"] == 4  # the root and the three nn.Linear layers
    assert part["graphs"] == compiled["summary"]["compile_graphs"] >= 3  # a graph per layer at least
    assert part["seconds"] == compiled["summary"]["compile_seconds"] > 0
    losses = [[e["loss"] for e in r["series"]["train"]] for r in (eager, compiled)]
    assert len(losses[1]) == STEPS
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, atol=1e-6)  # fp32 tolerance
