"""Every config key says what it does: one description per key (beside its definition in islands.config), shown by
`islands train --help` and in docs/config.md's key reference (issue #33, item 8)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from islands import config as C
from islands.cli import build_parser

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


@pytest.fixture(scope="module")
def train() -> argparse.ArgumentParser:
    return train_parser()


def test_sections_are_the_job_configs_fields():
    """A section added to JobConfig but not to SECTIONS would escape every check below."""
    assert [f.name for f in fields(C.JobConfig)] == list(C.SECTIONS)


def test_every_key_has_one_line_description():
    text = C.descriptions()
    assert list(text) == list(C.keys())  # every key of every section, nothing else
    empty = [k for k, v in text.items() if not v.strip()]
    assert not empty, f"keys without a description (give them one in islands.config: _key(default, help)): {empty}"
    multi = [k for k, v in text.items() if "\n" in v]
    assert not multi, f"descriptions are one line: {multi}"
    bare = [k for k, v in text.items() if v.strip().strip(".").lower() in ("", C.default_text(k).strip("'"))]
    assert not bare, f"descriptions that only repeat the default: {bare}"


def test_description_reads_the_field_definition():
    """The single source: the field's metadata, nothing kept beside it."""
    steps = next(f for f in fields(C.TrainConfig) if f.name == "steps")
    assert C.descriptions()["train.steps"] == steps.metadata["help"]
    assert C.default_text("train.steps") == "200"
    assert C.default_text("train.optimizer") == "'adamw'"  # a spec in its text form


def test_every_train_option_has_help_beyond_the_default(train):
    missing = []
    for action in train._actions:
        if not action.option_strings:
            continue
        words = re.sub(r"\(default[^)]*\)", "", action.help or "").strip()
        if not words:
            missing.append(action.option_strings[0])
    assert not missing, f"`islands train --help` options with no help beyond their default: {missing}"
    train.format_help()  # renders (argparse formats each help with %: an unescaped % would raise here)


def test_each_config_flag_shows_its_description_and_default(train):
    by_dest = {a.dest: a for a in train._actions}
    text = C.descriptions()
    flags = {k for k, typ in C.keys().items() if typ != "dict"}  # tables (task.options) have no flag
    assert flags <= set(by_dest), f"config keys without a flag: {sorted(flags - set(by_dest))}"
    for key in flags:
        shown = by_dest[key].help % {}  # as argparse prints it (%% -> %)
        assert shown == f"{text[key]} (default {C.default_text(key)})", key
    rendered = " ".join(train.format_help().split())
    for key in ("train.steps", "train.lr", "checkpoint.every", "output.run_dir", "checkpoint.memory_peer"):
        assert " ".join(text[key].split()) in rendered, key


def test_docs_reference_is_up_to_date():
    docs = DOCS.read_text()
    assert C.REFERENCE_START in docs and C.REFERENCE_END in docs, "docs/config.md lost its key-reference markers"
    block = docs.split(C.REFERENCE_START, 1)[1].split(C.REFERENCE_END, 1)[0]
    assert block.strip() == C.reference_markdown().strip(), (
        "docs/config.md's key reference differs from the descriptions in islands/config.py; rewrite it from the "
        "repository root: python -c 'from islands.config import write_reference; write_reference()'"
    )


def test_docs_list_every_key_with_its_description():
    """Independent of the generator: each key's row in docs/config.md carries its description."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| `([a-z_]+\.[a-z_]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    text = C.descriptions()
    assert set(rows) == set(text), f"docs/config.md rows differ from the keys: {sorted(set(rows) ^ set(text))}"
    for key, description in text.items():
        cell = rows[key].split(" | ")[-1].removesuffix(" |")
        cell = cell.replace("\\|", "|").replace("&lt;", "<").replace("&gt;", ">")
        assert cell == description, key


def test_write_reference_fills_the_block(tmp_path):
    doc = tmp_path / "config.md"
    doc.write_text(f"intro\n\n{C.REFERENCE_START}\nstale\n{C.REFERENCE_END}\n\nafter\n")
    assert C.write_reference(doc)
    text = doc.read_text()
    assert "stale" not in text and "| `train.steps` | `steps` | `200` |" in text and text.endswith("after\n")
    assert not C.write_reference(doc)  # a second run changes nothing
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="no"):
        C.write_reference(doc)
