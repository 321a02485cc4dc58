"""Read registry.toml and reading.toml from the package and refuse any row that is malformed.

Every error is a ValueError that names the file, the row and what a valid row looks like, so whoever
edits the TOML to fill in their module/experiment sees exactly what to fix.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from islands.practices.model import PRACTICE_STATUSES, QUESTION_STATUS, STATUSES, Paper, Practice

REGISTRY_FILE = "registry.toml"
READING_FILE = "reading.toml"

_PRACTICE_ID = re.compile(r"SOTA-\d{3}")
_QUESTION_ID = re.compile(r"Q-\d+")
_PAPER_ID = re.compile(r"LIT-\d{3}")
_MODULE_PATH = re.compile(r"islands(\.[A-Za-z_][A-Za-z0-9_]*)+")
_EXPERIMENT_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")

_PRACTICE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "title": str,
    "status": str,
    "sources": list,
    "reason": str,
    "claim": str,
    "module": str,
    "experiment": (str, list),  # one bench name, or a list of them (the one that tests the claim first)
    "issue": int,
}
_PAPER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "authors_year": str,
    "ref": str,
    "title": str,
    "note": str,
    "practices": list,
}


def _read_package_text(name: str) -> str:
    return resources.files("islands.practices").joinpath(name).read_text(encoding="utf-8")


def _parse_toml(text: str, origin: str, table: str) -> list[dict]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin}: not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - {table})
    if unknown:
        raise ValueError(f"{origin}: unknown top-level key(s) {unknown}; only [[{table}]] rows belong here")
    rows = data.get(table, [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{origin}: '{table}' must be an array of tables written as [[{table}]]")
    return rows


def _type_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _check_fields(row: dict, fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    missing = [k for k in fields if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; every row needs {list(fields)}")
    unknown = sorted(set(row) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid fields are {list(fields)}")
    for key, kind in fields.items():
        value = row[key]
        # bool is a subclass of int in Python; an issue number of `true` is still a typo.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: field '{key}' must be {_type_name(kind)}, got {type(value).__name__} {value!r}")
    for key in fields:
        if isinstance(row[key], list) and not all(isinstance(x, str) for x in row[key]):
            raise ValueError(f"{where}: field '{key}' must be a list of strings, got {row[key]!r}")


def _where(origin: str, index: int, row: dict) -> str:
    return f"{origin}: row {index + 1} (id {row.get('id', '?')!r})"


def _check_unique(ident: str, seen: dict[str, int], index: int, where: str) -> None:
    if ident in seen:
        raise ValueError(f"{where}: duplicate id {ident!r}, first used in row {seen[ident] + 1}")
    seen[ident] = index


def parse_papers(text: str, *, origin: str = READING_FILE) -> list[Paper]:
    """Parse and validate reading-list TOML text (one [[paper]] table per row)."""
    papers: list[Paper] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(_parse_toml(text, origin, "paper")):
        where = _where(origin, index, row)
        _check_fields(row, _PAPER_FIELDS, where)
        if not _PAPER_ID.fullmatch(row["id"]):
            raise ValueError(f"{where}: id must look like 'LIT-004' (LIT- and three digits)")
        _check_unique(row["id"], seen, index, where)
        for key in ("authors_year", "title", "note"):
            if not row[key].strip():
                raise ValueError(f"{where}: field '{key}' is empty; every paper needs it")
        for pid in row["practices"]:
            if not _PRACTICE_ID.fullmatch(pid):
                raise ValueError(f"{where}: practices entry {pid!r} is not a registry id like 'SOTA-155'")
        papers.append(
            Paper(
                id=row["id"],
                authors_year=row["authors_year"],
                ref=row["ref"],
                title=row["title"],
                note=row["note"],
                practices=tuple(row["practices"]),
            )
        )
    return papers


def _check_status_fields(row: dict, where: str) -> None:
    status = row["status"]
    is_question = bool(_QUESTION_ID.fullmatch(row["id"]))
    if status not in STATUSES:
        raise ValueError(f"{where}: unknown status {status!r}; valid statuses are {list(STATUSES)}")
    if is_question and status != QUESTION_STATUS:
        raise ValueError(f"{where}: open questions (Q-n) must have status 'Open', got {status!r}")
    if not is_question and status not in PRACTICE_STATUSES:
        raise ValueError(f"{where}: practices (SOTA-nnn) take one of {list(PRACTICE_STATUSES)}, got {status!r}")
    if status == "Rejected":
        if not row["reason"].strip():
            raise ValueError(f"{where}: Rejected entry has no reason; say why in 'reason' (one or two sentences)")
        if row["claim"].strip():
            raise ValueError(f"{where}: Rejected entry has a claim; a rejected practice has nothing to test")
        if row["module"] or row["experiment"]:
            raise ValueError(
                f"{where}: Rejected entry names a module/experiment; nothing implements a rejected practice"
            )
    else:
        if row["reason"].strip():
            raise ValueError(f"{where}: only Rejected entries carry a 'reason' (status is {status!r})")
        if not row["claim"].strip():
            raise ValueError(f"{where}: {status} entry needs a 'claim': the measurable statement an experiment tests")


def parse_practices(
    text: str, paper_ids: Iterable[str] | None = None, *, origin: str = REGISTRY_FILE
) -> list[Practice]:
    """Parse and validate registry TOML text; `paper_ids`, when given, is what `sources` may cite."""
    known = None if paper_ids is None else set(paper_ids)
    practices: list[Practice] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(_parse_toml(text, origin, "practice")):
        where = _where(origin, index, row)
        _check_fields(row, _PRACTICE_FIELDS, where)
        if not (_PRACTICE_ID.fullmatch(row["id"]) or _QUESTION_ID.fullmatch(row["id"])):
            raise ValueError(f"{where}: id must look like 'SOTA-155' or, for an open question, 'Q-1'")
        _check_unique(row["id"], seen, index, where)
        if not row["title"].strip():
            raise ValueError(f"{where}: field 'title' is empty")
        _check_status_fields(row, where)
        for source in row["sources"]:
            if not _PAPER_ID.fullmatch(source):
                raise ValueError(f"{where}: source {source!r} is not a reading-list id like 'LIT-212'")
            if known is not None and source not in known:
                raise ValueError(f"{where}: source {source!r} is not in {READING_FILE}; add the paper or fix the id")
        if len(set(row["sources"])) != len(row["sources"]):
            raise ValueError(f"{where}: 'sources' lists a paper twice: {row['sources']}")
        if row["module"] and not _MODULE_PATH.fullmatch(row["module"]):
            raise ValueError(
                f"{where}: module {row['module']!r} must be a dotted path inside islands, e.g. 'islands.sync.ddp'"
            )
        experiments = _experiments(row["experiment"], where)
        if row["issue"] < 0:
            raise ValueError(f"{where}: issue must be a project issue number, or 0 for not yet planned")
        practices.append(
            Practice(
                id=row["id"],
                title=row["title"],
                status=row["status"],
                sources=tuple(row["sources"]),
                reason=row["reason"],
                claim=row["claim"],
                module=row["module"],
                experiment=experiments[0] if experiments else "",
                issue=row["issue"],
                experiments=experiments,
            )
        )
    return practices


def _experiments(value: str | list[str], where: str) -> tuple[str, ...]:
    """A row's `experiment`: "" (none), one bench name, or a list of them, the one that tests the claim first."""
    if isinstance(value, str):
        if not value:
            return ()
        value = [value]
    elif not value:
        raise ValueError(f'{where}: experiment = [] names nothing; write experiment = "" for none')
    if len(set(value)) != len(value):
        raise ValueError(f"{where}: 'experiment' lists a bench twice: {value}")
    for name in value:
        if not _EXPERIMENT_NAME.fullmatch(name):
            raise ValueError(f"{where}: experiment {name!r} must be a bench name like 'ddp-scaling'")
    return tuple(value)


def check_backlinks(practices: Iterable[Practice], papers: Iterable[Paper]) -> None:
    """Each paper's `practices` must list exactly the SOTA rows that cite it, so the two files agree."""
    cited_by: dict[str, set[str]] = {}
    for practice in practices:
        if practice.is_question:
            continue  # questions cite related reading; back-links cover practices only
        for source in practice.sources:
            cited_by.setdefault(source, set()).add(practice.id)
    for paper in papers:
        expected = cited_by.get(paper.id, set())
        if set(paper.practices) != expected:
            raise ValueError(
                f"{READING_FILE}: paper {paper.id!r} lists practices {sorted(paper.practices)} but "
                f"{REGISTRY_FILE} cites it from {sorted(expected)}; make the two agree"
            )


def load_papers() -> list[Paper]:
    """The reading list shipped with the package, validated."""
    return parse_papers(_read_package_text(READING_FILE))


def load_practices() -> list[Practice]:
    """The practice registry shipped with the package, validated against the reading list."""
    papers = load_papers()
    practices = parse_practices(_read_package_text(REGISTRY_FILE), [p.id for p in papers])
    check_backlinks(practices, papers)
    return practices
