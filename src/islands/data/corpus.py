"""Data that needs no download: the Python standard library's source as bytes, or sklearn's digits.

The train/validation split is by file, decided by a CRC of the file's relative path, so it is the same
on every machine and no validation text leaks into training.
"""

from __future__ import annotations

import gzip
import importlib.util
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VAL_EVERY = 20  # one file in twenty goes to validation (5%)


@dataclass
class TextCorpus:
    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    source: str
    files: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".md", ".rst", ""))


def load_text(path: str = "") -> TextCorpus:
    """Bytes of a text file or directory; default: top-level *.py files of the standard library (~4.7 MB)."""
    if path:
        root = Path(path)
        files = _text_files(root)
        if not files:
            raise ValueError(f"no text files found under {path!r}")
    else:
        root = stdlib_root()
        files = sorted(root.glob("*.py"))
    if len(files) == 1:  # one file: the last 5% is validation
        data = np.frombuffer(files[0].read_bytes(), dtype=np.uint8)
        cut = len(data) - max(len(data) // VAL_EVERY, 1)
        train, val = data[:cut], data[cut:]
    else:
        parts: dict[bool, list[bytes]] = {True: [], False: []}
        for f in files:
            rel = str(f.relative_to(root)).encode()
            parts[zlib.crc32(rel) % VAL_EVERY == 0].append(f.read_bytes())
        if not parts[True]:  # tiny corpora: make sure validation is not empty
            parts[True].append(parts[False].pop())
        train = np.frombuffer(b"\n".join(parts[False]), dtype=np.uint8)
        val = np.frombuffer(b"\n".join(parts[True]), dtype=np.uint8)
    return TextCorpus(train=train.copy(), val=val.copy(), source=str(path or root), files=len(files))


@dataclass
class Digits:
    x_train: np.ndarray  # float32 [N, 64], scaled to [0, 1]
    y_train: np.ndarray  # int64
    x_val: np.ndarray
    y_val: np.ndarray


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits as (pixels [1797, 64] float64 in 0..16, labels [1797] int), as its `load_digits` gives them.

    Read straight from the CSV that sklearn ships, because importing sklearn (and scipy with it) costs every
    worker process ~1.2 s of CPU; sklearn's own loader is the fallback should its data move."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        csv = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            with gzip.open(csv, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits as _load

    d = _load()
    return d.data, d.target


def load_digits() -> Digits:
    data, target = digits_arrays()
    order = np.random.default_rng(0).permutation(len(target))  # fixed split, independent of the job seed
    x = (data[order] / 16.0).astype(np.float32)
    y = target[order].astype(np.int64)
    cut = int(len(y) * 0.8)
    return Digits(x[:cut], y[:cut], x[cut:], y[cut:])
