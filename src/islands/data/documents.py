"""Local text, JSON lines and Parquet files as a stream of documents, read through the `datasets` library.

    source = DocumentSource("corpus/*.jsonl", column="text")
    source.check()                      a message when there are no files or the column does not exist, else None
    for text in source.documents():     one string per document, streamed: never the whole corpus in memory

`data` is a file or a glob pattern (`*`, `?`, `[...]`) of files of one format: `.jsonl`/`.json` (JSON lines),
`.parquet`, or `.txt`/`.md` (each file one document). Files are read in sorted order with `streaming=True`, so a
corpus larger than memory is read piece by piece; nothing is downloaded (the builders are `datasets`' own local
ones). Documents whose index is a multiple of VAL_EVERY form the validation split (`split="val"`), the others
the training split, the same on every machine.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

VAL_EVERY = 20  # one document in twenty goes to validation (5%), as the byte corpus holds out one file in twenty
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text"}


class DataError(ValueError):
    """Data that cannot be read as documents; the message says what was given and what would work."""


def is_document_source(data: str) -> bool:
    """A glob pattern, or a JSON lines / Parquet file: what goes through `datasets` (a plain text file or a
    directory stays with islands' own byte corpus, islands.data.corpus)."""
    return any(c in data for c in "*?[") or Path(data).suffix in (".jsonl", ".json", ".parquet")


class DocumentSource:
    def __init__(self, data: str, column: str = "text"):
        self.data, self.column = data, column
        self.files = sorted(glob.glob(data)) if any(c in data for c in "*?[") else [data]
        self.files = [f for f in self.files if Path(f).is_file()]
        suffixes = sorted({Path(f).suffix for f in self.files})
        self.builder = BUILDERS.get(suffixes[0]) if len(suffixes) == 1 else None
        self._problem = self._find_problem(suffixes)

    def _find_problem(self, suffixes: list[str]) -> str | None:
        if not self.files:
            return f"task.data={self.data!r} matches no files; give a file or a pattern such as 'corpus/*.jsonl'"
        if len(suffixes) > 1:
            return f"task.data={self.data!r} matches files of several formats ({', '.join(suffixes)}); give one format"
        if self.builder is None:
            return (
                f"task.data={self.data!r}: {suffixes[0] or 'files without a suffix'} is not a format islands reads "
                f"through datasets; use {', '.join(BUILDERS)}"
            )
        return None

    def _stream(self):
        import datasets

        datasets.disable_progress_bars()
        kwargs = {"sample_by": "document"} if self.builder == "text" else {}
        return datasets.load_dataset(self.builder, data_files=self.files, split="train", streaming=True, **kwargs)

    def columns(self) -> list[str]:
        ds = self._stream()
        if ds.features is not None:
            return list(ds.features)
        first = next(iter(ds), None)
        return list(first) if first is not None else []

    def check(self) -> str | None:
        """What is wrong with this source (no files, mixed formats, a missing or non-text column), or None."""
        if self._problem:
            return self._problem
        column = "text" if self.builder == "text" else self.column
        if all(os.path.getsize(f) == 0 for f in self.files):
            return f"task.data={self.data!r} holds no documents: its files are empty"
        try:
            ds = self._stream()
            columns = self.columns()
        except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types for a file they cannot parse
            return f"task.data={self.data!r}: datasets cannot read it as {self.builder}: {type(e).__name__}: {e}"
        if not columns:
            return f"task.data={self.data!r} holds no documents; give files with text in them"
        if column not in columns:
            return (
                f"task.text_column={column!r} is not a column of {self.data!r}; its columns are "
                f"{', '.join(map(repr, columns)) or '(none)'}"
            )
        feature = ds.features.get(column) if ds.features is not None else None
        if feature is not None and getattr(feature, "dtype", "string") not in ("string", "large_string"):
            return f"task.text_column={column!r} of {self.data!r} holds {feature.dtype}, not text"
        return None

    def documents(self, split: str = "train") -> Iterator[str]:
        """The documents of `split` ("train", "val" or "all") in file order, streamed."""
        if self._problem:
            raise DataError(self._problem)
        column = "text" if self.builder == "text" else self.column
        for i, example in enumerate(self._stream()):
            held_out = i % VAL_EVERY == 0
            if split == "all" or held_out == (split == "val"):
                text = example.get(column)
                if text is None and column not in example:
                    raise DataError(f"task.text_column={column!r} is not a column of {self.data!r}")
                if text:
                    yield str(text)

    def identity(self) -> str:
        """What the tokens cached from this source depend on: the files (path, size, mtime) and the column."""
        h = hashlib.sha256(f"{self.builder}\0{self.column}".encode())
        for f in self.files:
            st = os.stat(f)
            h.update(f"\0{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        return f"{self.data} ({len(self.files)} {self.builder} file{'s' * (len(self.files) != 1)})"
