"""The practice registry (SOTA-nnn practices and Q-n open questions) and the reading list (LIT-nnn),
kept as TOML data inside this package and rendered as rich tables or markdown.

    from islands.practices import load_practices, filter_practices, practices_table
    todo = filter_practices(load_practices(), status="Active", implemented=False)
"""

from islands.practices.load import (
    check_backlinks,
    load_papers,
    load_practices,
    parse_papers,
    parse_practices,
)
from islands.practices.model import PRACTICE_STATUSES, QUESTION_STATUS, STATUSES, Paper, Practice
from islands.practices.render import (
    filter_practices,
    papers_markdown,
    papers_table,
    practices_markdown,
    practices_table,
)

__all__ = [
    "PRACTICE_STATUSES",
    "QUESTION_STATUS",
    "STATUSES",
    "Paper",
    "Practice",
    "check_backlinks",
    "filter_practices",
    "load_papers",
    "load_practices",
    "papers_markdown",
    "papers_table",
    "parse_papers",
    "parse_practices",
    "practices_markdown",
    "practices_table",
]
