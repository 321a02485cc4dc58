"""Small HTML building blocks for the report: escaping, value formatting, tables and the page shell.

Every piece of text that reaches a page passes through `esc` (html.escape), so a result can hold any
characters. Pages link one stylesheet by a relative path and load nothing from the network.
"""

from __future__ import annotations

import json
import math
from html import escape

STYLESHEET = "style.css"


def esc(value) -> str:
    return escape(str(value), quote=True)


def fmt(value) -> str:
    """A result value as short text: floats to 4 significant digits, numbers from 10,000 up as whole numbers
    with thousands separators, lists and objects as compact JSON (cut at 160 characters), None as ""."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) >= 1e4:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, separators=(", ", ": "), default=str)
        return text if len(text) <= 160 else text[:157] + "..."
    return str(value)


def duration(seconds) -> str:
    """Seconds as 45s, 12m58s or 1h21m; empty when not a number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return ""
    s = round(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def as_list(value) -> list:
    """A result field that should be a list of sentences: a string becomes one item, a missing one none."""
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def bullets(items, css: str = "") -> str:
    items = as_list(items)
    if not items:
        return '<p class="missing">(none recorded)</p>'
    cls = f' class="{esc(css)}"' if css else ""
    return f"<ul{cls}>" + "".join(f"<li>{esc(fmt(i) if not isinstance(i, str) else i)}</li>" for i in items) + "</ul>"


def columns(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    return keys


def table(rows, css: str = "rows") -> str:
    """A list of dicts as a table with the union of their keys as columns, in first-seen order; the exact
    value of every number sits in its cell's title."""
    rows = [r for r in as_list(rows) if isinstance(r, dict)]
    if not rows:
        return '<p class="missing">(no rows)</p>'
    keys = columns(rows)
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = []
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k)
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            title = f' title="{esc(repr(v))}"' if isinstance(v, float) else ""
            cls = ' class="num"' if num else ""
            cells.append(f"<td{cls}{title}>{esc(fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="scroll"><table class="{esc(css)}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def link(href: str, text: str, css: str = "") -> str:
    cls = f' class="{esc(css)}"' if css else ""
    return f'<a href="{esc(href)}"{cls}>{esc(text)}</a>'


def page(title: str, body: str, nav: str = "") -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<title>{esc(title)}</title>\n<link rel="stylesheet" href="{STYLESHEET}">\n</head>\n<body>\n'
        f"<nav>{nav}</nav>\n<main>\n{body}\n</main>\n"
        "<footer>Made by <code>islands report</code> from the bench's result.json files.</footer>\n"
        "</body>\n</html>\n"
    )
