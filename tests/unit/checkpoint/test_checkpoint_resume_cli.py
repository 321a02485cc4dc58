"""`islands ckpt ...` wired through the real argument parser: tables, --json, exit codes."""

import json

import pytest
import torch
from safetensors.torch import save_file

from islands.checkpoint import CheckpointStore
from islands.cli import build_parser
from islands.cli_more import UsageError


def run(argv):
    args = build_parser().parse_args(argv)
    return args.fn(args)


def test_ckpt_verbs(tmp_path, capsys):
    store = CheckpointStore(tmp_path / "c")
    for step in (1, 2):
        store.save({"model": {"w": torch.full((64,), float(step)), "b": torch.zeros(3)}, "step": step}, step)
    assert run(["ckpt", "ls", str(tmp_path / "c"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["latest"]
    assert run(["ckpt", "diff", str(store.path_for(1)), str(store.path_for(2)), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["changed"] == ["model/w"] and d["same"] == ["model/b"]
    assert run(["ckpt", "inspect", str(store.path_for(2))]) == 0
    assert "model/w" in capsys.readouterr().out
    assert run(["ckpt", "verify", str(tmp_path / "c")]) == 0
    data = store.path_for(2) / "rank00000.data"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert run(["ckpt", "verify", str(tmp_path / "c")]) == 1  # damage is exit 1, not a usage error
    with pytest.raises(UsageError, match="not a directory"):
        run(["ckpt", "ls", str(tmp_path / "missing")])
    src = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(100, 7).to(torch.bfloat16), "i": torch.arange(9)}, str(src))
    assert run(["ckpt", "compress", str(src), str(tmp_path / "w.isl")]) == 0
    assert run(["ckpt", "decompress", str(tmp_path / "w.isl"), str(tmp_path / "w2.safetensors")]) == 0
    assert (tmp_path / "w2.safetensors").read_bytes() == src.read_bytes()


def test_async_snapshot_reuses_finished_staging_buffers_only():
    from islands.checkpoint.store import AsyncCheckpointer

    class Keep:
        def __init__(self):
            self.seen = []

        def save(self, tree, step, **kw):
            self.seen.append((step, tree["w"], tree["w"].clone()))

    sink = Keep()
    writer = AsyncCheckpointer(sink)
    live = {"w": torch.zeros(1000)}
    for step in range(3):
        live["w"].fill_(step)
        writer.save(live, step).wait(10)
    writer.close(10)
    ptrs = [t.data_ptr() for _, t, _ in sink.seen]
    assert ptrs[1] == ptrs[2] and ptrs[0] == ptrs[1]  # each persist had finished: its buffer is reused
    assert [float(c[0]) for _, _, c in sink.seen] == [0.0, 1.0, 2.0]  # each persist read its own step
    assert live["w"].data_ptr() not in ptrs  # never the live tensor
