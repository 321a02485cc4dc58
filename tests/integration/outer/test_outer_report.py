"""DiLoCo's outer_exchanges.json (the bytes rank 0 sent per exchange) is written at the end of every run,
also when the last step ended a round and so no final synchronisation ran (bench streaming reads it)."""

from __future__ import annotations

import functools
import json

import pytest
from test_outer_dist import Run

from harness.outer import run_world

CASES = {  # spec, steps: the first ends on a round boundary, the others mid-round or with a fragment in flight
    "diloco-on-boundary": ("diloco:inner_steps=2", 4),
    "diloco-mid-round": ("diloco:inner_steps=3", 4),
    "streaming": ("streaming-diloco:inner_steps=4,fragments=2,tau=1,block=16", 8),
}


def _reports(world, root: str) -> None:
    for name, (spec, steps) in CASES.items():
        run = Run(world, spec)
        run.strategy.report_dir = f"{root}/{name}"
        for i in range(steps):
            run.step(i)
        run.finish()


@pytest.mark.slow  # two spawned gloo ranks: a few seconds
def test_every_diloco_run_writes_its_exchange_report(tmp_path):
    run_world(functools.partial(_reports, root=str(tmp_path)), size=2, islands=2)
    exchanges = {
        name: json.loads((tmp_path / name / "outer_exchanges.json").read_text())["exchanges"] for name in CASES
    }
    # streaming: a fragment every 2 steps (4 sends), then the final synchronisation sends both fragments
    assert exchanges == {"diloco-on-boundary": 2, "diloco-mid-round": 2, "streaming": 6}
