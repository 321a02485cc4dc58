# Both targets bootstrap .venv themselves; a fresh clone needs only python3 >= 3.10.
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
PIP     = $(PY) -m pip install -q -c constraints.txt

.PHONY: run test test-fast test-experiments lint clean

# Setup installs with uv (~13 s here, against pip's ~45 s for the same set) from the sources pip is configured with
# (its find-links, where these machines keep torch's CPU wheel, and its index URLs, from pip's config files and
# PIP_* variables), choosing among them as pip does (the best match on any index, not uv's first index that has the
# package), and falls back to pip should uv be unavailable or fail. The codec's numba loops are compiled into numba's
# on-disk cache (~9 s once), instead of by every checkpointing process at once; beside them, on the other core,
# scripts/warm_imports.py imports what the suite's processes import, writing those modules' .pyc once (a fresh
# clone's first `make test` ran 790 s of tests against 699 s for its second, with nothing else changed: the first
# compiled them in many processes at once). Nothing else is compiled ahead: see PYTHONDONTWRITEBYTECODE below.
PIP_CONF    = $(shell python3 -m pip config get global.$(1) 2>/dev/null)
UV_SOURCES  = --index-strategy unsafe-best-match \
    $(foreach folder,$(sort $(PIP_FIND_LINKS) $(call PIP_CONF,find-links)),--find-links $(folder)) \
    $(foreach url,$(sort $(PIP_EXTRA_INDEX_URL) $(call PIP_CONF,extra-index-url)),--extra-index-url $(url)) \
    $(foreach url,$(firstword $(PIP_INDEX_URL) $(call PIP_CONF,index-url)),--index-url $(url))
$(STAMP): pyproject.toml bench/pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) $(UV_SOURCES) -c constraints.txt \
	    -e '.[test,lint,hf,frameworks,peers,loggers,dashboard]' -e bench/ \
	  || (echo 'make: uv failed; installing with pip' && $(PY) -m pip install -q --upgrade pip && $(PIP) -e '.[test,lint,hf,frameworks,peers,loggers,dashboard]' -e bench/)
	$(PY) scripts/warm_imports.py & $(PY) -c 'from islands.checkpoint.codec.tensor import warm_kernels; warm_kernels()'; \
	  code=$$?; wait; exit $$code
	touch $(STAMP)

# These machines set PYTHONDONTWRITEBYTECODE. Then no process writes the .pyc of what it imports, and every fresh
# interpreter of the suite compiled torch's, islands' and the rest again (2.7 against 2.3 CPU-s for a launcher's
# imports), and every xdist process rewrote every test module's asserts (~9 of collection's ~17 s; pytest keeps its
# rewrites only where bytecode may be written). Make's own targets write it, into the .venv they own and the
# tree's __pycache__ folders (git ignores them): each module is compiled once, by its first importer, for exactly
# what is imported, where compiling all of .venv at setup took 47 s. A .pyc is written atomically, so processes
# importing at once are safe.
unexport PYTHONDONTWRITEBYTECODE

# the main job: two islands of two workers, DDP inside each, DiLoCo across them
run: $(STAMP)
	$(VENV)/bin/islands train --workers 4 --islands 2 --outer diloco:inner_steps=50

# every unit and integration test, in three processes (pytest-xdist): on 2 cores the suite is CPU-bound (a process
# test's ranks, launcher and CLI import torch each), so more processes only add contention: the whole suite took
# 727 / 697 / 642 / 617 s at -n 7 / 5 / 4 / 3 on this 2-core host, back to back (session 31); a fresh clone's
# `make test` at -n 3 took 10m08s and 11m03s, venv included (12m13s at -n 5). A file whose fixtures span the module stays in
# one process (tests/conftest.py). Session 33, on a slower host of the same kind: 958 s at -n 3, 920 s at -n 4, the
# suite 1691 CPU-s in all (results/test-suite/s33: where the CPU goes, per file and per test); after that session's
# cuts a fresh clone's `make test` took 12m34s, venv included. Session 34, with uv and no compile ahead (setup 90 -> 31 s):
# 14m32s and 14m52s, venv included, on a day this host ran the same suite at 787-871 s of tests (results/test-suite/s34).
# Session 35: 1419 -> 1245 CPU-s of tests (the launcher draws loss.png; CLI tests in-process); a fresh clone's
# `make test` took 12m46s (48 s setup with the import warm-up, 717 s of tests; results/test-suite/s35).
# Session 36, a new VM of the same size: 10m16s, 11m45s, 9m58s and 9m19s from four passing fresh clones (28-39 s setup,
# 531-667 s of tests; results/test-suite/s36). Session 37, another VM: session 36's end 12m57s, this session's 12m49s
# (results/test-suite/s37: the host, not the suite, moved).
# The experiments' smoke lane is its own target (below); CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup -m "not experiments"

# every registered `islands bench` experiment in its smoke tier, from a fresh directory, so none breaks unseen
test-experiments: $(STAMP)
	$(PY) -m pytest -q -n 2 bench/tests -m experiments --durations=10

# lint, format and types (pyproject.toml: [tool.ruff], [tool.mypy]); every rule turned off is listed there with why
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the quick lane, for a developer between edits: tests that start no process and run in seconds (tests/unit; the
# bench's own such tests, bench/tests minus those marked integration, slow or experiments), in two processes
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit bench/tests -m "not integration and not slow and not experiments"

clean:
	rm -rf $(VENV) runs results/*/quick
