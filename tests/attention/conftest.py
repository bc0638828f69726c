"""Fixtures shared by the attention tests."""

import pytest

from hf_knorm.attention import backends, self_check


@pytest.fixture
def stub_cuda(monkeypatch):
    """The dispatcher as on CUDA (the tensors stay on the CPU: its device seam), the GPU packages importable, no
    verdict or warning from an earlier test."""
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    monkeypatch.setattr(backends, "_REPORTED", set())
    monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(backends, "_importable", lambda module: True)
