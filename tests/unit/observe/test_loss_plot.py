"""The run's loss plot (islands.measure.record.plot_loss): drawn from the validation series, and nothing, not even
matplotlib's import (~0.8 CPU-s), for a run without evaluations; under islands' launchers the launcher draws it."""

from __future__ import annotations

import sys

from islands.measure.record import LAUNCHER_PLOTS_ENV, finish_record, plot_finished_run, plot_loss

RECORD = {
    "summary": {"strategy": "diloco", "workers": 2, "islands": 2},
    "interconnect_line": "loopback",
}


def test_a_run_without_evaluations_gets_no_plot_and_does_not_import_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it raises ImportError
    plot_loss({**RECORD, "series": {"val": []}}, tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_a_run_with_evaluations_gets_its_plot(tmp_path):
    val = [{"step": s, "val_loss": 3.0 - 0.1 * s, "mb_sent": 0.5 * s} for s in range(0, 50, 10)]
    plot_loss({**RECORD, "series": {"val": val}}, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_worker_whose_launcher_plots_writes_the_record_only_and_the_launcher_draws_it(tmp_path, monkeypatch):
    """islands' launchers set LAUNCHER_PLOTS_ENV for their workers: rank 0 writes run.json without matplotlib, and
    the launcher's plot_finished_run draws loss.png from it once the job has ended."""
    val = [{"step": s, "val_loss": 3.0 - 0.1 * s, "mb_sent": 0.5 * s} for s in range(0, 50, 10)]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # the worker's side must not import it
        finish_record(tmp_path, {**RECORD, "series": {"val": val}}, plot=False)
    assert (tmp_path / "run.json").is_file() and not (tmp_path / "loss.png").exists()
    plot_finished_run(tmp_path)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_launchers_plot_is_nothing_when_no_worker_wrote_a_record(tmp_path):
    plot_finished_run(tmp_path)  # a job that failed before its end
    assert list(tmp_path.iterdir()) == []


def test_the_workers_entry_points_take_the_launchers_word_from_the_environment(monkeypatch, tmp_path):
    from islands.app import elastic_worker, worker

    seen = {}
    monkeypatch.setattr(worker, "run_worker", lambda cfg, run_dir, plot: seen.setdefault("worker", plot))
    monkeypatch.setattr(worker, "load_json", lambda path: None)
    monkeypatch.setattr(elastic_worker, "run_elastic_worker", lambda *a, plot: seen.setdefault("elastic", plot))
    monkeypatch.setenv(LAUNCHER_PLOTS_ENV, "1")
    assert worker.main(["config.json", str(tmp_path)]) == 0
    assert elastic_worker.main(["127.0.0.1:1", str(tmp_path)]) == 0
    assert seen == {"worker": False, "elastic": False}
    seen.clear()
    monkeypatch.delenv(LAUNCHER_PLOTS_ENV)  # `islands join`, torchrun: the worker that writes run.json plots
    worker.main(["config.json", str(tmp_path)])
    elastic_worker.main(["127.0.0.1:1", str(tmp_path)])
    assert seen == {"worker": True, "elastic": True}
