"""Build the static results site: RESULTS_DIR -> OUT (index.html, one page per measured variant, style.css,
img/ with the plots, data/ with each result.json and summary.md).

The site is built in a temporary sibling of OUT and moved into place only when complete, so a failure
leaves OUT as it was. An existing OUT is replaced only when it is empty or a site this module made
(it holds MARKER); anything else there is refused rather than deleted.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from islands.practices import Paper, Practice, load_papers, load_practices
from islands.report.html import STYLESHEET
from islands.report.pages import data_file, experiment_page, index_page, plot_file, summary_file
from islands.report.results import ExperimentResults, ReportError, page_name, scan

MARKER = ".islands-report"


@dataclass
class Site:
    """What build_site wrote: OUT and the pages in it, relative to OUT."""

    out: Path
    pages: list[str]
    experiments: list[ExperimentResults]


def _registry() -> tuple[list[Practice], list[Paper], str]:
    try:
        return load_practices(), load_papers(), ""
    except (OSError, ValueError) as e:  # a broken registry must not stop the results from being shown
        return [], [], str(e).splitlines()[0]


def check_out(out: Path) -> None:
    """Refuse an OUT that is a file, or a non-empty directory that is not an earlier report."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: exists and is not a directory; expected a directory to write the site into")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ReportError(
            f"{out}: is a non-empty directory that `islands report` did not make; "
            f"expected a new or empty directory, or an earlier report to replace"
        )


def _write(tmp: Path, experiments: list[ExperimentResults], without: list[str], source: str) -> list[str]:
    practices, papers, registry_error = _registry()
    (tmp / "img").mkdir()
    (tmp / "data").mkdir()
    (tmp / STYLESHEET).write_bytes(resources.files("islands.report").joinpath(STYLESHEET).read_bytes())
    (tmp / MARKER).write_text("made by islands report; the next `islands report` into this directory replaces it\n")
    pages = ["index.html"]
    for results in experiments:
        for variant in results.variants:
            shutil.copyfile(variant.path / "result.json", tmp / data_file(variant))
            if variant.summary is not None:
                shutil.copyfile(variant.summary, tmp / summary_file(variant))
            has_plot = variant.plot is not None and not variant.error
            if has_plot:
                assert variant.plot is not None
                shutil.copyfile(variant.plot, tmp / plot_file(variant))
            name = page_name(results, variant)
            (tmp / name).write_text(experiment_page(results, variant, practices, has_plot), encoding="utf-8")
            pages.append(name)
    (tmp / "index.html").write_text(
        index_page(experiments, without, practices, papers, registry_error, source), encoding="utf-8"
    )
    return pages


def build_site(results_dir: str | Path = "results", out: str | Path = "site") -> Site:
    """Write the site for results_dir into out; raises ReportError (nothing written) on bad input."""
    results_dir, shown = Path(results_dir), Path(out)
    check_out(shown)
    experiments, without = scan(results_dir)
    out = shown.resolve()  # "." or "sub/.." have no usable name to build a sibling of
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        pages = _write(tmp, experiments, without, str(results_dir))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / "site")  # renames in one directory: OUT is never half old, half new
            try:
                tmp.rename(out)
            except OSError:
                (old / "site").rename(out)  # put the earlier site back
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Site(out=shown, pages=pages, experiments=experiments)
