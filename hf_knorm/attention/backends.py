"""Which implementation computes a call, once ``paths.py`` has chosen the path (quadratic or linear).

- The quadratic path: PyTorch's SDPA (``sdpa.py``) for the families that are a softmax over modified logits
  (softmax, SSMax, a sink softmax; no softcap, no attention dropout, no returned weights, no norm recording, not
  traced by ``torch.compile``, no softmax window), on any device; the Triton kernel (``triton_kernel.py``) on CUDA for
  the calls it computes (a polynomial ``x^p/c``, fp32/bf16/fp16, no attention dropout, no returned weights, no norm
  recording, not traced by ``torch.compile``); FlexAttention (``flex.py``, compiled) on CUDA for the families that
  are a softmax over modified logits, whose weight has an element-wise logarithm (``Normalization.log_weights``:
  sigmoid, ``relu(x)^p/c``, even ``x^p/c``) or is a ratio of two such weights (``Normalization.log_weight_ratio``:
  softpick, in two passes), fp32/bf16/fp16, with a softcap, no attention dropout, no returned weights, no norm
  recording, not traced by ``torch.compile``; flash-linear-attention's stick-breaking kernel
  (``fla_stick_breaking.py``) on CUDA for a family declaring ``Normalization.stick_break`` on the calls it computes
  (causal, as many queries as keys, padded keys anywhere, no softcap or bias, bf16/fp16, fp32 where TF32 is asked
  for, no attention dropout, no returned weights, no norm recording, not traced;
  :func:`.fla_stick_breaking.layout_blocker`: what ``layout`` says of the call); the PyTorch chunked kernel
  (``kernel.py``) otherwise, and every family on the CPU but SDPA's. SDPA computes bf16/fp16 inputs on CUDA in
  their dtype (its flash kernel), everything else in fp32 (``sdpa.sdpa_call``).

  The order the automatic choice tries (not measured yet: ``make device-check`` times each family against SDPA flash
  on a GPU, and the order is to be confirmed by it, issue 64): softmax itself on SDPA (its flash kernel), then
  FlexAttention (a softcap, which SDPA has none of); SSMax and a sink softmax on FlexAttention first (it reads key
  padding without an ``N x N`` mask, where SDPA takes a dense mask and leaves its flash kernel), then SDPA (bf16
  operands on CUDA too); the element-wise families on the Triton kernel (measured: 1.08x SDPA flash at 16k for
  ``x^3/16``; FlexAttention only when forced); sigmoid and softpick on FlexAttention; stick-breaking on fla's
  stick-breaking kernel.
- The linear path (``p = 1``): flash-linear-attention (``fla_linear.py``) on CUDA for the calls it computes
  (fp32/bf16/fp16, norms not recorded, not traced by ``torch.compile``); the PyTorch linear kernel
  (``linear_kernel.py``) otherwise.

A GPU kernel computes a call only once it has proved itself on the device in use: ``self_check.py`` compares it with
the PyTorch kernel on small shapes, outputs and gradients, the first time a (device, dtype, kernel, normalization
family, head dimension) comes up in the process. Under the automatic choice a kernel whose package is not installed
is not tried; one that fails its check or cannot be imported is reported once, with the reason, by a warning, and the
PyTorch kernel computes its calls. SDPA needs no self-check: it is PyTorch's own, and ``sdpa.py`` builds inputs on
which it computes the family's weights exactly (``tests/attention/test_sdpa.py``).

:func:`kernels` overrides the automatic choice inside a ``with`` block: ``"pytorch"`` runs the PyTorch chunked and
linear kernels only (no SDPA, no GPU kernel); ``"sdpa"``, ``"triton"``, ``"flex"`` / ``"fla"`` force one
(``quadratic="fla"``: fla's stick-breaking kernel; ``linear="fla"``: its linear-attention kernels): the GPU
kernels fail at once, naming the extra to install, when its package is missing, and each raises with the reason on a
call it cannot compute (another family, tensors not on CUDA, dropout, ...) and a GPU kernel when it fails its
self-check. ``attention_paths()`` counts each call under the name of what ran: ``"sdpa"``, ``"triton"``, ``"flex"``,
``"fla"``, ``"quadratic"`` (the PyTorch chunked kernel) or ``"linear"`` (the PyTorch linear kernel); the
``hf_knorm.attention`` logger says at DEBUG level which kernel computes a call and, for a PyTorch one, why.
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import threading
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from types import MappingProxyType

import torch

from ..extras import require
from .kernel import chunked_attention
from .fla_stick_breaking import layout_blocker
from .flex import available as flex_available
from .linear_kernel import linear_attention
from .masks import CallLayout
from ..normalizations import Normalization
from .paths import Path
from .sdpa import sdpa_attention, sdpa_blocker
from .self_check import family_of, key_of, verdict
from .taps import count_tap, taps_set

KERNEL_CHOICES = {"quadratic": ("auto", "pytorch", "sdpa", "triton", "flex", "fla"),
                  "linear": ("auto", "pytorch", "fla")}
KEY_PADDING_KERNELS = ("flex", "fla")
"""The quadratic kernels that read key padding as it is (:class:`~.masks.KeyPadding`, no ``N x N`` mask built)."""
_AUTO = MappingProxyType({"quadratic": "auto", "linear": "auto"})
_CHOSEN: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("hf_knorm_kernels", default=_AUTO)
"""The kernel choices in force in this context (a thread, an asyncio task): :func:`kernels` sets them for its block."""
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {"triton": "the Triton kernel", "fla": "flash-linear-attention", "sdpa": "SDPA", "flex": "FlexAttention"}
_MODULES = {"triton": "triton", "fla": "fla", "flex": "triton"}  # compiled FlexAttention generates Triton kernels
logger = logging.getLogger("hf_knorm.attention")
_REPORTED: set[tuple] = set()  # self-check keys whose failure has been warned about
_REPORTED_LOCK = threading.Lock()


@contextmanager
def kernels(quadratic: str | None = None, linear: str | None = None):
    """``with kernels(quadratic="pytorch"):``: which kernels run inside the block (``None`` leaves a setting as it
    is); yields the settings in force, and restores the previous ones on leaving. The choice is a context variable:
    it holds in this thread (or asyncio task) only, so two threads may run with different kernels. A forced kernel
    (``"triton"``, ``"fla"``) raises on a call it cannot compute and when it fails its self-check (:func:`with_kernel`).

    Args:
        quadratic: ``"auto"`` (default), ``"pytorch"`` (the chunked kernel for every call), ``"sdpa"``,
            ``"triton"``, ``"flex"`` (FlexAttention, compiled, on CUDA) or ``"fla"`` (fla's stick-breaking kernel).
        linear: ``"auto"`` (default), ``"pytorch"`` or ``"fla"``.

    Raises:
        ValueError: an unknown choice (the message lists them).
        MissingExtraError: ``"triton"`` or ``"fla"`` without its package (``pip install 'hf_knorm[gpu]'``).
    """
    token = _CHOSEN.set(_checked(quadratic, linear))
    count_tap(+1)  # compiled code reads the choice only while a tap is set (taps.taps_set: no graph break otherwise)
    try:
        yield dict(_CHOSEN.get())
    finally:
        _CHOSEN.reset(token)
        count_tap(-1)


def use_kernels(quadratic: str | None = None, linear: str | None = None) -> dict[str, str]:
    """Deprecated (0.2.0; removed in 0.3.0): ``with hf_knorm.kernels(...)``. Sets the kernels in the current context
    (this thread), until the next call; returns the settings now in force. Code traced by ``torch.compile`` does not
    read this choice (it computes with the PyTorch kernels whatever is chosen; a ``kernels`` block makes it read
    the choice, and refuse a call a forced kernel cannot compute)."""
    warnings.warn("hf_knorm.use_kernels is deprecated and will be removed in 0.3.0: use the context manager "
                  "`with hf_knorm.kernels(quadratic=..., linear=...):`, which restores the previous kernels on leaving.",
                  DeprecationWarning, stacklevel=2)
    _CHOSEN.set(_checked(quadratic, linear))
    return dict(_CHOSEN.get())


def chosen_kernels() -> dict[str, str]:
    """The kernel choices in force in this context: ``{"quadratic": ..., "linear": ...}``."""
    return dict(_CHOSEN.get())


def _checked(quadratic: str | None, linear: str | None) -> Mapping[str, str]:
    """The choices in force with ``quadratic`` and ``linear`` applied (``None`` leaves one as it is), checked."""
    chosen = dict(_CHOSEN.get())
    for path, choice in (("quadratic", quadratic), ("linear", linear)):
        if choice is None:
            continue
        if choice not in KERNEL_CHOICES[path]:
            raise ValueError(f"The {path} kernel is one of {', '.join(KERNEL_CHOICES[path])}, not {choice!r}.")
        if choice == "triton":
            require("triton", "The Triton kernel for x^p/c")
        if choice == "fla":
            require("fla", f"flash-linear-attention ({'x/1' if path == 'linear' else 'stick-breaking'})")
        chosen[path] = choice
    return MappingProxyType(chosen)


@lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def with_kernel(path: Path, query: torch.Tensor, normalization: Normalization, *, dropout: float,
                return_weights: bool, recording: bool, compiling: bool, softcap: float | None = None,
                sdpa: bool = True, layout: CallLayout | None = None) -> Path:
    """``path`` with its ``kernel`` named when SDPA or a GPU kernel computes the call (see the module docstring).
    ``sdpa``: a route for the whole call (SDPA, FlexAttention) may compute it (``False`` for the parts of a softmax
    window, which ``window.py`` composes). ``layout``: the call's mask, bias, causality and lengths, which fla's
    stick-breaking kernel reads (``None``: not known, and that kernel is not chosen).

    Raises:
        ValueError: a kernel forced by :func:`kernels` cannot compute this call (the message says why).
        RuntimeError: a forced kernel failed its self-check on this device (the message says how).
    """
    kind = "linear" if path.linear else "quadratic"
    chosen = _CHOSEN.get()[kind] if not compiling or taps_set() else "auto"  # see kernels()
    if chosen == "pytorch":
        return path if compiling else _log(path, f"kernels({kind}='pytorch')")
    options = dict(dropout=dropout, return_weights=return_weights, recording=recording, compiling=compiling)
    if chosen == "sdpa":
        blocker = _sdpa_blocker(normalization, softcap, sdpa, options)
        if blocker:
            raise ValueError(f"kernels(quadratic='sdpa') forces SDPA, which cannot compute this call: {blocker}. "
                             "Use kernels(quadratic='auto') to let the PyTorch kernel compute the calls it does "
                             "not.")
        return _log(replace(path, kernel="sdpa"), "a softmax over modified logits")
    if chosen != "auto":
        return _gpu_kernel(chosen, path, query, normalization, forced=True, layout=layout, softcap=softcap,
                           **options) or path
    reasons = []
    for kernel in _order(path, normalization, sdpa):
        if kernel == "sdpa":
            blocker = _sdpa_blocker(normalization, softcap, sdpa, options)
            if not blocker:
                return _log(replace(path, kernel="sdpa"), "a softmax over modified logits")
            reasons.append(f"SDPA does not compute it: {blocker}")
            continue
        chosen_path = _gpu_kernel(kernel, path, query, normalization, forced=False, reasons=reasons, layout=layout,
                                  softcap=softcap, **options)
        if chosen_path is not None:
            return chosen_path
    if compiling:  # traced code: no logging (a graph break)
        return path
    return _log(path, "; ".join(reasons) or "no other kernel computes it")


def _order(path: Path, normalization: Normalization, whole_call: bool) -> list[str]:
    """The kernels the automatic choice tries, in order (see the module docstring): softmax itself on SDPA's flash
    kernel, then FlexAttention; SSMax and a sink softmax on FlexAttention (key padding without a dense mask) before
    SDPA; an element-wise weight on the Triton kernel; a weight with a logarithm only (sigmoid) or a ratio of two
    (softpick) on FlexAttention; stick-breaking on fla's kernel. To be confirmed by the device measurement
    (``make device-check``, issue 64)."""
    if path.linear:
        return ["fla"]
    paths = normalization.fast_paths
    if "triton" in paths:
        return ["triton"]
    if not whole_call:
        return []
    if "fla_stickbreaking" in paths:
        return ["fla"]
    form = normalization.softmax_logits
    if form is not None and form.is_plain:
        return ["sdpa", "flex"]
    return [kernel for kernel in ("flex", "sdpa") if kernel in paths]


def automatic_order(normalization: Normalization) -> list[str]:
    """The kernels the automatic choice tries for a plain quadratic call of ``normalization`` on CUDA, in order
    (before the PyTorch chunked kernel): what ``make device-check`` times per family."""
    return _order(Path(linear=False), normalization, True)


def _sdpa_blocker(normalization: Normalization, softcap, whole_call: bool, options: dict) -> str:
    if not whole_call:
        return "the part of a softmax window"
    return sdpa_blocker(normalization, softcap=softcap, **options)


def _gpu_kernel(kernel: str, path: Path, query: torch.Tensor, normalization: Normalization, *, forced: bool,
                reasons: list | None = None, layout: CallLayout | None = None, softcap: float | None = None,
                **options) -> Path | None:
    """``path`` computed by the GPU kernel ``kernel`` when it can compute the call and has passed its self-check;
    otherwise ``None`` with the reason appended to ``reasons`` (a forced kernel raises instead)."""
    kind = "linear" if path.linear else "quadratic"
    blocker = _blocker(kernel, query, normalization, **options)
    if not blocker and kernel == "fla" and not path.linear:
        blocker = _fla_quadratic_blocker(normalization, layout, softcap, query.dtype, forced, **options)
    elif not blocker and kernel == "fla":
        blocker = tf32_blocker("linear", query.dtype, forced)
    if blocker:
        if forced:
            raise ValueError(f"kernels({kind}={kernel!r}) forces {_NAMES[kernel]}, which cannot compute this "
                             f"call: {blocker}. Use kernels({kind}='auto') to let the PyTorch kernel compute the "
                             "calls it does not.")
        reasons.append(f"{_NAMES[kernel]} does not compute it: {blocker}")
        return None
    if not forced and not _importable(_MODULES[kernel]):
        reasons.append(f"{_NAMES[kernel]} is not installed (pip install 'hf_knorm[gpu]')")
        return None
    failure = verdict(kernel, query.device, query.dtype, normalization, query.shape[-1])
    if failure:
        what = (f"{_NAMES[kernel]} failed its self-check against the PyTorch kernel on {query.device} "
                f"({query.dtype}, {family_of(normalization)}, head dim {query.shape[-1]}): {failure}")
        if forced:
            raise RuntimeError(f"kernels({kind}={kernel!r}) forces {_NAMES[kernel]}, and {what}. Use "
                               f"kernels({kind}='pytorch'), or 'auto' (the PyTorch kernel, with a warning).")
        _warn_once(key_of(kernel, query.device, query.dtype, normalization, query.shape[-1]),
                   f"hf_knorm: {what}. The PyTorch kernel computes these calls (kernels({kind}='pytorch') "
                   "says so without this warning).")
        reasons.append(f"{_NAMES[kernel]} failed its self-check: {failure}")
        return None
    return _log(replace(path, kernel=kernel), "self-check passed")


def _blocker(kernel: str, query: torch.Tensor, normalization: Normalization, *, dropout: float,
             return_weights: bool, recording: bool, compiling: bool) -> str:
    """Why ``kernel`` cannot compute a call (``""`` when it can)."""
    device = _device_type(query)
    if device != "cuda":
        return f"it runs on CUDA tensors, and this call's are on {device}"
    if query.dtype not in _KERNEL_DTYPES:
        return f"it takes fp32, bf16 or fp16 inputs, not {query.dtype}"
    if compiling:
        return "the call is traced by torch.compile (compiled code runs the PyTorch kernels: compiled.py)"
    if recording:
        return "the attention norms are recorded (record_norms, NormLoggerCallback), which only the PyTorch kernels do"
    if kernel == "triton" and "triton" not in normalization.fast_paths:
        return (f"{normalization.name} (it computes the element-wise families only: x^p/c, relu(x)^p/c; "
                "Normalization.pointwise)")
    if kernel == "flex":
        if "flex" not in normalization.fast_paths:
            return (f"{normalization.name} (it computes a softmax over modified logits, a non-negative weight with "
                    "an element-wise logarithm or a ratio of two: Normalization.softmax_logits, "
                    "Normalization.log_weights, Normalization.log_weight_ratio)")
        missing = flex_available()
        if missing:
            return missing
    if kernel in ("triton", "flex"):
        if dropout:
            return "attention dropout"
        if return_weights:
            return "the attention weights were requested"
    return ""


def _fla_quadratic_blocker(normalization: Normalization, layout: CallLayout | None, softcap: float | None,
                           dtype: torch.dtype, forced: bool, *, dropout: float, return_weights: bool, **_) -> str:
    """Why fla's stick-breaking kernel cannot compute a quadratic call (``""`` when it can): the family's capability,
    the call's layout (:func:`.fla_stick_breaking.layout_blocker`), fp32 without TF32 asked for
    (:func:`tf32_blocker`)."""
    if "fla_stickbreaking" not in normalization.fast_paths:
        return (f"{normalization.name} (on the quadratic path it computes stick-breaking only: "
                "Normalization.stick_break)")
    if dropout:
        return "attention dropout"
    if return_weights:
        return "the attention weights were requested"
    return layout_blocker(layout, softcap) or tf32_blocker("quadratic", dtype, forced)


def tf32_blocker(kind: str, dtype: torch.dtype, forced: bool) -> str:
    """Why the automatic choice keeps an fp32 call off flash-linear-attention's kernels, on the ``kind`` path
    (``""`` when it does not): their products take TF32 on a GPU (Triton's default for fp32 operands), and fp32 inputs
    stay fp32 unless TF32 is asked for: ``torch.set_float32_matmul_precision("high")`` (or ``"medium"``), or the
    kernel forced with ``kernels(kind="fla")``. Elsewhere the PyTorch kernel computes them in fp32 (cuBLAS leaves
    TF32 off by default)."""
    if dtype == torch.float32 and not forced and torch.get_float32_matmul_precision() == "highest":
        return (f"fp32 inputs, and fla's products take TF32 on a GPU while fp32 matmuls are at 'highest' precision "
                f"(torch.set_float32_matmul_precision('high') or kernels({kind}='fla') asks for TF32)")
    return ""


def _warn_once(key: tuple, message: str) -> None:
    with _REPORTED_LOCK:
        if key in _REPORTED:
            return
        _REPORTED.add(key)
    warnings.warn(message, stacklevel=4)


def _log(path: Path, why: str) -> Path:
    """``path``, after saying at DEBUG level which kernel computes the call and why."""
    if logger.isEnabledFor(logging.DEBUG):
        where = "PyTorch" if path.kernel in ("", "sdpa") else "GPU"
        logger.debug("%s kernel (%s): %s", path.name, where, why)
    return path


def _device_type(tensor: torch.Tensor) -> str:
    """Where ``tensor`` is (a seam: the tests run the CUDA choices under Triton's interpreter on a CPU)."""
    return tensor.device.type


def run_quadratic(path: Path, query, key, value, allowed, normalization, **options):
    """The quadratic path's call: :func:`.kernel.chunked_attention`'s arguments and result ``(output, weights)``;
    for FlexAttention and fla (:data:`KEY_PADDING_KERNELS`) ``allowed`` may be key padding
    (:class:`~.masks.KeyPadding`, read without an ``N x N`` mask), the other kernels take the mask their caller made of
    it (:func:`.masks.kernel_mask`)."""
    if path.kernel == "sdpa":
        if options.get("softcap") is not None or options.get("dropout") or options.get("return_weights") \
                or options.get("frobenius_sq") is not None:
            raise ValueError("SDPA computes no softcap, dropout, returned weights or norms (with_kernel keeps such "
                             "calls on the PyTorch kernel).")
        keep = ("bias", "scaling", "causal", "params")
        return sdpa_attention(query, key, value, allowed, normalization,
                              **{name: options[name] for name in keep if name in options}), None
    if path.kernel == "flex":
        if options.get("dropout") or options.get("return_weights") or options.get("frobenius_sq") is not None:
            raise ValueError("FlexAttention computes no dropout, returned weights or norms (with_kernel keeps such "
                             "calls on the PyTorch kernel).")
        from .flex import flex_route_attention

        keep = ("bias", "scaling", "softcap", "causal", "params")
        return flex_route_attention(query, key, value, allowed, normalization,
                                    **{name: options[name] for name in keep if name in options}), None
    if path.kernel == "fla":
        if options.get("dropout") or options.get("return_weights") or options.get("frobenius_sq") is not None:
            raise ValueError("fla's stick-breaking kernel computes no dropout, returned weights or norms (with_kernel "
                             "keeps such calls on the PyTorch kernel).")
        from .fla_stick_breaking import fla_stick_breaking_attention

        keep = ("bias", "scaling", "softcap", "causal")
        return fla_stick_breaking_attention(query, key, value, allowed, normalization,
                                            **{name: options[name] for name in keep if name in options}), None
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
