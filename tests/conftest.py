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
