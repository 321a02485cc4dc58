"""The summary table every run ends with: a run without a validation loss (a user task with no eval data) still
prints its summary instead of failing at its very end."""

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
