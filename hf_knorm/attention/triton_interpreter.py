"""Triton's interpreter taught to multiply bf16 tiles, so that the CPU runs the bf16 operands a GPU runs.

Under ``TRITON_INTERPRET=1`` (how the tests and the kernels' self-check run the Triton kernels on a CPU), Triton 3.9.0
stores a bf16 tile as ``uint16`` bit patterns, and its ``InterpreterBuilder.create_dot`` hands those raw bits to
``np.matmul`` (it converts fp8 operands first, not bf16 ones): a bf16 ``tl.dot`` returns garbage there (errors of
~1e10 on a 16 x 16 product). :func:`teach_bf16_dot` converts bf16 operands to fp32 before the product. That is what a
GPU's bf16 ``tl.dot`` computes: the product of two bf16 numbers is exact in fp32, and the sum accumulates in fp32.
So ``triton_kernel.py`` runs the same code on both: bf16 operands (``w`` and ``dS`` rounded to bf16 before their
products) in every case.

One difference remains, and it only makes the interpreter's results slightly worse than a GPU's: the interpreter's
``fp32 -> bf16`` cast truncates (``_convert_float`` with no rounding mode), where a GPU rounds to nearest even; the
tolerances of the tests and of the self-check (``self_check.py``) hold for both.
"""

from __future__ import annotations

import numpy as np

_TAUGHT = "_hf_knorm_bf16_dot"


def teach_bf16_dot() -> None:
    """Wrap the interpreter's ``create_dot`` so that bf16 operands reach ``np.matmul`` as fp32 values (idempotent).

    The wrapper hands the original fp32 handles, whatever a later Triton does with bf16 itself; it raises if the
    interpreter no longer has the method it wraps (a Triton whose interpreter this module does not know).
    """
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = getattr(builder, "create_dot", None)
    if original is None:
        raise RuntimeError("Triton's interpreter has no InterpreterBuilder.create_dot: hf_knorm cannot teach it bf16 "
                           "products (hf_knorm/attention/triton_interpreter.py knows Triton 3.9's interpreter).")
    if getattr(original, _TAUGHT, False):
        return

    def as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)  # bf16 is the top half of an fp32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _TAUGHT, True)
    builder.create_dot = create_dot
