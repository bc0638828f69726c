"""Devices and mixed precision for the training jobs (``--bf16`` of ``hf-knorm finetune`` and ``hf-knorm convert``)."""

from __future__ import annotations


def has_accelerator() -> bool:
    """Whether the Trainer would train on an accelerator here (CUDA, XPU or Apple's MPS)."""
    import torch

    return bool(torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
                or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()))


def precision_arguments(bf16: bool) -> dict:
    """``TrainingArguments`` keywords for the device and ``--bf16``.

    ``use_cpu`` is set wherever there is no accelerator: without it, processes started by ``torchrun`` or
    ``accelerate launch`` on a CPU-only machine do not join one process group (Transformers sets up gloo only for
    ``use_cpu``), each trains alone on all the data, and each writes the run folder (found by
    ``tests/training/test_finetune_processes.py``). ``bf16=True`` autocasts the forward passes (weights and optimizer
    stay fp32), which on the CPU also needs ``use_cpu``.
    """
    return {"bf16": bool(bf16), "use_cpu": not has_accelerator()}
