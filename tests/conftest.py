"""Shared fixtures: the real default model (loaded once per session) and deterministic torch settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels' tests (tests/attention/test_triton_kernel.py) run under Triton's interpreter. It
# must be on before triton is first imported (importing hf_knorm does, through torch): Triton's own library functions
# (tl.sum, tl.cdiv) are decorated then, and a kernel interpreted later cannot call compiled ones.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite in one pytest-xdist worker per core (`-n auto`): each worker gets its share of the cores,
# so that torch's intra-op threads do not oversubscribe them (the processes a test starts inherit the setting).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_models.py
sys.path.insert(0, str(Path(__file__).parent / "training"))  # tests/training/training_helpers.py, used beyond training/


# The compatibility suite (tests marked `compat`, run on every supported Transformers release: `make compat`) fails on a
# DeprecationWarning, or a FutureWarning (Transformers and torch announce most removals so), issued in Transformers,
# torch, hf_knorm or the tests: a deprecated API our code calls, or one the installed release deprecates under it. A
# filter's module is the one Python attributes the warning to (the frame at the warning's stacklevel; a regex matched
# from the name's start): `transformers` for a warning Transformers raises about itself or with stacklevel 1, `hf_knorm`
# or the test module for one raised with stacklevel 2 at our call. pyproject.toml's ignores (third-party noise we cannot
# fix, each named) keep precedence, and so do a test's own filterwarnings marks and `pytest.warns` (hf_knorm's
# deprecated names warn on purpose: their tests assert it).
COMPAT_ERRORS = tuple(f"error::{category}:{module}" for category in ("DeprecationWarning", "FutureWarning")
                      for module in (r"transformers\b", r"torch\b", r"hf_knorm\b", r"test_", r"tiny_models\b"))


def pytest_collection_modifyitems(config, items):
    """Each test marked ``compat`` gets :data:`COMPAT_ERRORS`, then pyproject.toml's ignores, as its first
    filterwarnings mark (applied before, so overridden by, the test's own marks)."""
    mark = pytest.mark.filterwarnings(*COMPAT_ERRORS, *config.getini("filterwarnings"))
    for item in items:
        if item.get_closest_marker("compat") is not None:
            item.add_marker(mark, append=False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _automatic_kernels():
    """Each test starts with the automatic kernel choice, and what it sets (``backends._CHOSEN.set``, a context
    variable) ends with it."""
    from hf_knorm.attention import backends

    token = backends._CHOSEN.set(backends._AUTO)
    yield
    backends._CHOSEN.reset(token)


@pytest.fixture(scope="session")
def default_model_and_tokenizer():
    """SmolLM2-135M-Instruct (fp32, eval) and its tokenizer. Tests must leave it unpatched and unmodified."""
    from hf_knorm import load_default_model

    return load_default_model()
