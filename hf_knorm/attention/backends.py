"""Which implementation computes a call, once ``paths.py`` has chosen the path (quadratic or linear).

- The quadratic path (any normalization): the Triton kernel (``triton_kernel.py``) on CUDA when ``triton`` is
  importable and the call is one it computes (a polynomial ``x^p/c``, fp32/bf16/fp16, no attention dropout, no
  returned weights, no norm recording, not traced by ``torch.compile``); the PyTorch kernel (``kernel.py``)
  otherwise, and always on the CPU.
- The linear path (``p = 1``): flash-linear-attention (``fla_linear.py``) on CUDA when ``fla`` is importable and the
  norms are not recorded, not traced by ``torch.compile``; the PyTorch linear kernel (``linear_kernel.py``) otherwise.

``attention_paths()`` counts the call under the name of what ran: ``"triton"``, ``"fla"``, ``"quadratic"`` (the
PyTorch kernel) or ``"linear"`` (the PyTorch linear kernel). :func:`use_kernels` overrides the automatic choice
process-wide: ``"pytorch"`` never uses the GPU kernels; ``"triton"`` / ``"fla"`` fail at once, naming the extra to
install, when their package is missing, and fail on a call whose tensors are not on CUDA (the calls these kernels do
not compute, listed above, still take the PyTorch kernels, and ``attention_paths()`` shows them).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from functools import lru_cache

import torch

from ..extras import require
from .kernel import chunked_attention
from .linear_kernel import linear_attention
from .normalizations import Normalization
from .paths import Path

KERNEL_CHOICES = {"quadratic": ("auto", "pytorch", "triton"), "linear": ("auto", "pytorch", "fla")}
_CHOSEN = {"quadratic": "auto", "linear": "auto"}
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_kernels(quadratic: str | None = None, linear: str | None = None) -> dict[str, str]:
    """Set which kernels run (``None`` leaves a setting as it is); returns the settings now in force.

    Args:
        quadratic: ``"auto"`` (default), ``"pytorch"`` or ``"triton"``.
        linear: ``"auto"`` (default), ``"pytorch"`` or ``"fla"``.

    Raises:
        ValueError: an unknown choice (the message lists them).
        MissingExtraError: ``"triton"`` or ``"fla"`` without its package (``pip install 'hf_knorm[gpu]'``).
    """
    for path, choice in (("quadratic", quadratic), ("linear", linear)):
        if choice is None:
            continue
        if choice not in KERNEL_CHOICES[path]:
            raise ValueError(f"The {path} kernel is one of {', '.join(KERNEL_CHOICES[path])}, not {choice!r}.")
        if choice == "triton":
            require("triton", "The Triton kernel for x^p/c")
        if choice == "fla":
            require("fla", "The flash-linear-attention path for x/1")
        _CHOSEN[path] = choice
    return dict(_CHOSEN)


@lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def with_kernel(path: Path, query: torch.Tensor, normalization: Normalization, *, dropout: float,
                return_weights: bool, recording: bool, compiling: bool) -> Path:
    """``path`` with its ``kernel`` named when a GPU kernel computes the call (see the module docstring)."""
    kind = "linear" if path.linear else "quadratic"
    chosen = _CHOSEN[kind]
    if chosen == "pytorch" or compiling or recording:
        return path
    on_cuda = _device_type(query) == "cuda"
    if chosen != "auto" and not on_cuda:
        raise ValueError(f"use_kernels({kind}={chosen!r}) runs on CUDA tensors; this call's are on "
                         f"{query.device.type}. Move the model to a GPU, or use_kernels({kind}='auto').")
    if not on_cuda:
        return path
    if path.linear:
        return replace(path, kernel="fla") if chosen == "fla" or _importable("fla") else path
    computes = (not normalization.is_softmax and query.dtype in _TRITON_DTYPES and dropout == 0.0
                and not return_weights)
    if computes and (chosen == "triton" or _importable("triton")):
        return replace(path, kernel="triton")
    return path


def _device_type(tensor: torch.Tensor) -> str:
    """Where ``tensor`` is (a seam: the tests run the CUDA choices under Triton's interpreter on a CPU)."""
    return tensor.device.type


def run_quadratic(path: Path, query, key, value, allowed, normalization, **options):
    """The quadratic path's call: :func:`.kernel.chunked_attention`'s arguments and result ``(output, weights)``."""
    if path.kernel != "triton":
        return chunked_attention(query, key, value, allowed, normalization, **options)
    from .triton_kernel import triton_attention  # imports triton: only when it runs

    if options.get("dropout") or options.get("return_weights") or options.get("frobenius_sq") is not None:
        raise ValueError("The Triton kernel computes no dropout, returned weights or norms (with_kernel keeps such "
                         "calls on the PyTorch kernel).")
    keep = ("bias", "scaling", "softcap", "causal")
    return triton_attention(query, key, value, allowed, normalization,
                            **{name: options[name] for name in keep if name in options}), None


def run_linear(path: Path, query, key, value, key_valid, normalization, **options):
    """The linear path's call: :func:`.linear_kernel.linear_attention`'s arguments and result."""
    if path.kernel != "fla":
        return linear_attention(query, key, value, key_valid, normalization, **options)
    from .fla_linear import fla_linear_attention

    if options.pop("frobenius_sq", None) is not None:
        raise ValueError("flash-linear-attention records no norms (with_kernel keeps such calls on the PyTorch "
                         "kernel).")
    return fla_linear_attention(query, key, value, key_valid, normalization, **options)
