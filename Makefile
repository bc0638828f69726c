# Every target sets up what it needs: a fresh machine runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel (2.13.0); everything else comes from requirements.lock, which holds the core
# dependencies and those of the train, demo and dev extras (the editable install names them; --no-deps: the lock
# already installed them).
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e ".[train,demo,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-knorm demo --out outputs/demo

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) scripts/bench_attention.py

clean:
	rm -rf $(VENV) outputs
