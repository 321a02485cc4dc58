"""`python -m islands.practices`: print the registry, or regenerate the tables in docs/practices.md.

python -m islands.practices --markdown                 # practices as markdown
python -m islands.practices --markdown --papers        # reading list as markdown
python -m islands.practices --update-docs docs/practices.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from islands.practices.load import load_papers, load_practices
from islands.practices.render import (
    filter_practices,
    papers_markdown,
    papers_table,
    practices_markdown,
    practices_table,
)

# docs/practices.md holds generated blocks between these markers; everything outside them is prose.
BLOCKS = {
    "practices": ("<!-- generated:practices:begin -->", "<!-- generated:practices:end -->"),
    "papers": ("<!-- generated:papers:begin -->", "<!-- generated:papers:end -->"),
}


def render_docs(text: str) -> str:
    """Return `text` with each generated block replaced by the current registry / reading list."""
    fresh = {"practices": practices_markdown(load_practices()), "papers": papers_markdown(load_papers())}
    for name, (begin, end) in BLOCKS.items():
        start, stop = text.find(begin), text.find(end)
        if start < 0 or stop < start:
            raise ValueError(f"docs page lacks the marker pair {begin} ... {end} for the {name} table")
        text = text[: start + len(begin)] + "\n" + fresh[name] + text[stop:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m islands.practices", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print markdown instead of a terminal table")
    parser.add_argument("--papers", action="store_true", help="show the reading list instead of the practices")
    parser.add_argument("--status", action="append", help="keep only this status (repeatable; any case)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--implemented", dest="implemented", action="store_true", default=None)
    group.add_argument("--not-implemented", dest="implemented", action="store_false")
    parser.add_argument("--update-docs", metavar="PATH", type=Path, help="rewrite the generated tables in PATH")
    args = parser.parse_args(argv)

    try:
        if args.update_docs:
            path: Path = args.update_docs
            path.write_text(render_docs(path.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"updated {path}")
            return 0
        if args.papers:
            papers = load_papers()
            if args.markdown:
                sys.stdout.write(papers_markdown(papers))
            else:
                Console().print(papers_table(papers))
            return 0
        items = filter_practices(load_practices(), status=args.status, implemented=args.implemented)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.markdown:
        sys.stdout.write(practices_markdown(items))
    else:
        Console().print(practices_table(items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
