"""The tokenizer that needs no download (islands.data.tokenizer): a byte-level BPE trained on the run's corpus, saved
in the run directory and reused, not retrained, on resume; plain bytes as the other choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from harness.flags import tiny
from islands.cli import main
from islands.data import tokenizer as tk
from islands.data.tokenized import text_shard

pytest.importorskip("tokenizers")
JSON_PKG = Path(sysconfig.get_paths()["stdlib"]) / "json"  # five files, ~48 KB: a corpus every Python has
TEXT = "".join(p.read_text() for p in sorted(JSON_PKG.glob("*.py")))
SAMPLE = "def décode(s):\n    return json.loads(s)  # naïve ✓\n\x00\t"


def test_bpe_train_save_load_round_trip(tmp_path):
    tok = tk.train_bpe([TEXT], 320)
    assert tk.vocab_size(tok) == 320 and tk.eos_id(tok) == 0
    ids = tok.encode(SAMPLE, add_special_tokens=False).ids
    assert len(ids) < len(SAMPLE.encode())  # merges learnt from the corpus shorten it
    assert tok.decode(ids) == SAMPLE  # byte-level: any text, unseen characters included, comes back exact
    path = tk.save(tok, tmp_path / "run" / "tokenizer.json")
    assert not [p for p in path.parent.iterdir() if p.name != "tokenizer.json"]  # no temporary left behind
    back = tk.load(tmp_path / "run")  # a directory holding tokenizer.json works too
    assert back.encode(SAMPLE, add_special_tokens=False).ids == ids and tk.digest(back) == tk.digest(tok)
    assert (tk.encode(back, TEXT) == tk.encode(tok, TEXT)).all()


def test_bpe_training_is_the_same_in_another_process():
    """Every rank trains its own copy: another process (other hash seed, one thread) must get the same tokenizer."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tokenizer as tk; "
        "print(tk.digest(tk.train_bpe([open(sys.argv[2]).read()], 320)))"
    )
    corpus = JSON_PKG / "decoder.py"
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(tk.__file__).parent), str(corpus)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "7", "RAYON_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == tk.digest(tk.train_bpe([corpus.read_text()], 320))


def test_byte_tokenizer_ids_are_the_bytes():
    tok = tk.byte_tokenizer()
    ids = tok.encode(SAMPLE, add_special_tokens=False).ids
    assert ids == list(SAMPLE.encode()) and tok.decode(ids) == SAMPLE
    assert tk.vocab_size(tok) == tk.BYTE_VOCAB == 257 and tk.eos_id(tok) == 256


def test_bad_tokenizers_are_clear_errors(tmp_path):
    with pytest.raises(tk.TokenizerError, match="empty corpus"):
        tk.train_bpe(["", ""], 300)
    with pytest.raises(tk.TokenizerError, match="vocab_size >= 257"):
        tk.train_bpe([TEXT], 100)
    with pytest.raises(tk.TokenizerError, match="no tokenizer at"):
        tk.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(tk.TokenizerError, match="not a tokenizer file"):
        tk.load(tmp_path)
    message = tk.check_fits(tk.train_bpe([TEXT], 400), 320)
    assert "400 tokens but the model's embedding has 320 rows" in message
    assert tk.check_fits(tk.byte_tokenizer(), 320) is None  # a smaller tokenizer leaves rows unused: fine


def test_text_shards_cover_the_corpus_at_line_breaks():
    data = np.frombuffer(TEXT.encode(), dtype=np.uint8)
    parts = [text_shard(data, i, 3) for i in range(3)]
    assert b"".join(parts) == TEXT.encode()
    assert all(p.endswith(b"\n") for p in parts[:-1])


TINY = [
    "--task",
    "hf-causal-lm",
    "--task.model",
    "gpt2",
    "--task.vocab_size",
    "320",
    "--data",
    str(JSON_PKG),
    *tiny(global_batch=2, workers=1, eval_every=0, eval_batches=1, no_probe=True, no_progress=True, threads=1),
]


def train(*argv: str) -> int:
    try:
        main(["train", *TINY, *argv])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_resume_loads_the_runs_tokenizer_instead_of_training_one(tmp_path, capsys):
    assert train("--steps", "2", "--ckpt-every", "2", "--run-dir", str(tmp_path / "a")) == 0
    first = tmp_path / "a" / "tokenizer.json"
    assert tk.vocab_size(tk.load(first)) == 320
    assert json.loads((tmp_path / "a" / "hf_config.json").read_text())["vocab_size"] == 320
    # Replace the run's tokenizer by another one: a resume that retrained would write the original back.
    other = tk.train_bpe([(JSON_PKG / "encoder.py").read_text()], 300)
    tk.save(other, first)
    assert (
        train(
            "--steps",
            "3",
            "--ckpt-every",
            "3",
            "--resume",
            str(tmp_path / "a" / "ckpt" / "step-000002"),
            "--run-dir",
            str(tmp_path / "b"),
        )
        == 0
    )
    assert (tmp_path / "b" / "tokenizer.json").read_text() == first.read_text()
    # A saved tokenizer larger than the model's embedding: exit 2 with the reason, before anything is written.
    tk.save(tk.train_bpe([TEXT], 400), first)
    capsys.readouterr()
    assert train("--steps", "3", "--resume", str(tmp_path / "a"), "--run-dir", str(tmp_path / "c")) == 2
    err = capsys.readouterr().err
    assert "has 400 tokens but the model's embedding has 320 rows" in err, err
    assert not (tmp_path / "c").exists()
