"""Read a results directory (RESULTS_DIR/<experiment>/<variant>/result.json) into plain records.

Nothing here trusts a result to be well formed: a file that is not JSON, or not an object, becomes a
`Variant` with `error` set, and every field a page shows is read with a default. The one hard failure is
a directory that holds no result at all (`ReportError`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


class ReportError(Exception):
    """Bad input to `islands report`; the message is one line that names the path and what was expected."""


@dataclass
class Variant:
    """One measured variant of an experiment: results/<experiment>/<name>/ (quick, full, full-cuda, ...)."""

    experiment: str
    name: str
    path: Path
    data: dict = field(default_factory=dict)  # result.json, or {} when it could not be read
    error: str = ""  # why result.json could not be read, else ""

    @property
    def plot(self) -> Path | None:
        p = self.path / "plot.png"
        return p if p.is_file() else None

    @property
    def summary(self) -> Path | None:
        p = self.path / "summary.md"
        return p if p.is_file() else None

    @property
    def is_full(self) -> bool:
        return self.name == "full" or self.name.startswith("full-")


@dataclass
class ExperimentResults:
    """Every variant of one experiment; `main` is the one its page shows first."""

    name: str
    variants: list[Variant]

    @property
    def main(self) -> Variant:
        return self.variants[0]


def _variant_rank(variant: Variant) -> tuple:
    """Sort key: readable before unreadable, `full` before `full-*` before `quick` before `quick-*`, then name."""
    order = {"full": 0, "quick": 2}
    rank = order.get(variant.name, 1 if variant.is_full else 3)
    return (bool(variant.error), rank, variant.name)


def read_variant(experiment: str, path: Path) -> Variant:
    variant = Variant(experiment=experiment, name=path.name, path=path)
    try:
        data = json.loads((path / "result.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        variant.error = f"result.json could not be read: {e}"
        return variant
    if not isinstance(data, dict):
        variant.error = f"result.json holds a {type(data).__name__}, not an object"
        return variant
    variant.data = data
    return variant


def scan(results_dir: Path) -> tuple[list[ExperimentResults], list[str]]:
    """The experiments under results_dir, by name, and the names of its directories that hold no result.

    Raises ReportError when results_dir is not a directory or holds no result.json at all.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ReportError(
            f"{results_dir}: no such directory; expected a results directory "
            f"holding <experiment>/<quick|full>/result.json (as `islands bench` writes)"
        )
    experiments: list[ExperimentResults] = []
    without: list[str] = []
    for exp_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        variants = [
            read_variant(exp_dir.name, v)
            for v in sorted(exp_dir.iterdir())
            if v.is_dir() and (v / "result.json").is_file()
        ]
        if variants:
            experiments.append(ExperimentResults(exp_dir.name, sorted(variants, key=_variant_rank)))
        else:
            without.append(exp_dir.name)
    if not experiments:
        raise ReportError(
            f"{results_dir}: holds no result.json; expected "
            f"{results_dir}/<experiment>/<quick|full>/result.json (as `islands bench` writes)"
        )
    return experiments, without


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(text: str) -> str:
    """A file-name-safe form of an experiment or variant name (they are already safe when made by the bench)."""
    return _UNSAFE.sub("_", text).strip("._") or "_"


def page_name(results: ExperimentResults, variant: Variant | None = None) -> str:
    """The site-relative file of a variant's page: <experiment>.html for the main variant,
    <experiment>--<variant>.html for the others."""
    stem = slug(results.name) if slug(results.name) != "index" else "index_"  # index.html is the index
    if variant is None or variant is results.main:
        return f"{stem}.html"
    return f"{stem}--{slug(variant.name)}.html"


def asset_stem(variant: Variant) -> str:
    """The stem of a variant's copied files (plot, result.json, summary.md) inside the site."""
    return f"{slug(variant.experiment)}--{slug(variant.name)}"
