"""Local JSON lines, Parquet and text files through `datasets` for hf-causal-lm: streamed, tokenised once into a
cache, sharded per rank, the read position in the saved state (a resumed run reads exactly the next batch); a
missing column or an empty corpus is a message and exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from harness.flags import tiny
from harness.hf import JSON_PKG
from islands.checkpoint.store.directory import CheckpointStore
from islands.cli import main
from islands.data import (
    token_cache,
    tokenizer as tk,
)
from islands.data.documents import DocumentSource
from islands.data.token_cache import ArrayWindows, tokenise_once

# ~48 KB of text as 130-odd documents: the json package's source cut into blank-line-separated pieces
DOCS = [d for p in sorted(JSON_PKG.glob("*.py")) for d in p.read_text().split("\n\n") if d.strip()]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path / "cache"))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    half = len(DOCS) // 2
    for i, part in enumerate((DOCS[:half], DOCS[half:])):
        pq.write_table(pa.table({"body": part}), tmp_path / f"part{i}.parquet")
    return tmp_path


def test_documents_stream_in_order_with_a_held_out_split(corpus):
    src = DocumentSource(str(corpus / "docs.jsonl"))
    assert src.check() is None
    train, val = list(src.documents("train")), list(src.documents("val"))
    assert val == DOCS[::20] and len(train) + len(val) == len(DOCS)
    parquet = DocumentSource(str(corpus / "part*.parquet"), column="body")
    assert parquet.check() is None and len(parquet.files) == 2
    assert list(parquet.documents("all")) == DOCS
    assert "'text' is not a column" in DocumentSource(str(corpus / "part*.parquet")).check()
    assert "its columns are 'body'" in DocumentSource(str(corpus / "part*.parquet")).check()
    assert "matches no files" in DocumentSource(str(corpus / "*.csv")).check()
    (corpus / "empty.jsonl").write_text("")
    assert "holds no documents" in DocumentSource(str(corpus / "empty.jsonl")).check()


def test_tokenised_once_then_read_from_the_cache(corpus, monkeypatch):
    src = DocumentSource(str(corpus / "docs.jsonl"))
    tok = tk.train_bpe(src.documents("train"), 320)
    encode = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    first = tokenise_once(src.documents, encode, tk.eos_id(tok), 320, "k1")
    assert first.train.dtype == np.uint16 and first.meta["train"]["documents"] == len(DOCS) - len(DOCS[::20])
    ids = tok.encode(DOCS[1], add_special_tokens=False).ids
    assert first.train[: len(ids) + 1].tolist() == ids + [tk.eos_id(tok)]  # documents end with EOS

    def refuse(texts):
        raise AssertionError("tokenised twice")

    again = tokenise_once(src.documents, refuse, tk.eos_id(tok), 320, "k1")  # the cache answers
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    assert src.identity() != DocumentSource(str(corpus / "docs.jsonl"), column="body").identity()


def test_loader_resumes_at_the_exact_next_batch_and_shards_by_rank(corpus):
    tokens = np.arange(10_000, dtype=np.uint16)
    a = ArrayWindows(tokens, 16, 4, 0, 2, seed=3)
    for _ in range(7):
        a.next()
    state = a.state_dict()
    b = ArrayWindows(tokens, 16, 4, 0, 2, seed=3)
    b.load_state_dict(state)
    for _ in range(400):  # across epoch boundaries too
        xa, ya = a.next()
        xb, yb = b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the next tokens
    other = ArrayWindows(tokens, 16, 4, 1, 2, seed=3)
    assert int(xa.max()) < 5000 <= int(other.next()[0].min())  # rank 1 reads only its half


def _train(*argv: str) -> int:
    try:
        main(
            [
                "train",
                "--task",
                "hf-causal-lm",
                "--task.model",
                "llama",
                *tiny(
                    global_batch=2, workers=1, eval_every=0, eval_batches=1, warmup=0, no_probe=True, no_progress=True
                ),
                "--task.vocab_size",
                "320",
                *argv,
            ]
        )
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_parquet_run_resumes_bitwise_and_bad_columns_exit_2(corpus, capsys):
    data = ["--data", str(corpus / "part*.parquet"), "--task.text_column", "body"]
    assert _train(*data, "--steps", "4", "--ckpt-every", "2", "--run-dir", str(corpus / "a")) == 0
    assert (
        _train(
            *data,
            "--steps",
            "4",
            "--ckpt-every",
            "2",
            "--resume",
            str(corpus / "a" / "ckpt" / "step-000002"),
            "--run-dir",
            str(corpus / "b"),
        )
        == 0
    )
    a = CheckpointStore(corpus / "a" / "ckpt", clean=False).load(4).tree
    b = CheckpointStore(corpus / "b" / "ckpt", clean=False).load(4).tree
    assert a["loader"] == b["loader"] and a["loader"]["cursor"] > 0
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # the same batches, in the same order
    assert len(list((corpus / "cache" / "tokens").glob("*/meta.json"))) == 1  # tokenised once for both runs
    capsys.readouterr()
    assert _train("--data", str(corpus / "part*.parquet"), "--steps", "1", "--run-dir", str(corpus / "c")) == 2
    assert "task.text_column='text' is not a column" in capsys.readouterr().err
    (corpus / "blank.jsonl").write_text("")
    assert _train("--data", str(corpus / "blank.jsonl"), "--steps", "1", "--run-dir", str(corpus / "d")) == 2
    assert "holds no documents" in capsys.readouterr().err
    assert not (corpus / "c").exists() and not (corpus / "d").exists()
    assert token_cache.cache_root() == corpus / "cache" / "tokens"
