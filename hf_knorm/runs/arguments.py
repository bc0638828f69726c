"""The ``TrainingArguments`` every training job shares, so that ``finetune`` and ``convert`` cannot drift apart."""

from __future__ import annotations

from pathlib import Path

from .precision import precision_arguments


def job_arguments(out: str | Path, *, steps: int, batch_size: int, learning_rate: float, warmup_steps: int,
                  logging_steps: int, save_steps: int, eval_steps: int, report_to, seed: int, bf16: bool,
                  fp16: bool = False, save_total_limit: int = 2, **extra) -> dict:
    """Keyword arguments of ``TrainingArguments`` (or TRL's configs) for a job's Trainer run.

    Held-out evaluation at the start and every ``eval_steps`` (the loss only: ``eval_loss``, and ``eval_perplexity``
    through :class:`~hf_knorm.data.heldout.HeldOutEvaluation`, token-weighted), checkpoints every
    ``save_steps`` (the last ``save_total_limit`` kept), the same seed for weights and data order, mixed precision by
    ``bf16`` or ``fp16`` (:func:`~hf_knorm.runs.precision.precision_arguments`), memory pinned only where there
    is a GPU.
    ``extra`` adds or overrides fields (``lr_scheduler_type``, ``max_grad_norm``, ...).
    """
    import torch

    arguments = dict(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=min(warmup_steps, steps),
        logging_steps=logging_steps,
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        eval_strategy="steps",
        eval_steps=eval_steps,
        eval_on_start=True,
        prediction_loss_only=True,
        report_to=list(report_to) or "none",
        seed=seed,
        data_seed=seed,
        dataloader_pin_memory=torch.cuda.is_available(),
        **precision_arguments(bf16, fp16),
    )
    arguments.update(extra)
    return arguments
