"""Shared fixtures: the real default model (loaded once per session) and deterministic torch settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_models.py


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def default_model_and_tokenizer():
    """SmolLM2-135M-Instruct (fp32, eval) and its tokenizer. Tests must leave it unpatched and unmodified."""
    from hf_knorm import load_default_model

    return load_default_model()
