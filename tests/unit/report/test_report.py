"""`islands report`: the static results site, built from the real results/ and from a small odd one.

Every number checked here is read from result.json and looked for on its page; every relative link and
image of every page must resolve inside OUT; bad input exits 2 and writes nothing. The browser tests open
the built pages from disk in headless chromium (tests/harness/browser.py) and keep screenshots.
"""

from __future__ import annotations

import json
from html import escape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from harness.browser import needs_browser, render, screenshot
from islands.cli import main
from islands.practices import load_practices
from islands.report import ReportError, build_site, site as site_mod
from islands.report.html import fmt
from islands.report.results import page_name

RESULTS = Path(__file__).resolve().parents[3] / "results"


class _Refs(HTMLParser):
    """Every href and src, and every id, of one page."""

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()
        self.tables = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables += 1
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.refs.append(a[key])


def _parse(path: Path) -> _Refs:
    p = _Refs()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def broken_links(out: Path) -> list[str]:
    parsed = {page: _parse(page) for page in out.glob("*.html")}
    bad = []
    for page, p in parsed.items():
        for ref in p.refs:
            parts = urlsplit(ref)
            relative = not parts.scheme and not parts.netloc and not ref.startswith("/")
            assert relative, f"{page.name}: not relative: {ref}"
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page.resolve()
            if not target.is_file() or out.resolve() not in target.parents:
                bad.append(f"{page.name}: {ref} (no such file in OUT)")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in parsed[target].ids:
                bad.append(f"{page.name}: {ref} (no id {parts.fragment!r} there)")
    return bad


def _cell_values(rows) -> list[str]:
    """The text of a few cells of the table: the first row's numbers and strings."""
    first = next((r for r in rows if isinstance(r, dict)), {})
    return [escape(fmt(v)) for v in first.values() if isinstance(v, (int, float, str)) and fmt(v)][:4]


@pytest.fixture(scope="module")
def real_site(tmp_path_factory):
    if not any(RESULTS.glob("*/*/result.json")):
        pytest.skip("no results/ in this checkout")
    return build_site(RESULTS, tmp_path_factory.mktemp("report") / "site")


def test_every_result_has_a_page_with_its_own_numbers(real_site):
    out = real_site.out
    for exp in real_site.experiments:
        assert (out / f"{exp.name}.html").is_file()
        for variant in exp.variants:
            data = json.loads((variant.path / "result.json").read_text())
            text = (out / page_name(exp, variant)).read_text(encoding="utf-8")
            assert escape(variant.name) in text.split("</h1>")[0]
            headline = data.get("headline") or []
            for h in (headline if isinstance(headline, list) else [headline])[:2]:
                assert escape(str(h)) in text, f"{exp.name}/{variant.name}: headline missing"
            for cell in _cell_values(data.get("rows") or []):
                assert cell in text, f"{exp.name}/{variant.name}: table cell {cell!r} missing"
            for line in (data.get("interconnect") or [])[:1] + (data.get("baseline") or [])[:1]:
                assert escape(str(line)) in text
            assert escape(data["command"]) in text
            if (variant.path / "plot.png").is_file():
                assert f'src="img/{exp.name}--{variant.name}.png"' in text


def test_the_full_variant_is_shown_first(real_site):
    for exp in real_site.experiments:
        names = [v.name for v in exp.variants]
        if "full" in names:
            assert exp.main.name == "full", names
        assert f'href="{exp.name}.html"' in (real_site.out / "index.html").read_text()


def test_every_link_and_image_resolves_inside_out(real_site):
    assert broken_links(real_site.out) == []
    assert (real_site.out / "style.css").is_file()
    for page in real_site.out.glob("*.html"):
        assert "<script" not in page.read_text(), page.name  # plain pages: nothing runs, nothing is fetched


def test_every_practice_and_question_is_on_the_index_linked_to_its_experiment(real_site):
    index = (real_site.out / "index.html").read_text(encoding="utf-8")
    have = {e.name for e in real_site.experiments}
    for p in load_practices():
        start = index.index(f'<tr id="{p.id}">')
        row = index[start : index.index("</tr>", start)]
        assert escape(p.title) in row
        if p.status == "Rejected":
            assert escape(p.reason) in row
        else:
            assert escape(p.claim) in row
        if not p.experiment:
            assert "no experiment yet" in row
        elif p.experiment in have:
            assert f'href="{p.experiment}.html"' in row and (real_site.out / f"{p.experiment}.html").is_file()
        else:
            assert "no result yet" in row


def _result(name, **over):
    base = {
        "experiment": name,
        "practices": ["SOTA-155", "SOTA-999"],
        "quick": False,
        "command": f"islands bench {name}",
        "started": "2026-01-02T03:04:05",
        "seconds": 125.0,
        "versions": {"islands": "0.2.0", "torch": "2.x"},
        "rows": [{"arm": "a", "loss": 1.23456}],
        "headline": ["a headline"],
        "interconnect": ["loopback"],
        "baseline": ["plain DDP"],
        "runs": [],
    }
    return {**base, **over}


def _write(root: Path, exp: str, variant: str, data, plot: bool = False) -> Path:
    d = root / exp / variant
    d.mkdir(parents=True)
    (d / "result.json").write_text(data if isinstance(data, str) else json.dumps(data))
    if plot:
        (d / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return d


@pytest.fixture
def odd_results(tmp_path):
    root = tmp_path / "results"
    _write(
        root,
        "alpha",
        "full",
        _result(
            "alpha",
            headline=["loss <b>1.5</b> & 3x fewer bytes"],
            rows=[
                {"arm": "ddp", "loss": 1.4292, "bytes": 3501056000},
                {"arm": "<i>x</i>", "extra": {"k": [1, 2]}, "nan": float("nan")},
            ],
            curves={"ddp": [1, 2, 3]},
        ),
        plot=True,
    )
    _write(root, "alpha", "quick", _result("alpha", quick=True, headline="just one string", rows=[]))
    _write(root, "beta", "quick-100mbit", {"experiment": "beta"})  # almost nothing recorded
    _write(root, "gamma", "full", "{not json")
    _write(root, "delta", "full", [1, 2, 3])
    (root / "notes").mkdir()
    (root / "notes" / "machine.txt").write_text("a log, no result")
    return root


def test_an_odd_results_directory_still_builds_and_shows_what_is_there(odd_results, tmp_path):
    site = build_site(odd_results, tmp_path / "out")
    out = site.out
    alpha = (out / "alpha.html").read_text()
    assert "loss &lt;b&gt;1.5&lt;/b&gt; &amp; 3x fewer bytes" in alpha and "<b>1.5" not in alpha
    assert "&lt;i&gt;x&lt;/i&gt;" in alpha and ">1.429<" in alpha and "3,501,056,000" in alpha
    assert "curves" in alpha and 'src="img/alpha--full.png"' in alpha and "2m05s" in alpha
    assert 'href="index.html#SOTA-155"' in alpha and "SOTA-999" in alpha
    assert 'href="alpha--quick.html"' in alpha
    assert "just one string" in (out / "alpha--quick.html").read_text()
    beta = (out / "beta.html").read_text()
    assert "(none recorded)" in beta and "(no rows)" in beta
    assert "could not be read" in (out / "gamma.html").read_text()
    assert "not an object" in (out / "delta.html").read_text()
    index = (out / "index.html").read_text()
    assert "notes/" in index and "gamma/full" in index
    assert broken_links(out) == []


def _run_cli(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(["report", *argv])
    return exited.value.code, capsys.readouterr().err


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, odd_results):
    out = tmp_path / "out"
    missing = tmp_path / "no-such-results"
    code, err = _run_cli([str(missing), str(out)], capsys)
    assert code == 2 and str(missing) in err and "result.json" in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    (empty / "exp" / "full").mkdir(parents=True)
    code, err = _run_cli([str(empty), str(out)], capsys)
    assert code == 2 and str(empty) in err and "no result.json" in err
    assert not out.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    code, err = _run_cli([str(odd_results), str(a_file)], capsys)
    assert code == 2 and str(a_file) in err and a_file.read_text() == "keep me"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("keep me too")
    code, err = _run_cli([str(odd_results), str(foreign)], capsys)
    assert code == 2 and str(foreign) in err and [p.name for p in foreign.iterdir()] == ["thesis.tex"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty", "mine", "results"]


def test_the_cli_writes_the_site_and_replaces_an_earlier_report(tmp_path, capsys, odd_results, monkeypatch):
    out = tmp_path / "site"
    code, _ = _run_cli([str(odd_results), str(out)], capsys)
    assert code == 0 and (out / "index.html").is_file() and (out / "alpha.html").is_file()
    (out / "stale.html").write_text("from an older report")
    monkeypatch.chdir(tmp_path)  # RESULTS_DIR defaults to ./results
    code, _ = _run_cli(["site"], capsys)
    assert code == 0 and not (out / "stale.html").exists() and (out / "alpha.html").is_file()

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(site_mod, "experiment_page", fail)
    with pytest.raises(RuntimeError):
        build_site(odd_results, out)
    assert (out / "alpha.html").is_file()  # the earlier site is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "site"]  # no half-built sibling left
    with pytest.raises(ReportError):
        build_site(tmp_path / "nowhere", out)


@needs_browser
def test_the_pages_render_in_a_real_browser(real_site):
    exp = (
        next(e for e in real_site.experiments if e.name == "diloco-vs-ddp")
        if (real_site.out / "diloco-vs-ddp.html").is_file()
        else real_site.experiments[0]
    )
    index_url = (real_site.out / "index.html").resolve().as_uri()
    page_url = (real_site.out / f"{exp.name}.html").resolve().as_uri()
    index_dom = render(index_url, wait_ms=300)
    assert "<table" in index_dom and 'id="practices"' in index_dom and "SOTA-155" in index_dom
    page_dom = render(page_url, wait_ms=300)
    data = exp.main.data
    assert "<table" in page_dom and escape(data["headline"][0], quote=False) in page_dom
    assert _cell_values(data["rows"])[0] in page_dom
    assert screenshot(index_url, "report-index.png", wait_ms=300).stat().st_size > 10_000
    assert screenshot(page_url, "report-experiment.png", wait_ms=300).stat().st_size > 10_000
