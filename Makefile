# Every target sets up what it needs: a fresh machine runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test docs compat matrix device device-check bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel (2.13.0); everything else comes from requirements.lock, which holds the core
# dependencies and those of the train, demo, gpu and dev extras (dev brings docs; the editable install names them;
# --no-deps: the lock already installed them).
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e ".[train,demo,gpu,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-knorm demo --out outputs/demo

# The documentation site (mkdocs.yml) into site/, in strict mode: a broken link or anchor, a page left out of the nav or
# a docstring reference that does not resolve fails the build (tests/test_docs_site.py builds it too). Open
# site/index.html. NO_MKDOCS_2_WARNING silences Material's banner about its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The suite in one pytest-xdist worker per core (tests/conftest.py gives each worker its share of the threads; an idle
# worker takes queued tests from a busy one: the long end-to-end tests do not leave one core idle at the end). Its
# time, and make demo's: docs/status.md, "Setup, times and status" (the one place they are stated).
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra -n auto --dist worksteal

# The compatibility suite (`-m compat`) on another supported Transformers release, in its own cached venv:
# `make compat TRANSFORMERS=5.10.4`. The venv holds the lock minus transformers, then `transformers==X` (pip may move
# what that release pins, e.g. huggingface_hub and tokenizers; torch stays the CPU wheel), then the package with its
# dependencies: installing hf_knorm must keep the chosen release (checked, with `pip check`). The lock goes in with
# --no-deps (it lists every dependency): resolved, peft's and trl's need of transformers would pull the newest release
# and what it requires, which stays behind when X replaces it (transformers 5.25 brought kernels 0.19, and 5.10.4
# fails at import when it finds a kernels it cannot use).
TRANSFORMERS ?=
COMPAT_VENV := .venv-tf$(TRANSFORMERS)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): requirements.lock pyproject.toml
	@test -n "$(TRANSFORMERS)" || { echo "make compat needs a release: make compat TRANSFORMERS=5.10.4" >&2; exit 2; }
	rm -rf $(COMPAT_VENV)
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q torch==2.13.0
	echo torch==2.13.0 > $(COMPAT_VENV)/constraints.txt
	grep -v '^transformers==' requirements.lock > $(COMPAT_VENV)/requirements.txt
	$(COMPAT_PY) -m pip install -q --no-deps -r $(COMPAT_VENV)/requirements.txt
	$(COMPAT_PY) -m pip install -q -c $(COMPAT_VENV)/constraints.txt transformers==$(TRANSFORMERS)
	$(COMPAT_PY) -m pip install -q -c $(COMPAT_VENV)/constraints.txt --no-build-isolation -e .
	$(COMPAT_PY) -m pip check
	$(COMPAT_PY) -c "import importlib.metadata as m, sys; v = m.version('transformers'); \
	    sys.exit(None if v == '$(TRANSFORMERS)' else f'installing hf_knorm moved transformers $(TRANSFORMERS) to {v}')"
	touch $(COMPAT_STAMP)

# pytest exits 5 when the marker selects nothing: that fails here, with a line saying so.
compat: $(COMPAT_STAMP)
	@echo "== compatibility suite on transformers $(TRANSFORMERS)"
	$(COMPAT_PY) -m pytest -q -ra -m compat -p no:cacheprovider || { rc=$$?; \
	    [ $$rc -ne 5 ] || echo "make compat: no test is marked compat: the compatibility suite ran nothing" >&2; \
	    exit $$rc; }

# The releases `.ci/run` tests besides the newest (`make test`): the oldest supported and a middle one.
MATRIX ?= 5.10.4 5.17.0

matrix:
	@for release in $(MATRIX); do $(MAKE) --no-print-directory compat TRANSFORMERS=$$release || exit $$?; done

# The device set (tests/test_devices.py and the bf16 conversion): on CUDA where there is one, on the CPU in bf16.
device: $(STAMP)
	$(PY) -m pytest -q -ra -m device -p no:cacheprovider

# The accelerator check: the device tests, the attention against SDPA (flash on CUDA), a short conversion's speed,
# compiled against eager, an FSDP finetune (CUDA), in one table; without a GPU it runs the CPU half and says what it
# skipped.
device-check: $(STAMP)
	$(PY) scripts/device_check.py

bench: $(STAMP)
	$(PY) scripts/attention/bench_attention.py

clean:
	rm -rf $(VENV) .venv-tf* outputs site
