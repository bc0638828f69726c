"""Mixed precision for the training jobs (``--bf16`` of ``hf-knorm finetune`` and ``hf-knorm convert``)."""

from __future__ import annotations


def precision_arguments(bf16: bool) -> dict:
    """``TrainingArguments`` keywords for ``--bf16``: ``bf16=True`` autocasts the forward passes (weights and
    optimizer stay fp32); on a machine without an accelerator the Trainer also needs ``use_cpu=True`` to accept it."""
    if not bf16:
        return {}
    import torch

    accelerator = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    return {"bf16": True, "use_cpu": not accelerator}
