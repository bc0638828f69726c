"""Triton's interpreter taught to multiply bf16 tiles, so that the CPU runs the bf16 operands a GPU runs, for the
package's own kernels only.

Under ``TRITON_INTERPRET=1`` (how the tests and the kernels' self-check run the Triton kernels on a CPU), Triton 3.9.0
stores a bf16 tile as ``uint16`` bit patterns, and its ``InterpreterBuilder.create_dot`` hands those raw bits to
``np.matmul`` (it converts fp8 operands first, not bf16 ones): a bf16 ``tl.dot`` returns garbage there (errors of
~1e10 on a 16 x 16 product). :func:`teach_bf16_dot` converts bf16 operands to fp32 before the product. That is what a
GPU's bf16 ``tl.dot`` computes: the product of two bf16 numbers is exact in fp32, and the sum accumulates in fp32.
So ``triton_kernel.py`` runs the same code on both: bf16 operands (``w`` and ``dS`` split in two bf16 tiles before
their products) in every case.

Scope: the interpreter has one ``InterpreterBuilder`` for the process, so the product is taught where the package's
kernels launch and nowhere else. Each kernel handed to :func:`teach_bf16_dot` launches inside :func:`bf16_dot`,
which puts the converting ``create_dot`` on the class for the launch and Triton's own back after it (nested and
concurrent launches share one installation, counted); the converting method converts only in a thread or context
that is running one of those launches, so another interpreted kernel (another library's, a test's), even one running
in another thread meanwhile, multiplies as Triton does. A compiled kernel (a GPU, no ``TRITON_INTERPRET``) is never
wrapped. Test: ``tests/attention/test_triton_kernel.py`` (``test_the_bf16_product_is_taught_to_the_package_kernels_
only``).

One difference remains, and it only makes the interpreter's results slightly worse than a GPU's: the interpreter's
``fp32 -> bf16`` cast truncates (``_convert_float`` with no rounding mode), where a GPU rounds to nearest even; the
tolerances of the tests and of the self-check (``self_check.py``) hold for both.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

import numpy as np

_TAUGHT = "_hf_knorm_bf16_dot"
_launching = contextvars.ContextVar("hf_knorm_interpreted_launch", default=False)
"""Whether the running code is inside a launch of one of the package's interpreted kernels."""
_lock = threading.Lock()
_installed = {"count": 0, "previous": None}
"""The launches in progress in the process, and the ``create_dot`` the first of them replaced."""


def teach_bf16_dot(*kernels) -> None:
    """Make each interpreted ``kernel`` (a ``triton.jit`` function under ``TRITON_INTERPRET=1``) launch inside
    :func:`bf16_dot`, where bf16 operands reach ``np.matmul`` as fp32 values (idempotent per kernel).

    Only the launches of these kernels change; ``InterpreterBuilder`` keeps Triton's ``create_dot`` outside them.

    Raises:
        RuntimeError: the interpreter no longer has the method this wraps (a Triton whose interpreter this module does
            not know), or a kernel is not interpreted.
    """
    from triton.runtime import interpreter

    if getattr(interpreter.InterpreterBuilder, "create_dot", None) is None:
        raise RuntimeError("Triton's interpreter has no InterpreterBuilder.create_dot: hf_knorm cannot teach it bf16 "
                           "products (hf_knorm/attention/triton_interpreter.py knows Triton 3.9's interpreter).")
    for kernel in kernels:
        if not isinstance(kernel, interpreter.InterpretedFunction):
            raise RuntimeError(f"{kernel!r} is not an interpreted Triton kernel; only those need the bf16 product.")
        if getattr(kernel.run, _TAUGHT, False):
            continue
        run = kernel.run  # bound to the kernel: kernel[grid](...) calls kernel.run, found on the instance first

        @functools.wraps(run)
        def taught_run(*args, _run=run, **kwargs):
            with bf16_dot():
                return _run(*args, **kwargs)

        setattr(taught_run, _TAUGHT, True)
        kernel.run = taught_run


@contextlib.contextmanager
def bf16_dot():
    """While the block runs, the interpreter's ``tl.dot`` multiplies bf16 operands as fp32 values, in this thread and
    context only; Triton's own ``create_dot`` is back on the class when the last such block in the process ends."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    with _lock:
        if _installed["count"] == 0:
            _installed["previous"] = builder.create_dot
            builder.create_dot = _converting(builder.create_dot)
        _installed["count"] += 1
    token = _launching.set(True)
    try:
        yield
    finally:
        _launching.reset(token)
        with _lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                if getattr(builder.create_dot, _TAUGHT, False):  # unless someone replaced it meanwhile: theirs stays
                    builder.create_dot = _installed["previous"]
                _installed["previous"] = None


def _converting(original):
    """``create_dot`` that converts bf16 operands to fp32 inside the package's launches, then calls ``original``."""

    @functools.wraps(original)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if _launching.get():
            a, b = _as_fp32(a), _as_fp32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _TAUGHT, True)
    return create_dot


def _as_fp32(handle):
    """A bf16 interpreter tile (``uint16`` bits) as the fp32 tile of the same values; any other tile unchanged."""
    from triton import language as tl
    from triton.runtime import interpreter

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)  # bf16 is the top half of an fp32
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
