"""The summary table every run ends with: a run without a validation loss (a user task with no eval data) still
prints its summary instead of failing at its very end; a parameter server's report gets a line of its own."""

from rich.console import Console

from islands.measure.progress import print_finished

SUMMARY = dict(
    strategy="ddp",
    workers=2,
    islands=1,
    steps=10,
    wall_seconds=1.5,
    tokens_per_second=1000.0,
    mb_sent_per_worker=1.0,
    comm_fraction=0.1,
    baseline="per worker: one process",
)


def _printed(record: dict) -> str:
    console = Console(record=True, width=120)
    print_finished(record, console)
    return console.export_text()


def test_a_run_without_a_validation_loss_prints_its_summary():
    out = _printed({"summary": {**SUMMARY, "final_val_loss": None}, "interconnect_line": "gloo"})
    assert "final val loss" in out and "not evaluated" in out


def test_a_validation_loss_prints_to_four_places():
    out = _printed({"summary": {**SUMMARY, "final_val_loss": 2.345678}, "interconnect_line": "gloo"})
    assert "2.3457" in out and "not evaluated" not in out


def _server(cpu, pushes, duplicates) -> dict:
    return dict(
        cpu_seconds=cpu,
        peak_memory_bytes=250e6,
        peak_memory="max_rss",
        pushes_applied=pushes,
        pushes_refused=1,
        duplicates=duplicates,
        windows_stepped=pushes,
        goodput=0.875,
        startup_cpu_seconds=0.5,
    )


def test_a_parameter_servers_report_prints_a_line_and_an_incomplete_one_says_why():
    report = dict(mode="processes", complete=True, missing=None, cpu_seconds=3.0, restarts=1)
    record = {"summary": {**SUMMARY, "final_val_loss": 1.0}, "interconnect_line": "gloo"}
    out = _printed({**record, "parameter_server": {**report, "servers": [_server(1.0, 7, 1), _server(2.0, 7, 2)]}})
    assert "parameter server (processes mode, 2 server(s)): 3.00 CPU-s (1.00 of it start-up)" in out
    assert "peak 500.0 MB (max_rss)" in out
    assert "7 pushes applied, 1 refused, 3 duplicates, 7 outer steps, goodput 87.5%, 1 restart(s)" in out
    gone = {**report, "complete": False, "missing": "the supervisor was killed", "cpu_seconds": None, "servers": []}
    out = _printed({**record, "parameter_server": gone})
    assert "report incomplete: the supervisor was killed" in out and "CPU-s" not in out
    assert "parameter server" not in _printed(record)
