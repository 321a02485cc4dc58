# Both targets bootstrap .venv themselves; a fresh clone needs only python3 >= 3.10.
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/islands train

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs results/*/quick
