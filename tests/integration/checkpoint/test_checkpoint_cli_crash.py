"""CLI functions, and kill -9 in the middle of saves."""

import random
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from islands.checkpoint import CheckpointStore, cli
from islands.checkpoint.store.manifest import data_name


def test_cli_functions_report_and_detect_damage(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=5)
    store.save({"a": torch.ones(10), "b": torch.zeros(3), "config_fingerprint": "x"}, 1)
    store.save({"a": torch.ones(10) * 2, "b": torch.zeros(3), "c": torch.ones(1), "config_fingerprint": "y"}, 2)
    rows, table = cli.ls(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["latest"] and table.row_count == 2
    body, _ = cli.inspect(tmp_path / "step-000002")
    assert set(body["tensors"]) == {"a", "b", "c"}
    d, _ = cli.diff(tmp_path / "step-000001", tmp_path / "step-000002")
    assert d["changed"] == ["a"] and d["same"] == ["b"] and d["only_b"] == ["c"] and d["fingerprint_a"] == "x"
    ok, _ = cli.verify(tmp_path)
    assert ok["ok"]
    f = tmp_path / "step-000002" / data_name(0)
    raw = bytearray(f.read_bytes())
    raw[5] ^= 1
    f.write_bytes(bytes(raw))
    bad, text = cli.verify(tmp_path / "step-000002")
    assert not bad["ok"] and "DAMAGED" in text.plain


def test_cli_compress_decompress(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(50, 20)}, str(tmp_path / "m.safetensors"))
    stats, _ = cli.compress_file(tmp_path / "m.safetensors", tmp_path / "m.isc")
    cli.decompress_file(tmp_path / "m.isc", tmp_path / "n.safetensors")
    assert (tmp_path / "n.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    assert cli.verify(tmp_path / "m.isc")[0]["ok"]


# A process that saves deterministic states in a loop, resuming from the newest one it finds.
SAVER = """
import sys, torch
from islands.checkpoint import CheckpointStore, NoCheckpoint
store = CheckpointStore(sys.argv[1], keep_last=2)
try:
    step = store.load().step + 1
except NoCheckpoint:
    step = 0
while True:
    store.save({"step": step, "w": torch.randn(50_000, generator=torch.Generator().manual_seed(step))}, step)
    print(step, flush=True)
    step += 1
"""


@pytest.mark.slow  # spawns 3 interpreters that import torch
def test_sigkill_during_saves_never_loses_the_previous_checkpoint(tmp_path):
    rng, root = random.Random(1), tmp_path / "store"
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)  # saving has begun: one save is done
            assert ready, "the saver never finished a save"
            proc.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.4))  # most kills land inside a later save
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
        loaded = CheckpointStore(root, keep_last=2).load()  # as a restarted job opens it: partial saves cleaned
        assert loaded.skipped == []  # a committed checkpoint that does not load is a failure, even with a fallback
        expect = torch.randn(50_000, generator=torch.Generator().manual_seed(loaded.step))
        assert loaded.tree["step"] == loaded.step and torch.equal(loaded.tree["w"], expect)
