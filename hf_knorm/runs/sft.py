"""``hf-knorm finetune``'s trainer: TRL's ``SFTTrainer`` with the held-out perplexity in its evaluations.

TRL (``trl.SFTTrainer``) is what the field fine-tunes with; the job hands it examples already tokenized
(:func:`hf_knorm.data.heldout.training_and_held_out`: text packed by TRL's own ``pack_dataset``, conversations and
prompt/completion pairs with their loss masks), so that ``finetune`` and ``convert`` train on the same examples, and
the held-out examples are built the same way before the model loads. They are the examples ``SFTTrainer`` would make
of the raw records itself (its tokenization, BOS and end-of-text included, and its masks: checked against its own
dataset preparation in ``tests/data/test_dataset_formats.py``); what TRL has no public function for stays in
:mod:`.dataset_formats`, which says what.
``SFTTrainer`` then collates them (padding each batch, ``-100`` labels on the padding) and truncates at
``max_length``. The loss is the model's own next-token loss on the labels, as ``Trainer.compute_loss`` computes it:
TRL 1.16's fused LM head (log-probabilities in tiles, with entropy and token accuracy for its logs) gives the same
loss but trained at 0.68x the plain loss's tokens per second on this 2-core CPU
(``scripts/training/bench_finetune_trl.py``, BENCHMARKS.md), so its ``entropy`` and ``mean_token_accuracy`` are not
logged.
"""

from __future__ import annotations

import dataclasses

import transformers
from trl import SFTConfig, SFTTrainer

from ..data.heldout import HeldOutEvaluation


class SFTPerplexityTrainer(HeldOutEvaluation, SFTTrainer):
    """``SFTTrainer`` whose evaluations are token-weighted and log ``eval_perplexity``
    (:class:`~.heldout.HeldOutEvaluation`), with the plain next-token loss (see the module docstring)."""

    def create_model_card(self, *args, **kwargs) -> None:
        """Nothing: the run folder's card is hf_knorm's, written with the model at the end of the job
        (``SFTTrainer`` writes its own ``README.md`` into the run folder at every checkpoint, which the final card
        would keep as text of the user's)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs["use_cache"] = False
        result = transformers.Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return self.token_weighted(model, inputs, result, return_outputs)


CHECKPOINTING = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                     if name in {field.name for field in dataclasses.fields(transformers.TrainingArguments)})
"""``TrainingArguments``' activation-checkpointing switch under the installed release's name: Transformers 5.2x renamed
``gradient_checkpointing`` to ``activation_checkpointing``, and the old name (TRL's configs default it to True) warns
(FutureWarning) unless the new one is set."""

TRAINING_ARGUMENTS_DEFAULTS = {"bf16": False, CHECKPOINTING: False}
"""Where TRL's configs default otherwise than ``TrainingArguments`` (bf16 on, activation checkpointing on): the
job's own settings decide (``--bf16``), as under the plain Trainer."""


def sft_config(max_length: int, **training_arguments) -> SFTConfig:
    """The ``SFTConfig`` of a job: ``TrainingArguments`` fields plus ``max_length`` (the examples' longest); the
    examples come tokenized, so none of TRL's own packing or completion masking applies."""
    return SFTConfig(max_length=max_length, packing=False, **{**TRAINING_ARGUMENTS_DEFAULTS, **training_arguments})
