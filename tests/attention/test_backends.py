"""Which kernel runs a call (``backends.py``): the rules on CUDA and on the CPU, the override, its errors.

The CUDA choices are checked with the device seam set to "cuda" (the tensors stay on the CPU; nothing runs here);
``test_triton_kernel.py`` runs a patched model through the Triton kernel itself, under Triton's interpreter.
"""

import sys

import pytest
import torch

from hf_knorm.attention import backends
from hf_knorm.attention.normalizations import parse_normalization
from hf_knorm.attention.paths import Path
from hf_knorm.extras import MissingExtraError

QUADRATIC, LINEAR = Path(linear=False, reason="x^3/16 is not linear"), Path(linear=True)
PLAIN = dict(dropout=0.0, return_weights=False, recording=False, compiling=False)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(backends, "_importable", lambda module: True)
    monkeypatch.setattr(backends, "_CHOSEN", {"quadratic": "auto", "linear": "auto"})


def _name(path, spelling="x^3/16", dtype=torch.bfloat16, **options):
    query = torch.zeros(1, 2, 3, 4, dtype=dtype)
    return backends.with_kernel(path, query, parse_normalization(spelling), **{**PLAIN, **options}).name


def test_on_cuda_the_gpu_kernels_take_what_they_compute(on_cuda):
    assert _name(QUADRATIC) == "triton"
    assert _name(QUADRATIC, dtype=torch.float16) == "triton"
    assert _name(LINEAR, "x/1") == "fla"
    assert _name(LINEAR, "x/sqrtN", dtype=torch.float32) == "fla"


@pytest.mark.parametrize("case", [dict(spelling="softmax"), dict(dtype=torch.float64), dict(dropout=0.1),
                                  dict(return_weights=True), dict(recording=True), dict(compiling=True)],
                         ids=["softmax", "fp64", "dropout", "weights", "recording", "compiling"])
def test_on_cuda_the_rest_stays_on_the_pytorch_kernel(on_cuda, case):
    assert _name(QUADRATIC, **case) == "quadratic"


def test_on_cuda_without_the_packages_the_pytorch_kernels_run(on_cuda, monkeypatch):
    monkeypatch.setattr(backends, "_importable", lambda module: False)
    assert _name(QUADRATIC) == "quadratic"
    assert _name(LINEAR, "x/1") == "linear"
    assert _name(LINEAR, "x/1", recording=True) == "linear"


def test_on_the_cpu_the_pytorch_kernels_run():
    assert _name(QUADRATIC) == "quadratic"
    assert _name(LINEAR, "x/16") == "linear"


def test_use_kernels_overrides_and_refuses(on_cuda, monkeypatch):
    assert backends.use_kernels(quadratic="pytorch", linear="pytorch") == {"quadratic": "pytorch", "linear": "pytorch"}
    assert _name(QUADRATIC) == "quadratic" and _name(LINEAR, "x/1") == "linear"
    with pytest.raises(ValueError, match="one of auto, pytorch, triton"):
        backends.use_kernels(quadratic="flash")
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'hf_knorm\[gpu\]'"):
        backends.use_kernels(quadratic="triton")
    monkeypatch.setitem(sys.modules, "fla", None)
    with pytest.raises(MissingExtraError,
                       match=r"needs fla-core, which is not installed: pip install 'hf_knorm\[gpu\]'"):
        backends.use_kernels(linear="fla")


def test_a_forced_gpu_kernel_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setattr(backends, "_CHOSEN", {"quadratic": "triton", "linear": "fla"})
    with pytest.raises(ValueError, match="runs on CUDA tensors; this call's are on cpu"):
        _name(QUADRATIC)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        _name(LINEAR, "x/1")
