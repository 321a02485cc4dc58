"""Models compiled with torch.compile under islands (islands.runtime.compiled; docs/own-model.md, "Compiled models").

Most tests use torch's aot_eager backend: it traces forward and backward into graphs as inductor does (so the model
islands sees is the compile wrapper, with its `_orig_mod.` names) but generates no C++, which on this 2-core machine
keeps each compile to about a second. What they check is islands' plumbing (names, checkpoints, strategies), not the
generated code; `test_inductor_trainer_matches_eager` is the one that compiles with inductor.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import islands
from islands.loop.step_body import compile_units
from islands.runtime.compiled import Compile, as_compile, check_backend, graphs_compiled, is_compiled, uncompiled
from islands.sync.base import CompilesByUnit

BACKEND = "aot_eager"
STEPS = 8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


@contextmanager
def compiles():
    """Fresh torch.compile caches, and a check that the block compiled a graph: a graph cached by an earlier test, or
    torch's fallback to eager after too many recompiles, would let a compiled run pass without compiling."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_uncompiled_peels_the_compile_wrapper_and_eval_model_gives_eager_keys():
    plain = mlp()
    compiled = torch.compile(plain, backend=BACKEND)
    assert is_compiled(compiled) and not is_compiled(plain)
    assert uncompiled(compiled) is plain and uncompiled(plain) is plain
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")  # what torch gives: the reason for uncompiled
    for strategy in (islands.NoOp(), islands.inner.Single(), islands.Stack()):
        assert list(strategy.eval_model(compiled).state_dict()) == list(plain.state_dict())


def test_compile_settings_refuse_what_torch_would_not_take():
    assert as_compile(True) == Compile() and as_compile(False) is None and as_compile(None) is None
    with pytest.raises(ValueError, match="max-autotune"):
        Compile(mode="fastest")
    with pytest.raises(TypeError, match=r"islands\.Compile"):
        as_compile("inductor")
    with pytest.raises(ValueError, match="aot_eager"):  # the message lists the backends torch has
        check_backend("no-such-backend", "cpu")


def test_compile_record_is_the_first_steps_excess_over_the_median():
    rec = Compile(backend=BACKEND).record([5.0, 0.2, 0.1, 0.3])
    assert rec["seconds"] == pytest.approx(4.8) and rec["steady_step_seconds"] == pytest.approx(0.2)
    assert rec["backend"] == BACKEND and "first step" in rec["definition"]
    assert Compile().record([1.0])["seconds"] is None  # one step: nothing steady to subtract
    assert Compile().record([1.0, 0.5], graphs=3)["graphs"] == 3
    assert Compile().record([1.0, 0.5])["units"] == 0 and Compile().record([1.0], units=4)["units"] == 4


class _NamesUnits(islands.NoOp):
    """A strategy that names the units the Trainer's compile compiles one by one, as fsdp names what fully_shard
    wrapped (islands.sync.base.CompilesByUnit; the real one: tests/integration/parallel/test_compiled_inner.py)."""

    def __init__(self, *units: nn.Module):
        self.units = list(units)

    def compile_units(self) -> list[nn.Module]:
        return self.units


@pytest.mark.slow  # dynamo traces two layers (about a second of CPU): make test, not make test-fast
def test_compile_per_unit_compiles_each_units_forward_in_place():
    model = mlp()
    x, y = batch(0)
    eager = mlp()
    F.cross_entropy(eager(x), y).backward()
    strategy = _NamesUnits(model[0], model[2])  # the two nn.Linear layers of the nn.Sequential
    assert isinstance(strategy, CompilesByUnit)
    units = compile_units(strategy, model)
    assert units == [model[0], model[2]]
    with compiles():
        compiled = Compile(BACKEND).apply(model, units)
        assert compiled is model and not is_compiled(model)  # in place: no wrapper
        F.cross_entropy(compiled(x), y).backward()
        assert graphs_compiled() == 2  # one per layer; the nn.ReLU between them runs eagerly in nn.Sequential
    assert list(model.state_dict()) == list(eager.state_dict())  # the eager keys, no _orig_mod.
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # a model the user compiled themselves is theirs: islands compiles what it was given as a whole
    assert compile_units(strategy, torch.compile(mlp(), backend=BACKEND)) == []


class _Uncompilable(nn.Module):
    """A forward torch.compile is told not to trace: compiled, it runs eagerly, as a bare nn.Sequential inside DDP
    does (docs/own-model.md)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    @torch.compiler.disable
    def forward(self, x):
        return self.lin(x)


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
def test_a_compiled_model_that_compiled_nothing_says_so():
    def graphs(model) -> int:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = islands.Trainer(model, opt, F.cross_entropy, dataset(), batch_size=8, compile=Compile(BACKEND))
        trainer.fit(2)
        return trainer.record_parts()["compile"]["graphs"]

    assert graphs(_Uncompilable()) == 0
    assert graphs(mlp()) >= 1  # the same count sees a graph where one was compiled


def _fit_simulated(make_strategy, compile) -> list:
    """2 simulated islands (threads of this process) train the MLP for STEPS steps with the Trainer."""

    def main(world):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = islands.Trainer(
            model,
            opt,
            F.cross_entropy,
            dataset(),
            batch_size=8,
            strategy=make_strategy(),
            world=world,
            log_every=1,
            compile=compile,
        )
        trainer.fit(STEPS)
        parts = trainer.record_parts()
        return [e["loss"] for e in trainer.series["train"]], snapshot(trainer.eval_model), parts.get("compile")

    return islands.simulate.run(main, islands=2)


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
@pytest.mark.parametrize(
    "make_strategy",
    [
        lambda: islands.outer.DiLoCo(inner_steps=3),
        lambda: islands.outer.StreamingDiLoCo(inner_steps=4),  # fragments, and the 4-bit compressor on the deltas
    ],
    ids=["diloco", "streaming-diloco-quant4"],
)
def test_compiled_trainer_matches_eager_under_outer_strategies(make_strategy):
    eager = _fit_simulated(make_strategy, None)
    with compiles():
        compiled = _fit_simulated(make_strategy, Compile(backend=BACKEND))
    for (e_loss, e_model, e_rec), (c_loss, c_model, c_rec) in zip(eager, compiled):
        assert len(c_loss) == STEPS
        torch.testing.assert_close(c_loss, e_loss, rtol=1e-5, atol=1e-6)  # fp32 tolerance
        assert list(c_model) == list(e_model)  # the global model under the eager names
        for k in e_model:
            torch.testing.assert_close(c_model[k], e_model[k], rtol=1e-5, atol=1e-6)
        assert e_rec is None and c_rec["backend"] == BACKEND and c_rec["seconds"] >= 0


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
def test_simulated_islands_record_the_compile_they_share():
    """Simulated islands are threads of one process: they share torch.compile's cache and its graph counter, so the
    island that steps first compiles the graph every other island reuses. Each island recorded only its own steps
    and the graphs compiled after its own Trainer was built: island 0, whose record is run.json's, said "nothing
    compiled" and a compile time of ~0 when island 1 had compiled first (`islands train --simulate --compile`)."""
    with compiles():
        records = [rec for _, _, rec in _fit_simulated(lambda: islands.outer.DiLoCo(inner_steps=3), Compile(BACKEND))]
    assert records[0] == records[1]  # every island records the job's one compile
    assert records[0]["graphs"] >= 1
    assert records[0]["seconds"] > records[0]["steady_step_seconds"]  # the first step that compiled, not a warm one


def _own_loop(ckpt_dir, compile_at: str, steps: int, every: int) -> tuple[list[float], dict]:
    """The own-loop API (docs/own-model.md section 1) under DiLoCo, compiled `before` or `after` wrap or not at all
    (""), resuming from the newest checkpoint in `ckpt_dir` and saving every `every` steps (0: never)."""
    world = islands.World.single()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=3))
    if compile_at == "before":
        model = torch.compile(model, backend=BACKEND)
    model = strategy.wrap(model, opt, world)
    if compile_at == "after":
        model = torch.compile(model, backend=BACKEND)
    losses = []
    with islands.Checkpointer(ckpt_dir, world, every=every or 10**6, asynchronous=False) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt, strategy=strategy) or 0
        for step in range(start, steps):
            x, y = batch(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            strategy.after_backward(model, step)
            opt.step()
            opt.zero_grad()
            strategy.after_step(model, opt, step)
            losses.append(loss.item())
            ckpt.maybe_save(step + 1, model=model, optimizer=opt, strategy=strategy)
    strategy.finish(model)
    return losses, snapshot(strategy.eval_model(model))


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
def test_checkpoints_resume_bit_for_bit_and_load_across_compiled_and_eager(tmp_path):
    half = STEPS // 2
    with compiles():
        whole_compiled = _own_loop(tmp_path / "whole-c", "after", STEPS, every=0)
    whole_eager = _own_loop(tmp_path / "whole-e", "", STEPS, every=0)
    with compiles():
        _own_loop(tmp_path / "half-c", "before", half, every=half)  # a compiled run's checkpoint at step 4
    _own_loop(tmp_path / "half-e", "", half, every=half)  # an eager run's
    shutil.copytree(tmp_path / "half-c", tmp_path / "half-c2")
    with compiles():
        from_compiled = _own_loop(tmp_path / "half-c", "after", STEPS, 0)
    with compiles():
        from_eager = _own_loop(tmp_path / "half-e", "before", STEPS, 0)
    resumed = {
        "compiled from compiled": (from_compiled, whole_compiled),
        "eager from compiled": (_own_loop(tmp_path / "half-c2", "", STEPS, 0), whole_eager),
        "compiled from eager": (from_eager, whole_compiled),
    }
    # aot_eager runs the eager kernels, so a compiled run equals an eager one bit for bit: the resumed runs of
    # every pair must then equal the uninterrupted ones exactly (losses after the restore, global model)
    assert whole_compiled[0] == whole_eager[0]
    for what, ((losses, model), (whole_losses, whole_model)) in resumed.items():
        assert losses == whole_losses[half:], what
        assert list(model) == list(whole_model), what
        assert all(torch.equal(model[k], whole_model[k]) for k in model), what


@pytest.mark.slow  # inductor's first compile costs ~15 s of CPU with a cold cache (~5 s warm); not in make test-fast
def test_inductor_trainer_matches_eager():
    """The real backend: inductor generates C++ kernels for forward and backward (this machine's gcc)."""

    def fit(compile):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = islands.Trainer(model, opt, F.cross_entropy, dataset(), batch_size=8, log_every=1, compile=compile)
        trainer.fit(6)
        return [e["loss"] for e in trainer.series["train"]], snapshot(trainer.eval_model), trainer.record_parts()

    e_loss, e_model, e_parts = fit(None)
    with compiles():
        c_loss, c_model, c_parts = fit(True)
    torch.testing.assert_close(c_loss, e_loss, rtol=1e-5, atol=1e-6)
    assert list(c_model) == list(e_model)
    for k in e_model:
        torch.testing.assert_close(c_model[k], e_model[k], rtol=1e-5, atol=1e-6)
    assert "compile" not in e_parts
    rec = c_parts["compile"]
    assert rec["backend"] == "inductor" and rec["seconds"] > rec["steady_step_seconds"]  # compiling is not free


def _train(argv: list[str], capsys) -> tuple[int, str, str]:
    from islands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--task", "digits", "--workers", "1", "--no-probe", "--no-progress", *argv])
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
def test_cli_compile_records_its_time_in_run_json_and_the_summary(tmp_path, capsys):
    """One worker runs in this process (islands.cli.cmd_train): the digits MLP, compiled after wrap with aot_eager."""
    import json

    run_dir = tmp_path / "run"
    argv = ["--steps", "4", "--eval-every", "0", "--compile", "--compile-backend", BACKEND, "--run-dir", str(run_dir)]
    code, out, err = _train(argv, capsys)
    assert code == 0, err
    record = json.loads((run_dir / "run.json").read_text())
    assert record["config"]["train"]["compile"] is True
    part = record["compile"]
    assert part["backend"] == BACKEND and part["mode"] == "default"
    assert part["seconds"] == record["summary"]["compile_seconds"] > 0
    assert part["seconds"] == pytest.approx(part["first_step_seconds"] - part["steady_step_seconds"])
    assert part["graphs"] == record["summary"]["compile_graphs"] >= 1
    assert "compile time" in out and "first step over a steady one" in out and "graph(s)" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--compile", "--compile-backend", "no-such-backend"], ["compile backend 'no-such-backend'", "inductor"]),
        (["--compile-mode", "fastest"], ["mode='fastest'", "max-autotune"]),
        (["--compile", "--inner", "pipeline", "--workers", "2"], ["train.compile", "inner.strategy=pipeline"]),
    ],
    ids=["backend", "mode", "pipeline"],
)
def test_cli_compile_refuses_bad_settings_before_training(argv, words, tmp_path, capsys):
    code, _, err = _train([*argv, "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2
    for w in words:
        assert w in err, (w, err)
    assert "Traceback" not in err and not (tmp_path / "r").exists()


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.slow  # dynamo traces the model (seconds of CPU each): make test, not make test-fast
def test_an_elastic_rounds_buffer_snapshot_does_not_recompile_the_model_every_round():
    """In an elastic job an outer strategy snapshots the buffers at each round's first forward (a forward pre-hook).
    Traced into the compiled graph, its check of the round count recompiled the model every round, and after torch's
    limit of 8 the model ran eagerly; it runs outside the graph. The membership is the contracts test's double."""
    from test_contracts import _elastic_world, _Membership
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _BatchNormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = islands.outer.DiLoCo(inner_steps=1)  # a round every step
    strategy = islands.Stack(inner=islands.inner.Single(), outer=outer)
    model = torch.compile(strategy.wrap(model, opt, _elastic_world(_Membership())), backend=BACKEND)
    with compiles():
        for step in range(10):  # more rounds than torch's 8 recompiles
            x, _ = batch(step)
            model(x).square().mean().backward()
            strategy.after_backward(model, step)
            opt.step()
            opt.zero_grad()
            strategy.after_step(model, opt, step)
            assert outer._round_seen == step == outer.rounds - 1  # the snapshot of this round's start was taken
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph for every round
