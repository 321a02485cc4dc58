# Both targets bootstrap .venv themselves; a fresh clone needs only python3 >= 3.10.
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
PIP     = $(PY) -m pip install -q -c constraints.txt

.PHONY: run test test-fast test-experiments lint clean

# pip compiles every installed file to bytecode on one core (~45 s of a ~75 s bootstrap here); installing without it
# and compiling on every core after gives the same .pyc files in ~55 s in all. A few files of the installed packages
# are not this Python's syntax (their own test data): pip skips them silently, compileall exits 1 on them.
# islands' own sources (an editable install), the bench and the tests' helpers are compiled too: where the
# environment sets PYTHONDONTWRITEBYTECODE (these machines do) nothing else ever writes their .pyc, and every fresh
# interpreter of the suite compiled islands' modules again (~0.4 CPU-s each for `import islands.cli` here). A file
# edited later is compiled from source until the next setup, as Python does with any stale .pyc. The codec's numba
# loops are compiled into numba's on-disk cache too (~9 s once), instead of by every checkpointing process at once.
$(STAMP): pyproject.toml bench/pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) --no-compile -e '.[test,lint,hf,frameworks,peers,loggers,dashboard]' -e bench/
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	$(PY) -m compileall -qq -j 0 src bench tests
	$(PY) -c 'from islands.checkpoint.codec.tensor import warm_kernels; warm_kernels()'
	touch $(STAMP)

# the main job: two islands of two workers, DDP inside each, DiLoCo across them
run: $(STAMP)
	$(VENV)/bin/islands train --workers 4 --islands 2 --outer diloco:inner_steps=50

# every unit and integration test, in three processes (pytest-xdist): on 2 cores the suite is CPU-bound (a process
# test's ranks, launcher and CLI import torch each), so more processes only add contention: the whole suite took
# 727 / 697 / 642 / 617 s at -n 7 / 5 / 4 / 3 on this 2-core host, back to back (session 31); a fresh clone's
# `make test` at -n 3 took 10m08s and 11m03s, venv included (12m13s at -n 5). A file whose fixtures span the module stays in
# one process (tests/conftest.py). Session 33, on a slower host of the same kind: 958 s at -n 3, 920 s at -n 4, the
# suite 1691 CPU-s in all (results/test-suite/s33: where the CPU goes, per file and per test); after that session's
# cuts a fresh clone's `make test` took 12m34s, venv included.
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
