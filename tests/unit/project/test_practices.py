"""The practice registry and reading list: complete against the seeds, validated, filterable, rendered."""

from __future__ import annotations

import difflib
import importlib
import re
from pathlib import Path

import pytest
from rich.console import Console

from islands.practices import (
    STATUSES,
    Paper,
    Practice,
    check_backlinks,
    filter_practices,
    load_papers,
    load_practices,
    papers_markdown,
    papers_table,
    parse_papers,
    parse_practices,
    practices_markdown,
    practices_table,
)
from islands.practices.__main__ import main as practices_main, render_docs

REPO = Path(__file__).resolve().parents[3]
SEEDS = REPO.parent / "shared" / "seeds"


def _seed_rows(pattern: str, prefix: str) -> dict[str, list[str]]:
    """Rows of a seed table keyed by id ('SOTA-017 v2' -> 'SOTA-017'); skip when the seeds are absent."""
    files = sorted(SEEDS.glob(pattern)) if SEEDS.is_dir() else []
    if not files:
        print(f"seed {pattern} not found under {SEEDS}; seed comparisons skipped")
        pytest.skip(f"seed files {pattern} not found under {SEEDS} (CI provides them as ../shared/seeds)")
    rows: dict[str, list[str]] = {}
    for line in files[0].read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| {prefix}"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            ident = cells[0].split()[0]
            assert ident not in rows, f"seed lists {ident} twice"
            rows[ident] = cells
    assert rows, f"no {prefix} rows parsed from {files[0]}"
    return rows


def _seed_status(cells: list[str]) -> str:
    # The last non-empty cell is the status column ("Rejected — why ..." for rejected rows); two rows
    # in the seed lack a summary, which shifts their status one cell left.
    last = [c for c in cells if c][-1]
    return last.split()[0]


def _longest_shared_run(ours: str, theirs: str) -> int:
    a, b = ours.lower(), theirs.lower()
    return difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b)).size


@pytest.fixture(scope="module")
def practices() -> list[Practice]:
    return load_practices()


@pytest.fixture(scope="module")
def papers() -> list[Paper]:
    return load_papers()


# --- completeness against the seeds -----------------------------------------------------------


def test_every_seed_practice_appears_exactly_once(practices):
    seed = _seed_rows("002_*.txt", "SOTA-")
    ours = [p.id for p in practices if p.id.startswith("SOTA-")]
    assert len(ours) == len(set(ours))
    assert set(seed) <= set(ours), f"missing {set(seed) - set(ours)}"
    assert {"SOTA-364", "SOTA-376"} <= set(ours)
    # rows beyond the seed are practices the project filed itself (ids from SOTA-901): each names its issue
    added = [p for p in practices if p.id.startswith("SOTA-") and p.id not in seed]
    assert all(int(p.id[5:]) >= 901 and p.issue for p in added), [(p.id, p.issue) for p in added]


def test_every_seed_paper_appears_exactly_once(papers):
    seed = _seed_rows("001_*.txt", "LIT-")
    ours = [p.id for p in papers]
    assert len(ours) == len(set(ours))
    assert set(seed) <= set(ours), f"missing {set(seed) - set(ours)}"
    # papers beyond the seed (ids from LIT-901) are read for a row the project filed itself, and cited by it
    added = [p for p in papers if p.id not in seed]
    assert all(int(p.id[4:]) >= 901 and p.practices for p in added), [(p.id, p.practices) for p in added]


def test_statuses_match_the_seed(practices):
    seed = _seed_rows("002_*.txt", "SOTA-")
    mismatched = {
        p.id: (p.status, _seed_status(seed[p.id]))
        for p in practices
        if p.id in seed and p.status != _seed_status(seed[p.id])
    }
    assert not mismatched


def test_sources_include_every_paper_the_seed_names(practices):
    seed = _seed_rows("002_*.txt", "SOTA-")
    for p in practices:
        if p.id in seed:
            named = set(re.findall(r"LIT-\d{3}", " ".join(seed[p.id][1:])))
            assert named <= set(p.sources), f"{p.id} drops {named - set(p.sources)}"


def test_practice_text_is_our_own(practices):
    seed = _seed_rows("002_*.txt", "SOTA-")
    for p in practices:
        if p.id not in seed:
            continue
        seed_title, seed_text = seed[p.id][1], " ".join(seed[p.id][1:])
        assert p.title.strip().lower() != seed_title.strip().lower(), f"{p.id} copies the seed title"
        ratio = difflib.SequenceMatcher(None, p.title.lower(), seed_title.lower()).ratio()
        assert ratio < 0.8, f"{p.id} title is a near copy of the seed ({ratio:.2f})"
        for field in (p.title, p.reason, p.claim):
            assert _longest_shared_run(field, seed_text) < 40, f"{p.id} reuses a long phrase of the seed: {field!r}"


def test_paper_titles_kept_and_notes_written_fresh(papers):
    seed = _seed_rows("001_*.txt", "LIT-")
    for p in papers:
        if p.id not in seed:  # a paper the project added (LIT-901 on): no seed text to compare with
            continue
        assert p.title == seed[p.id][1], f"{p.id}: a paper's title is its name; keep it as published"
        assert _longest_shared_run(p.note, " ".join(seed[p.id][2:])) < 50, f"{p.id} note copies the seed"


# --- shape of the shipped data ----------------------------------------------------------------


def test_rejected_entries_have_reasons_and_nothing_to_test(practices):
    rejected = [p for p in practices if p.status == "Rejected"]
    assert rejected
    for p in rejected:
        assert len(p.reason.split()) >= 8, f"{p.id} reason too thin"
        assert not p.claim and not p.implemented


def test_active_and_proposed_entries_state_a_claim(practices):
    for p in practices:
        if p.status in ("Active", "Proposed", "Open"):
            assert p.claim.endswith("."), f"{p.id} needs a one-sentence claim"


def test_open_questions_present(practices):
    # A question stays Open; once an experiment answers it, its row names that module and experiment.
    questions = [p for p in practices if p.is_question]
    # Q-6 (issue 36): the reading notes' third contradiction, whether parameter servers are obsolete
    assert [q.id for q in questions] == ["Q-1", "Q-2", "Q-3", "Q-4", "Q-5", "Q-6"]
    assert all(q.status == "Open" and q.claim for q in questions)


def test_rows_are_filled_whole_and_the_foundation_rows_are_there(practices):
    # A row names its module and its experiment together: half a row is a claim without a measurement.
    half = [p.id for p in practices if bool(p.module) != bool(p.experiment)]
    assert half == []
    filled = {p.id: (p.module, p.experiment) for p in practices if p.module}
    assert filled["SOTA-047"] == ("islands.sync.ddp", "ddp-scaling")
    assert filled["SOTA-048"] == ("islands.sync.ddp", "ddp-scaling")


def test_issue_assignment(practices):
    by_issue = {}
    for p in practices:
        if p.id.startswith("SOTA-"):
            by_issue.setdefault(p.issue, set()).add(int(p.id[5:]))
    assert by_issue[3] == {47, 48, 59, 75, 214, 215, 224}
    assert by_issue[4] == {155, 216, 219, 222}
    assert by_issue[5] == {220}
    assert by_issue[6] == {54, 56, 57, 189, 437}
    assert by_issue[19] >= {901}  # MuLoCo (SOTA-901, a row the project filed itself)
    assert by_issue[20] >= {930}  # the authenticated control plane of elastic jobs (project-filed)
    assert by_issue[36] == {907}  # the parameter server (project-filed)
    assert by_issue[37] == {906}  # islands plan and its accuracy (project-filed)
    assert set(by_issue) == {0, 3, 4, 5, 6, 19, 20, 36, 37}


def test_implemented_modules_import(practices):
    implemented = [p for p in practices if p.module]
    assert implemented, "the foundation fills SOTA-047/048"
    for p in implemented:
        importlib.import_module(p.module)


def test_backlinks_agree_with_sources(practices, papers):
    by_id = {p.id: p for p in papers}
    for practice in practices:
        for source in practice.sources:
            assert source in by_id
            if not practice.is_question:
                assert practice.id in by_id[source].practices


# --- validation -------------------------------------------------------------------------------

GOOD_ROW = """
[[practice]]
id = "SOTA-900"
title = "A test practice"
status = "Active"
sources = ["LIT-001"]
reason = ""
claim = "Something measurable happens."
module = ""
experiment = ""
issue = 0
"""


def _parse(text: str) -> list[Practice]:
    return parse_practices(text, ["LIT-001"])


def test_good_row_parses():
    (p,) = _parse(GOOD_ROW)
    assert p.id == "SOTA-900" and p.sources == ("LIT-001",) and not p.implemented


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('"Active"', '"Adopted"'), "unknown status 'Adopted'"),
        (lambda t: t + t, "duplicate id 'SOTA-900'"),
        (lambda t: t.replace('["LIT-001"]', '["LIT-002"]'), "source 'LIT-002' is not in reading.toml"),
        (
            lambda t: t.replace('"Active"', '"Rejected"').replace(
                'claim = "Something measurable happens."', 'claim = ""'
            ),
            "Rejected entry has no reason",
        ),
        (lambda t: t.replace('reason = ""\n', ""), "missing field(s) ['reason']"),
        (lambda t: t.replace("issue = 0", 'issue = 0\nowner = "me"'), "unknown field(s) ['owner']"),
        (lambda t: t.replace("issue = 0", 'issue = "3"'), "field 'issue' must be int"),
        (lambda t: t.replace('"SOTA-900"', '"SOTA900"'), "id must look like"),
        (lambda t: t.replace('status = "Active"', 'status = "Open"'), "practices (SOTA-nnn) take one of"),
        (lambda t: t.replace('module = ""', 'module = "os.path"'), "dotted path inside islands"),
        (lambda t: t.replace('claim = "Something measurable happens."', 'claim = ""'), "needs a 'claim'"),
        (lambda t: t.replace("[[practice]]", "[[practise]]"), "unknown top-level key"),
        (lambda t: t.replace("issue = 0", "issue = "), "not valid TOML"),
    ],
)
def test_bad_rows_name_the_problem(edit, message):
    with pytest.raises(ValueError) as info:
        _parse(edit(GOOD_ROW))
    assert message in str(info.value)
    if "TOML" not in message and "top-level" not in message:
        assert "row " in str(info.value)  # names the offending row


def test_question_rows_must_be_open():
    text = GOOD_ROW.replace('"SOTA-900"', '"Q-9"')
    with pytest.raises(ValueError, match="must have status 'Open'"):
        _parse(text)
    (q,) = _parse(text.replace('"Active"', '"Open"'))
    assert q.is_question


def test_paper_rows_are_validated():
    row = (
        '[[paper]]\nid = "LIT-001"\nauthors_year = "A et al. 2020"\nref = "arXiv:0000.00000"\n'
        'title = "T"\nnote = "Why."\npractices = ["SOTA-900"]\n'
    )
    (paper,) = parse_papers(row)
    assert paper.practices == ("SOTA-900",)
    with pytest.raises(ValueError, match="duplicate id 'LIT-001'"):
        parse_papers(row + row)
    with pytest.raises(ValueError, match="'note' is empty"):
        parse_papers(row.replace('"Why."', '""'))
    with pytest.raises(ValueError, match="LIT- and three digits"):
        parse_papers(row.replace('"LIT-001"', '"PAPER-1"'))


def test_backlink_mismatch_is_refused():
    practices = _parse(GOOD_ROW)
    paper = Paper("LIT-001", "A 2020", "", "T", "n", ())
    with pytest.raises(ValueError, match=r"LIT-001.*SOTA-900"):
        check_backlinks(practices, [paper])
    check_backlinks(practices, [Paper("LIT-001", "A 2020", "", "T", "n", ("SOTA-900",))])


# --- filters ----------------------------------------------------------------------------------


def test_filter_by_status(practices):
    for status in STATUSES:
        chosen = filter_practices(practices, status=status)
        assert chosen and all(p.status == status for p in chosen)
    assert filter_practices(practices, status="rejected") == filter_practices(practices, status="Rejected")
    both = filter_practices(practices, status=["Active", "Proposed"])
    assert {p.status for p in both} == {"Active", "Proposed"}
    assert len(both) == len(filter_practices(practices, status="Active")) + len(
        filter_practices(practices, status="Proposed")
    )
    assert filter_practices(practices) == practices


def test_filter_by_implemented(practices):
    done = filter_practices(practices, implemented=True)
    todo = filter_practices(practices, implemented=False)
    assert {p.id for p in done} == {p.id for p in practices if p.module and p.experiment}
    assert {"SOTA-047", "SOTA-048"} <= {p.id for p in done}
    assert len(done) + len(todo) == len(practices) and not {p.id for p in done} & {p.id for p in todo}
    assert filter_practices(practices, status="Rejected", implemented=True) == []
    assert filter_practices(practices, status="Active", implemented=True) == [p for p in done if p.status == "Active"]


def test_filter_rejects_bad_arguments(practices):
    with pytest.raises(ValueError, match=r"unknown status 'Done'.*Active"):
        filter_practices(practices, status="Done")
    with pytest.raises(TypeError, match="implemented"):
        filter_practices(practices, implemented="yes")


def test_a_row_may_name_several_experiments_the_first_testing_its_claim():
    text = GOOD_ROW.replace('module = ""', 'module = "islands.practices"')
    (p,) = _parse(text.replace('experiment = ""', 'experiment = ["x-y", "z"]'))
    assert p.experiment == "x-y" and p.experiments == ("x-y", "z") and p.implemented
    (p,) = _parse(text.replace('experiment = ""', 'experiment = "x-y"'))
    assert p.experiments == ("x-y",)
    (p,) = _parse(GOOD_ROW)
    assert p.experiment == "" and p.experiments == ()
    for bad, message in (
        ("[]", "names nothing"),
        ('["x-y", "x-y"]', "lists a bench twice"),
        ('["x-y", "Bad Name"]', "'Bad Name' must be a bench name"),
        ('"Bad Name"', "'Bad Name' must be a bench name"),
        ('["x-y", 3]', "must be a list of strings"),
        ("3", "must be str or list"),
    ):
        with pytest.raises(ValueError, match=message):
            _parse(text.replace('experiment = ""', f"experiment = {bad}"))
    rendered = practices_markdown(_parse(text.replace('experiment = ""', 'experiment = ["x-y", "z"]')))
    assert "| `islands.practices` | x-y, z |" in rendered


def test_implemented_needs_module_and_experiment():
    (p,) = _parse(GOOD_ROW.replace('module = ""', 'module = "islands.practices"'))
    assert not p.implemented
    (p,) = _parse(
        GOOD_ROW.replace('module = ""', 'module = "islands.practices"').replace('experiment = ""', 'experiment = "x-y"')
    )
    assert p.implemented


# --- rendering --------------------------------------------------------------------------------


def _render(table) -> str:
    console = Console(record=True, width=250, color_system=None)
    console.print(table)
    return console.export_text()


def test_tables_show_every_row(practices, papers):
    text = _render(practices_table(practices))
    assert all(p.id in text for p in practices)
    implemented = sum(p.implemented for p in practices)
    assert "islands.sync.ddp" in text and f"{len(practices)} entries, {implemented} implemented" in text
    detail = _render(practices_table(filter_practices(practices, status="Rejected"), detail=True))
    assert "SOTA-076" in detail and "scheduler" in detail and "SOTA-047" not in detail
    text = _render(papers_table(papers))
    assert all(p.id in text for p in papers) and f"{len(papers)} papers" in text


def test_markdown_has_one_row_per_entry(practices, papers):
    md = practices_markdown(practices)
    table_rows = [line for line in md.splitlines() if line.startswith("| SOTA-") or line.startswith("| Q-")]
    assert len(table_rows) == len(practices)
    assert all(line.count(" | ") == 6 for line in table_rows)  # seven cells, no stray pipes
    rejected = filter_practices(practices, status="Rejected")
    assert md.count("- **SOTA-") == len(rejected)  # one reason line per rejected practice
    assert all(p.reason[:30] in md for p in rejected)
    paper_rows = [line for line in papers_markdown(papers).splitlines() if line.startswith("| LIT-")]
    assert len(paper_rows) == len(papers)


def test_markdown_escapes_pipes():
    (p,) = _parse(GOOD_ROW.replace('"A test practice"', '"a | b"'))
    assert "a \\| b" in practices_markdown([p])


def test_cli_prints_markdown_and_refuses_bad_status(capsys):
    assert practices_main(["--markdown", "--status", "proposed"]) == 0
    out = capsys.readouterr().out
    assert "SOTA-155" in out and "SOTA-047" not in out
    assert practices_main(["--markdown", "--papers"]) == 0
    assert "LIT-212" in capsys.readouterr().out
    assert practices_main(["--status", "Done"]) == 2
    assert "unknown status 'Done'" in capsys.readouterr().err


def test_docs_page_tables_are_current():
    page = REPO / "docs" / "practices.md"
    text = page.read_text(encoding="utf-8")
    assert render_docs(text) == text, (
        "docs/practices.md is stale; run: python -m islands.practices --update-docs docs/practices.md"
    )


def test_render_docs_needs_markers():
    with pytest.raises(ValueError, match="marker"):
        render_docs("no markers here")
