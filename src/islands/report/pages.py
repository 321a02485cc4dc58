"""The report's pages as HTML text: one per measured variant of an experiment, and the index.

Everything shown comes from the variants' result.json (and summary.md for the one-line description) and
from the practice registry; a missing or oddly typed field shows as "(none recorded)" instead of failing.
"""

from __future__ import annotations

import json

from islands.practices import Paper, Practice
from islands.report.html import as_list, bullets, duration, esc, fmt, link, page, table
from islands.report.results import ExperimentResults, Variant, asset_stem, page_name

# The keys every bench result carries; the page lays these out, any other key goes under "More data".
KNOWN_KEYS = (
    "experiment",
    "practices",
    "quick",
    "command",
    "started",
    "seconds",
    "versions",
    "rows",
    "headline",
    "interconnect",
    "baseline",
    "runs",
)
_RUN_KEYS = ("workers", "islands", "steps", "wall_seconds", "final_val_loss", "mb_sent_per_worker")
_PREVIEW_CHARS = 3000


def plot_file(variant: Variant) -> str:
    return f"img/{asset_stem(variant)}.png"


def data_file(variant: Variant) -> str:
    return f"data/{asset_stem(variant)}.json"


def summary_file(variant: Variant) -> str:
    return f"data/{asset_stem(variant)}.md"


def description(variant: Variant) -> str:
    """The experiment's one-line description, the first plain line of summary.md after its title."""
    if variant.summary is None:
        return ""
    try:
        lines = variant.summary.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines[1:12]:
        text = line.strip()
        if text and not text.startswith(("#", "Practices:", "Reproduce:", "Measured:", "-", "|", "!")):
            return text
    return ""


def practice_ids(results: ExperimentResults, variant: Variant, registry: list[Practice]) -> list[str]:
    """The ids a variant measures: those its result names, then registry rows that point at the experiment."""
    ids = [str(i) for i in as_list(variant.data.get("practices"))]
    ids += [p.id for p in registry if results.name in p.experiments and p.id not in ids]
    return ids


def _practice_item(pid: str, by_id: dict[str, Practice]) -> str:
    p = by_id.get(pid)
    if p is None:
        return f'<li>{esc(pid)} <span class="missing">(not in the practice registry)</span></li>'
    return (
        f"<li>{link('index.html#' + pid, pid)} {esc(p.title)} "
        f'<span class="status status-{esc(p.status.lower())}">{esc(p.status)}</span></li>'
    )


def _variant_nav(results: ExperimentResults, current: Variant) -> str:
    parts = []
    for v in results.variants:
        label = v.name + (" (shown first)" if v is results.main else "")
        if v is current:
            parts.append(f"<strong>{esc(label)}</strong>")
        else:
            parts.append(link(page_name(results, v), label))
    return '<p class="variants">Variants: ' + " · ".join(parts) + "</p>"


def _meta(variant: Variant) -> str:
    d = variant.data
    versions = d.get("versions")
    if isinstance(versions, dict) and versions:
        version_text = ", ".join(f"{k} {fmt(v)}" for k, v in versions.items())
    else:
        version_text = fmt(versions) if versions else ""
    quick = d.get("quick")
    items = [
        ("Command", f"<code>{esc(d.get('command', ''))}</code>" if d.get("command") else ""),
        ("Started", esc(d.get("started", ""))),
        ("Took", esc(duration(d.get("seconds")))),
        ("Mode", esc("quick" if quick is True else "full" if quick is False else "")),
        ("Versions", esc(version_text)),
    ]
    missing = '<span class="missing">(not recorded)</span>'
    rows = "".join(f"<dt>{esc(k)}</dt><dd>{v or missing}</dd>" for k, v in items)
    return f'<dl class="meta">{rows}</dl>'


def _runs(variant: Variant) -> str:
    runs = [r for r in as_list(variant.data.get("runs")) if isinstance(r, dict)]
    if not runs:
        return ""
    rows = []
    for r in runs:
        summary = r.get("summary")
        summary = summary if isinstance(summary, dict) else {}
        rows.append({"label": r.get("label", ""), **{k: summary.get(k) for k in _RUN_KEYS if k in summary}})
    return (
        f'<details class="runs"><summary>The {len(runs)} training runs behind the table</summary>'
        f"{table(rows, css='runs')}</details>"
    )


def _extra(variant: Variant) -> str:
    extra = {k: v for k, v in variant.data.items() if k not in KNOWN_KEYS}
    if not extra:
        return ""
    out = [
        "<h2>More data</h2>",
        "<p>Further keys of result.json (the first "
        f"{_PREVIEW_CHARS:,} characters of each; the whole file is linked above).</p>",
    ]
    for key, value in extra.items():
        text = json.dumps(value, indent=1, default=str)
        if len(text) > _PREVIEW_CHARS:
            text = text[:_PREVIEW_CHARS] + "\n..."
        out.append(f"<details><summary>{esc(key)}</summary><pre>{esc(text)}</pre></details>")
    return "\n".join(out)


def experiment_page(results: ExperimentResults, variant: Variant, registry: list[Practice], has_plot: bool) -> str:
    by_id = {p.id: p for p in registry}
    d = variant.data
    body = [f'<h1>{esc(results.name)} <span class="variant">{esc(variant.name)}</span></h1>']
    about = description(variant)
    if about:
        body.append(f'<p class="about">{esc(about)}</p>')
    body.append(_variant_nav(results, variant))
    files = [link(data_file(variant), "result.json")]
    if variant.summary is not None:
        files.append(link(summary_file(variant), "summary.md"))
    body.append('<p class="files">Files: ' + " · ".join(files) + "</p>")
    if variant.error:
        body.append(f'<p class="error">{esc(variant.error)}</p>')
        return page(f"{results.name} ({variant.name})", "\n".join(body), _nav())
    body.append('<section class="headline"><h2>Headline</h2>' + bullets(d.get("headline")) + "</section>")
    body.append(
        '<section class="conditions"><div><h2>Interconnect</h2>'
        + bullets(d.get("interconnect"))
        + "</div><div><h2>Baseline</h2>"
        + bullets(d.get("baseline"))
        + "</div></section>"
    )
    ids = practice_ids(results, variant, registry)
    body.append(
        "<h2>Practices measured</h2>"
        + (
            '<ul class="practices">' + "".join(_practice_item(i, by_id) for i in ids) + "</ul>"
            if ids
            else '<p class="missing">(none named)</p>'
        )
    )
    if has_plot:
        body.append(
            f'<h2>Plot</h2><figure><img src="{esc(plot_file(variant))}" '
            f'alt="plot of {esc(results.name)} ({esc(variant.name)})"></figure>'
        )
    rows = as_list(d.get("rows"))
    body.append(f'<h2>Results</h2><p class="count">{len(rows)} row(s)</p>' + table(rows))
    body.append(_runs(variant))
    body.append("<h2>How it was measured</h2>" + _meta(variant))
    body.append(_extra(variant))
    return page(f"{results.name} ({variant.name})", "\n".join(b for b in body if b), _nav())


def _nav() -> str:
    return (
        link("index.html", "islands results")
        + " · "
        + link("index.html#experiments", "experiments")
        + " · "
        + link("index.html#practices", "practices")
        + " · "
        + link("index.html#questions", "open questions")
    )


def _first_headline(variant: Variant, limit: int = 220) -> str:
    items = as_list(variant.data.get("headline"))
    if not items:
        return ""
    text = items[0] if isinstance(items[0], str) else fmt(items[0])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _experiment_row(results: ExperimentResults, by_id: dict[str, Practice]) -> str:
    main = results.main
    variants = " · ".join(link(page_name(results, v), v.name) for v in results.variants)
    ids = [str(i) for i in as_list(main.data.get("practices"))]
    practices = ", ".join(link("index.html#" + i, i) if i in by_id else esc(i) for i in ids)
    note = f'<span class="error">{esc(main.error)}</span>' if main.error else esc(_first_headline(main))
    return (
        f'<tr id="exp-{esc(results.name)}"><td>{link(page_name(results), results.name)}</td>'
        f"<td>{variants}</td><td>{practices}</td><td>{esc(main.data.get('started', ''))}</td>"
        f'<td class="num">{esc(duration(main.data.get("seconds")))}</td><td>{note}</td></tr>'
    )


def _result_cell(p: Practice, experiments: dict[str, ExperimentResults]) -> str:
    if not p.experiments:
        return '<span class="missing">no experiment yet</span>'
    cells = [_experiment_result(name, experiments) for name in p.experiments]
    return cells[0] if len(cells) == 1 else "".join(f"<div>{cell}</div>" for cell in cells)


def _experiment_result(name: str, experiments: dict[str, ExperimentResults]) -> str:
    """One experiment of a practice's row: a link to its page and result with its first headline, or that it has
    no result yet."""
    found = experiments.get(name)
    if found is None:
        return f'{esc(name)} <span class="missing">(no result yet)</span>'
    main = found.main
    text = link(page_name(found), name) + f' <span class="variant">{esc(main.name)}</span>'
    text += " · " + link(data_file(main), "result.json")
    headline = _first_headline(main, 160)
    if headline:
        text += f'<div class="small">{esc(headline)}</div>'
    return text


def _practice_rows(items: list[Practice], experiments: dict[str, ExperimentResults], paper_ids: set[str]) -> str:
    rows = []
    for p in items:
        what = f"<strong>Rejected:</strong> {esc(p.reason)}" if p.status == "Rejected" else esc(p.claim)
        sources = ", ".join(link("#" + s, s) if s in paper_ids else esc(s) for s in p.sources)
        module = f'<div class="small"><code>{esc(p.module)}</code></div>' if p.module else ""
        rows.append(
            f'<tr id="{esc(p.id)}"><td><strong>{esc(p.id)}</strong></td><td>{esc(p.title)}{module}</td>'
            f'<td><span class="status status-{esc(p.status.lower())}">{esc(p.status)}</span></td>'
            f"<td>{what}</td><td>{_result_cell(p, experiments)}</td><td>{sources}</td></tr>"
        )
    if not rows:
        return '<p class="missing">(none)</p>'
    return (
        '<div class="scroll"><table class="practices"><thead><tr><th>id</th><th>title</th><th>status</th>'
        "<th>claim, or why rejected</th><th>experiment and result</th><th>sources</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>"
    )


def _papers(papers: list[Paper]) -> str:
    if not papers:
        return '<p class="missing">(no reading list)</p>'
    rows = "".join(
        f'<tr id="{esc(p.id)}"><td>{esc(p.id)}</td><td>{esc(p.authors_year)}</td><td>{esc(p.title)}'
        f'<div class="small">{esc(p.ref)}</div></td><td>{esc(p.note)}</td>'
        f"<td>{', '.join(link('#' + i, i) for i in p.practices)}</td></tr>"
        for p in papers
    )
    return (
        "<details><summary>The reading list (" + str(len(papers)) + " papers)</summary>"
        '<div class="scroll"><table class="papers"><thead><tr><th>id</th><th>who</th><th>title</th>'
        f"<th>why it is here</th><th>practices</th></tr></thead><tbody>{rows}</tbody></table></div></details>"
    )


def index_page(
    experiments: list[ExperimentResults],
    without: list[str],
    registry: list[Practice],
    papers: list[Paper],
    registry_error: str = "",
    source: str = "",
) -> str:
    by_id = {p.id: p for p in registry}
    by_name = {e.name: e for e in experiments}
    practices = [p for p in registry if not p.is_question]
    questions = [p for p in registry if p.is_question]
    counts: dict[str, int] = {}
    for p in practices:
        counts[p.status] = counts.get(p.status, 0) + 1
    body = [
        "<h1>islands results</h1>",
        f'<p class="about">{len(experiments)} experiments ({sum(len(e.variants) for e in experiments)} '
        f"measured variants){' from ' + esc(source) if source else ''}; {len(practices)} practices ("
        + esc(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        + f") and {len(questions)} open "
        "questions. Each experiment page gives the headline, the table, the plot, the interconnect and "
        "baseline it was measured against, and the command that reproduces it.</p>",
    ]
    if registry_error:
        body.append(f'<p class="error">The practice registry could not be read: {esc(registry_error)}</p>')
    body.append('<h2 id="experiments">Experiments</h2>')
    body.append(
        '<div class="scroll"><table class="experiments"><thead><tr><th>experiment</th><th>variants</th>'
        "<th>practices</th><th>measured</th><th>took</th><th>first headline</th></tr></thead><tbody>"
        + "".join(_experiment_row(e, by_id) for e in experiments)
        + "</tbody></table></div>"
    )
    problems = [f"{e.name}/{v.name}: {v.error}" for e in experiments for v in e.variants if v.error]
    problems += [f"{name}/: no <variant>/result.json inside" for name in without]
    if problems:
        body.append("<h3>Directories without a readable result</h3>" + bullets(problems, "problems"))
    body.append('<h2 id="practices">Practices</h2>' + _practice_rows(practices, by_name, {p.id for p in papers}))
    body.append('<h2 id="questions">Open questions</h2>' + _practice_rows(questions, by_name, {p.id for p in papers}))
    body.append('<h2 id="reading">Reading list</h2>' + _papers(papers))
    return page("islands results", "\n".join(body), _nav())
