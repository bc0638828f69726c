"""``hf-knorm finetune``'s trainer: TRL's ``SFTTrainer`` with the held-out perplexity in its evaluations.

TRL (``trl.SFTTrainer``) is what the field fine-tunes with; the job hands it examples already tokenized
(:func:`hf_knorm.training.heldout.training_and_held_out`: text packed by TRL's own ``pack_dataset``, conversations and
prompt/completion pairs with their loss masks), so that ``finetune`` and ``convert`` train on the same examples.
``SFTTrainer`` then collates them (padding each batch, ``-100`` labels on the padding), truncates at ``max_length``
and computes the next-token loss on the labels, logging its token accuracy and entropy beside the loss.
"""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from .heldout import PerplexityLogging


class SFTPerplexityTrainer(PerplexityLogging, SFTTrainer):
    """``SFTTrainer`` whose evaluations also log ``eval_perplexity`` (:class:`~.heldout.PerplexityLogging`)."""


TRAINING_ARGUMENTS_DEFAULTS = {"bf16": False, "gradient_checkpointing": False}
"""Where TRL's configs default otherwise than ``TrainingArguments`` (bf16 on, activation checkpointing on): the
job's own settings decide (``--bf16``), as under the plain Trainer."""


def sft_config(max_length: int, **training_arguments) -> SFTConfig:
    """The ``SFTConfig`` of a job: ``TrainingArguments`` fields plus ``max_length`` (the examples' longest); the
    examples come tokenized, so none of TRL's own packing or completion masking applies."""
    return SFTConfig(max_length=max_length, packing=False, **{**TRAINING_ARGUMENTS_DEFAULTS, **training_arguments})
