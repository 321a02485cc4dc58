"""inner=fsdp through the real path: config validation, the CLI, the launcher and the one training loop
(AdamW, gradient clipping on sharded gradients, evaluation on the gathered copy, the run record)."""

import json

import pytest

from harness.cli import islands_cli
from harness.flags import tiny
from islands.app.validate import validate
from islands.config import ConfigError, from_mapping


@pytest.mark.slow  # one real job: about 15 s idle, far more on a shared machine
def test_fsdp_job_trains_and_records_its_bytes(tmp_path, capfd):
    run = tmp_path / "run"
    code = islands_cli(  # the CLI in this process (harness.cli)
        "train",
        "--workers",
        "2",
        "--inner",
        "fsdp",
        "--wrap",
        "graph:3",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--log-every",
        "3",
        *tiny(n_layers=2, eval_batches=2, threads=1, no_progress=True),
        "--run-dir",
        str(run),
        timeout=180,
    )
    assert code == 0, capfd.readouterr().err[-3000:]
    rec = json.loads((run / "run.json").read_text())
    assert rec["summary"]["strategy"] == "fsdp" and rec["summary"]["steps"] == 6
    val = rec["series"]["val"]
    assert val[-1]["val_loss"] < val[0]["val_loss"]  # it learns, and evaluation sees the trained model
    for ledger in rec["comm"]["per_rank"]:
        assert ledger["calls"]["fsdp_reduce_scatter"] == 6 * 3  # three units, once per step
        assert ledger["calls"]["fsdp_all_gather"] == 6 * (2 * 2 + 1)  # two units twice, the root once
        assert ledger["calls"]["fsdp_grad_norm"] == 6  # the trainer clips by the global norm
        assert ledger["sent"]["fsdp_eval_gather"] > 0  # the gathered copy for evaluation went through Comm


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"wrap": "graph:x"}, "units, which takes int"),
        ({"wrap": "layers"}, "unknown wrap policy"),
        ({"inner": "fsdp", "compress": "topk:ratio=0.1"}, "inner.strategy=fsdp"),
        ({"inner": "fsdp", "islands": 2, "outer": "local-sgd:every=4"}, "inner.strategy=fsdp"),
    ],
)
def test_bad_fsdp_configs_are_rejected_with_the_fix(bad, message):
    cfg = from_mapping({"workers": 4, "global_batch": 32, **bad})
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
