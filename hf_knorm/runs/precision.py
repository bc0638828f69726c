"""Devices and mixed precision for the training jobs (``--bf16`` and ``--fp16`` of ``hf-knorm finetune`` and
``hf-knorm convert``)."""

from __future__ import annotations

BF16_HELP = "mixed precision in bf16 (autocast; the attention kernel normalizes in fp32)"
FP16_HELP = "mixed precision in fp16, on an accelerator only (prefer --bf16: a row of x^p/c can pass 65,504)"
"""The help of ``--bf16`` and ``--fp16``, the same in every job's settings."""


def weights_dtype():
    """The dtype a training job loads the model's weights in, whatever dtype its checkpoint was saved in: fp32.

    Mixed precision (``--bf16``, ``--fp16``) is autocast over fp32 weights and optimizer state. Transformers 5 loads a
    checkpoint in its saved dtype unless told otherwise (``dtype="auto"``), which would train a bf16 checkpoint's
    weights, and keep its optimizer's state, in bf16.
    """
    import torch

    return torch.float32


def has_accelerator() -> bool:
    """Whether the Trainer would train on an accelerator here (CUDA, XPU or Apple's MPS)."""
    import torch

    return bool(torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
                or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()))


def check_precision(bf16: bool, fp16: bool) -> None:
    """Refuse a mixed precision this machine cannot run as asked, before any model loads.

    fp16 mixed precision is an accelerator's (fp16 matrix units, the Trainer's loss scaler): the CPU's is ``--bf16``,
    which keeps fp32's range and needs no loss scaling. fp16 also caps the attention's
    outputs: the kernel computes in fp32 and returns the query's dtype, so an unnormalized ``x^p/c`` row summing past
    65,504 becomes inf (the loss scaler then skips the step); bf16 has fp32's range.

    Raises:
        ValueError: both asked for, or ``fp16`` on a machine without an accelerator.
    """
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 are two mixed precisions: choose one (bf16 where the device has it).")
    if fp16 and not has_accelerator():
        raise ValueError("--fp16 needs an accelerator (CUDA, XPU or MPS) and none is visible here. On the CPU use "
                         "--bf16 (autocast in bf16, fp32's range) or neither (fp32).")


def precision_arguments(bf16: bool, fp16: bool = False) -> dict:
    """``TrainingArguments`` keywords for the device, ``--bf16`` and ``--fp16`` (checked by :func:`check_precision`).

    ``use_cpu`` is set wherever there is no accelerator: without it, processes started by ``torchrun`` or
    ``accelerate launch`` on a CPU-only machine do not join one process group (Transformers sets up gloo only for
    ``use_cpu``), each trains alone on all the data, and each writes the run folder (found by
    ``tests/jobs/test_finetune_processes.py``). ``bf16=True`` autocasts the forward passes (weights and optimizer
    stay fp32), which on the CPU also needs ``use_cpu``; ``fp16=True`` autocasts in fp16 with the Trainer's loss
    scaler.
    """
    return {"bf16": bool(bf16), "fp16": bool(fp16), "use_cpu": not has_accelerator()}


def run_precision(device, bf16: bool, fp16: bool = False):
    """The precision the Trainer trains and evaluates in (``bf16``/``fp16``: autocast, weights in fp32), as a context
    for what a job computes outside the Trainer on ``device``: the original model's held-out perplexity, its samples,
    the probe. Without it a ``--bf16`` run would divide its bf16 evaluations by an fp32 baseline."""
    import contextlib

    import torch

    if not (bf16 or fp16):
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16 if bf16 else torch.float16)
