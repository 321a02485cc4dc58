"""Filtering and rendering: rich tables for the terminal, markdown for docs/practices.md."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table

from islands.practices.model import STATUSES, Paper, Practice

_STATUS_STYLE = {"Active": "green", "Proposed": "yellow", "Rejected": "red", "Open": "cyan"}


def _normalise_statuses(status: str | Iterable[str]) -> set[str]:
    wanted = [status] if isinstance(status, str) else list(status)
    by_lower = {s.lower(): s for s in STATUSES}
    chosen = set()
    for item in wanted:
        if not isinstance(item, str) or item.lower() not in by_lower:
            raise ValueError(f"unknown status {item!r}; choose from {list(STATUSES)} (case does not matter)")
        chosen.add(by_lower[item.lower()])
    return chosen


def filter_practices(
    items: Iterable[Practice],
    status: str | Iterable[str] | None = None,
    implemented: bool | None = None,
) -> list[Practice]:
    """Keep rows whose status is `status` (one name or several, any case) and whose implemented flag
    equals `implemented`; None means no filter on that field. Order is preserved."""
    if implemented is not None and not isinstance(implemented, bool):
        raise TypeError(f"implemented must be True, False or None, got {implemented!r}")
    statuses = None if status is None else _normalise_statuses(status)
    return [
        p
        for p in items
        if (statuses is None or p.status in statuses) and (implemented is None or p.implemented == implemented)
    ]


def _issue_label(issue: int) -> str:
    return f"#{issue}" if issue else "-"


def practices_table(items: Iterable[Practice], *, title: str = "Practice registry", detail: bool = False) -> Table:
    """A rich table of practices; `detail` adds the claim (or, for Rejected rows, the reason)."""
    items = list(items)
    done = sum(p.implemented for p in items)
    table = Table(title=title, caption=f"{len(items)} entries, {done} implemented", show_lines=detail)
    table.add_column("ID", no_wrap=True, style="bold")
    table.add_column("Status", no_wrap=True)
    table.add_column("Title", min_width=20, ratio=3)
    if detail:
        table.add_column("Claim / reason", min_width=20, ratio=3)
        table.add_column("Sources")
    table.add_column("Issue", no_wrap=True, justify="right")
    table.add_column("Module / experiment", ratio=1, overflow="fold")
    for p in items:
        style = _STATUS_STYLE.get(p.status, "")
        row = [p.id, f"[{style}]{p.status}[/]", p.title]
        if detail:
            row += [p.reason if p.status == "Rejected" else p.claim, ", ".join(p.sources) or "-"]
        where = " / ".join(x for x in (p.module, ", ".join(p.experiments)) if x) or "-"
        row += [_issue_label(p.issue), where]
        table.add_row(*row)
    return table


def papers_table(items: Iterable[Paper], *, title: str = "Reading list") -> Table:
    """A rich table of the reading list with each paper's triage note and the practices citing it."""
    items = list(items)
    table = Table(title=title, caption=f"{len(items)} papers", show_lines=True)
    table.add_column("ID", no_wrap=True, style="bold")
    table.add_column("Authors, year", ratio=1)
    table.add_column("Ref", no_wrap=True)
    table.add_column("Title", min_width=20, ratio=2)
    table.add_column("Why it is on the list", min_width=30, ratio=3)
    table.add_column("Cited by", overflow="fold")
    for p in items:
        table.add_row(p.id, p.authors_year, p.ref, p.title, p.note, ", ".join(p.practices) or "-")
    return table


def _cell(text: str) -> str:
    # A bare pipe would end the markdown cell early; newlines would end the row.
    return text.replace("|", "\\|").replace("\n", " ").strip() or "-"


def practices_markdown(items: Iterable[Practice]) -> str:
    """A markdown table of practices, then the reasons for every Rejected row shown."""
    items = list(items)
    lines = [
        "| ID | Status | Title | Sources | Issue | Module | Experiment |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in items:
        module = f"`{p.module}`" if p.module else "-"
        lines.append(
            f"| {p.id} | {p.status} | {_cell(p.title)} | {_cell(', '.join(p.sources))} | "
            f"{_issue_label(p.issue)} | {module} | {_cell(', '.join(p.experiments))} |"
        )
    rejected = [p for p in items if p.status == "Rejected"]
    if rejected:
        lines += ["", "Rejected, and why:", ""]
        lines += [f"- **{p.id}** ({_cell(p.title)}): {_cell(p.reason)}" for p in rejected]
    return "\n".join(lines) + "\n"


def papers_markdown(items: Iterable[Paper]) -> str:
    """A markdown table of the reading list."""
    lines = ["| ID | Authors, year | Ref | Title | Why it is on the list | Cited by |", "|---|---|---|---|---|---|"]
    for p in items:
        lines.append(
            f"| {p.id} | {_cell(p.authors_year)} | {_cell(p.ref)} | {_cell(p.title)} | {_cell(p.note)} | "
            f"{_cell(', '.join(p.practices))} |"
        )
    return "\n".join(lines) + "\n"
