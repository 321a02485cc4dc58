"""The run's loss plot (islands.measure.record.plot_loss): drawn from the validation series, and nothing, not even
matplotlib's import (~0.7 CPU-s), for a run without evaluations."""

from __future__ import annotations

import sys

from islands.measure.record import plot_loss

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
