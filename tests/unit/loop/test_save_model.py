"""Every run keeps its model (issue #35 item 6): at the end of a fit rank 0 writes the strategy's global model, after
the final synchronisation, to RUN_DIR/model, whole or not at all; the run record says where; `bar=False`
(`--no-progress`) drops only the live bar, not the summary and the paths."""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, load_model

import islands
from islands.checkpoint.store import model_dir as md
from islands.loop.callbacks import Progress, RunRecord, SaveModel


def _data(n=12):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


class FinalSync(islands.NoOp):
    """An outer strategy in miniature: the global model is a copy the final synchronisation moves (live + 1), so the
    live model and the global one differ at the end."""

    name = "final-sync"

    def __init__(self):
        self.global_model: nn.Module | None = None

    def finish(self, model):
        self.global_model = copy.deepcopy(model)
        with torch.no_grad():
            for p in self.global_model.parameters():
                p.add_(1.0)

    def eval_model(self, model):
        return self.global_model if self.global_model is not None else model


class Tied(nn.Module):
    """Two names for one tensor (as a language model's tied embedding and head): stored once, loaded into both."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.out = nn.Linear(6, 3)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.inp.weight

    def forward(self, x):
        return self.out(self.head(self.inp(x)))


def _trainer(model, callbacks, strategy=None, loss_fn=F.cross_entropy):
    return islands.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn,
        _data(),
        val_data=_data(2),
        strategy=strategy,
        callbacks=callbacks,
        log_every=2,
    )


def test_the_global_model_after_the_final_sync_is_saved_and_recorded(tmp_path):
    torch.manual_seed(0)
    live = Tied()
    strategy = FinalSync()
    trainer = _trainer(live, [SaveModel(tmp_path), RunRecord(tmp_path, probe=False)], strategy=strategy)
    record = trainer.fit(4)
    saved = tmp_path / md.MODEL_DIR
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left
    assert sorted(p.name for p in saved.iterdir()) == [md.INFO_FILE, md.WEIGHTS_FILE]
    fresh = Tied()
    missing, unexpected = load_model(fresh, str(saved / md.WEIGHTS_FILE))
    assert not missing and not unexpected and fresh.head.weight is fresh.inp.weight
    assert strategy.global_model is not None
    for (name, a), b in zip(strategy.global_model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name  # the global model, bit for bit
    assert not torch.equal(fresh.out.weight, live.out.weight)  # not the live one (global = live + 1)
    assert len(load_file(str(saved / md.WEIGHTS_FILE))) == 3  # the tied tensor once
    info = json.loads((saved / md.INFO_FILE).read_text())
    assert info == {"format": "safetensors", "step": 4, "strategy": "final-sync", "class": "Tied"}
    on_disk = json.loads((tmp_path / "run.json").read_text())["model"]
    assert on_disk == record["model"]
    assert on_disk["dir"] == str(saved) and on_disk["step"] == 4 and on_disk["files"] == [md.INFO_FILE, md.WEIGHTS_FILE]
    assert on_disk["bytes"] == sum((saved / f).stat().st_size for f in on_disk["files"])


class Rank:
    """What SaveModel reads of a trainer, on a chosen rank; counts how often the global model was asked for."""

    def __init__(self, rank: int, model: nn.Module):
        self.world = islands.World(rank=rank, size=2, islands=2, device=torch.device("cpu"), backend="gloo")
        self.step, self.strategy, self.model, self.asked = 7, islands.NoOp(), model, 0

    @property
    def eval_model(self):
        self.asked += 1  # under fsdp and the pipeline a collective: every rank must take part
        return self.model


def test_only_rank_0_writes_but_every_rank_gathers(tmp_path):
    zero, one = SaveModel(tmp_path / "a"), SaveModel(tmp_path / "b")
    r0, r1 = Rank(0, nn.Linear(2, 2)), Rank(1, nn.Linear(2, 2))
    zero.on_fit_end(r0)
    one.on_fit_end(r1)
    assert r0.asked == r1.asked == 1
    assert (tmp_path / "a" / md.MODEL_DIR / md.WEIGHTS_FILE).is_file() and zero.record()["step"] == 7
    assert not (tmp_path / "b").exists() and one.record() is None  # run.json gets no model entry from rank 1


def test_a_fit_that_fails_leaves_no_model(tmp_path):
    calls = []

    def breaks(pred, y):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the step failed")
        return F.cross_entropy(pred, y)

    trainer = _trainer(nn.Linear(6, 3), [SaveModel(tmp_path)], loss_fn=breaks)
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer.fit(6)
    assert list(tmp_path.iterdir()) == []


class Breaks:
    """A writer that writes part of a model, then fails (a full disk, a model it cannot serialise)."""

    format = "safetensors"

    def write(self, model, directory):
        (directory / md.WEIGHTS_FILE).write_bytes(b"half")
        raise OSError("no space left on device")


def test_a_write_is_whole_or_nothing_and_an_older_model_survives_a_failed_one(tmp_path):
    target = tmp_path / md.MODEL_DIR
    with pytest.raises(OSError, match="no space"):
        md.write_model_dir(target, Breaks(), nn.Linear(2, 2), {"step": 1})
    assert list(tmp_path.iterdir()) == []  # neither the model directory nor a temporary

    first = nn.Linear(2, 2)
    assert md.write_model_dir(target, md.SafetensorsWriter(), first, {"step": 1}) == [md.INFO_FILE, md.WEIGHTS_FILE]
    with pytest.raises(OSError):
        md.write_model_dir(target, Breaks(), nn.Linear(2, 2), {"step": 2})
    assert md.read_info(target) == {"format": "safetensors", "step": 1}
    assert torch.equal(load_file(str(target / md.WEIGHTS_FILE))["weight"], first.weight)

    # a process killed mid-write leaves a hidden temporary: the next write removes it and replaces the model
    (tmp_path / f".{md.MODEL_DIR}{md.TMP_MARK}dead").mkdir()
    (tmp_path / f".{md.MODEL_DIR}{md.TMP_MARK}dead" / md.WEIGHTS_FILE).write_bytes(b"half")
    second = nn.Linear(2, 2)
    md.write_model_dir(target, md.SafetensorsWriter(), second, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [md.MODEL_DIR]
    assert md.read_info(target)["step"] == 2
    assert torch.equal(load_file(str(target / md.WEIGHTS_FILE))["weight"], second.weight)
    assert md.read_info(tmp_path / "nowhere") is None


def _fit_printing(tmp_path, progress):
    trainer = _trainer(nn.Linear(6, 3), [progress, SaveModel(tmp_path), RunRecord(tmp_path, probe=False)])
    trainer.fit(4)


def test_no_bar_keeps_the_log_lines_summary_and_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes stdout for a terminal: where the bar would draw
    _fit_printing(tmp_path / "bar", Progress(bar=True))
    with_bar = capsys.readouterr().out
    _fit_printing(tmp_path / "plain", Progress(bar=False))
    plain = capsys.readouterr().out
    assert "tok/s" in with_bar and "tok/s" not in plain  # the live bar's column: only where it draws
    for out, run in ((with_bar, tmp_path / "bar"), (plain, tmp_path / "plain")):
        assert "val loss" in out and "islands run summary" in out
        assert f"run record: {run / 'run.json'}" in out
        assert f"model: {run / md.MODEL_DIR} (step 4, safetensors)" in out
    _fit_printing(tmp_path / "quiet", Progress(enabled=False))
    assert capsys.readouterr().out == ""  # enabled=False: a callback that prints nothing at all


def test_parameters_that_are_views_into_one_buffer_are_saved_whole(tmp_path):
    """The pipeline's gathered model holds its parameters as views into one flat buffer; a file takes whole tensors."""
    model = nn.Linear(3, 2)
    flat = torch.arange(8, dtype=torch.float32)
    model.weight.data = flat[:6].view(2, 3)
    model.bias.data = flat[6:]
    md.write_model_dir(tmp_path / "m", md.SafetensorsWriter(), model, {"step": 0})
    back = nn.Linear(3, 2)
    load_model(back, str(tmp_path / "m" / md.WEIGHTS_FILE))
    assert torch.equal(back.weight, flat[:6].view(2, 3)) and torch.equal(back.bias, flat[6:])
