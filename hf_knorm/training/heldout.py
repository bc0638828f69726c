"""Held-out evaluation for every training job: texts no step trains on, perplexity through the Trainer's evaluation.

A patched pretrained model is a new model (DESIGN.md, "Conversion"): ``hf-knorm finetune`` and ``hf-knorm convert``
both report held-out perplexity at the start and every ``eval_steps``, through the Trainer's own evaluation
(``eval_dataset``; ``eval_loss`` and ``eval_perplexity`` in the log stream, hence TensorBoard/W&B and
``state.log_history``).

Which texts are held out (:func:`split_held_out`), by whole texts so that no block of the evaluation shares a text
with training:

- an explicit evaluation source (``eval_dataset``, same forms as the training dataset) wins, and all the training
  texts are trained on;
- the embedded corpora hold out fixed texts: ``paul-graham`` the essays 40-48 (of 49, sorted by file name),
  ``shakespeare`` Hamlet and the sonnets;
- any other dataset holds out its last ``eval_fraction`` of texts (at least one).

The held-out texts are packed exactly like the training texts (blocks of ``block_size`` tokens, the end-of-text token
between texts) and the first ``eval_tokens // block_size`` blocks are kept: every block is one forward pass, every
token but the first of a block is scored, as :func:`hf_knorm.evaluation.perplexity.perplexity` scores windows. The
evaluation is never shortened to fit: a held-out text shorter than ``eval_tokens`` is an error.
"""

from __future__ import annotations

import math

import transformers

from ..evaluation.domains import DOMAINS, PAUL_GRAHAM_TRAIN_ESSAYS
from .text_data import pack_dataset


def split_held_out(dataset, source: str, text_column: str = "text", eval_dataset=None, eval_fraction: float = 0.1):
    """Split the texts into ``(train, held_out, description)``: two ``datasets.Dataset`` and one sentence.

    Args:
        dataset: the training source loaded as a ``datasets.Dataset`` (``load_text_dataset``).
        source: its name as the user gave it (embedded corpora hold out fixed texts, see the module docstring).
        text_column: the column holding the text.
        eval_dataset: an evaluation source loaded as a ``datasets.Dataset``, or ``None`` to hold out training texts.
        eval_fraction: the share of texts held out of any other dataset, in (0, 1).

    Raises:
        ValueError: a fraction outside (0, 1), or a single text that cannot be split (pass an evaluation source).
    """
    if eval_dataset is not None:
        return dataset, eval_dataset, "the evaluation dataset given"
    if source == "paul-graham":
        count = PAUL_GRAHAM_TRAIN_ESSAYS
        return (dataset.select(range(count)), dataset.select(range(count, len(dataset))),
                f"Paul Graham essays {count}-{len(dataset) - 1} (not trained on)")
    if source == "shakespeare":
        import datasets

        from ..assets.texts import shakespeare_split

        return dataset, datasets.Dataset.from_dict({text_column: shakespeare_split()[1]}), \
            "Hamlet and the sonnets (not trained on)"
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), not {eval_fraction}.")
    if len(dataset) < 2:
        raise ValueError(f"{source} holds a single text, which cannot be split into training and held-out texts: "
                         "pass an evaluation text with --eval-dataset.")
    held = min(len(dataset) - 1, max(1, round(len(dataset) * eval_fraction)))
    first = len(dataset) - held
    return (dataset.select(range(first)), dataset.select(range(first, len(dataset))),
            f"the last {held} of {len(dataset)} texts of {source} (not trained on)")


def held_out_blocks(texts, tokenizer, block_size: int, eval_tokens: int, text_column: str = "text"):
    """The evaluation blocks: the held-out texts packed into ``eval_tokens // block_size`` blocks of ``block_size``.

    Raises:
        ValueError: ``eval_tokens`` below one block, or held-out texts shorter than ``eval_tokens``.
    """
    wanted = eval_tokens // block_size
    if wanted < 1:
        raise ValueError(f"eval_tokens ({eval_tokens}) must hold at least one block of {block_size} tokens.")
    try:
        blocks = pack_dataset(texts, tokenizer, block_size, text_column)
    except ValueError as error:
        raise ValueError(f"The held-out text is too short for the evaluation: {error}") from None
    if len(blocks) < wanted:
        raise ValueError(
            f"The held-out text makes {len(blocks)} blocks of {block_size} tokens, fewer than the {wanted} that "
            f"eval_tokens={eval_tokens} asks for. Pass a longer evaluation text (--eval-dataset) or lower --eval-tokens; "
            "the evaluation is never shortened silently."
        )
    return blocks.select(range(wanted))


def training_and_held_out(source: str, tokenizer, block_size: int, eval_tokens: int, text_column: str = "text",
                          split: str = "train", eval_source: str | None = None, eval_fraction: float = 0.1,
                          max_blocks: int | None = None):
    """Load, split and pack a job's texts: ``(training texts, training blocks, held-out blocks, description)``.

    Raises:
        ValueError, FileNotFoundError: as :func:`~hf_knorm.training.text_data.load_text_dataset`,
            :func:`split_held_out` and :func:`held_out_blocks` do.
    """
    from .text_data import load_text_dataset

    texts = load_text_dataset(source, text_column, split)
    evaluation = load_text_dataset(eval_source, text_column, split) if eval_source is not None else None
    train_texts, held_texts, description = split_held_out(texts, source, text_column, evaluation, eval_fraction)
    blocks = held_out_blocks(held_texts, tokenizer, block_size, eval_tokens, text_column)
    train = pack_dataset(train_texts, tokenizer, block_size, text_column, max_blocks)
    return train_texts, train, blocks, description


def held_out_perplexity(model, blocks, desc: str = "held-out perplexity") -> float:
    """The perplexity of ``model`` on the held-out blocks (:func:`~hf_knorm.evaluation.perplexity.perplexity_of_windows`,
    one block a window: what the Trainer's ``eval_perplexity`` measures on them)."""
    import torch

    from ..evaluation.perplexity import perplexity_of_windows

    was_training = model.training
    model.eval()
    try:
        return perplexity_of_windows(model, [torch.tensor(ids) for ids in blocks["input_ids"]], desc=desc).perplexity
    finally:
        model.train(was_training)


def perplexity_curve(log_history: list[dict], tokens_per_step: int, key: str = "eval_perplexity") -> list[list[float]]:
    """``[step, training tokens, held-out perplexity]`` of every evaluation in a Trainer's ``log_history``
    (``key``: ``eval_<name>_perplexity`` for the evaluation set ``name`` of a dict of them), one per step: a resumed
    run evaluates its first step again (``eval_on_start``), and the later value is kept."""
    by_step = {entry["step"]: entry[key] for entry in log_history if key in entry}
    return [[step, step * tokens_per_step, value] for step, value in sorted(by_step.items())]


def held_out_domain_blocks(names, tokenizer, block_size: int, eval_tokens: int) -> dict:
    """The evaluation blocks of the held-out domains ``names`` (:mod:`hf_knorm.evaluation.domains`), by name: each
    domain's texts packed like :func:`held_out_blocks` packs them, its first ``eval_tokens // block_size``.

    Raises:
        ValueError: an unknown domain.
    """
    import datasets

    from ..evaluation.domains import domain

    chosen = [domain(name) for name in names]
    return {d.name: held_out_blocks(datasets.Dataset.from_dict({"text": d.texts()}), tokenizer, block_size,
                                    eval_tokens) for d in chosen}


def domains_record(blocks: dict, block_size: int, original: dict[str, float], final: dict[str, float],
                   descriptions: dict[str, str] | None = None) -> dict:
    """The ``evaluation`` entry of a job evaluated on several held-out sets (the card's table).

    The top-level figures are the **worst** set's (highest ratio to the original model): the headline is never the
    best domain. ``domains`` holds every set's record (:func:`evaluation_record`), in the order of ``blocks``;
    ``descriptions`` names the sets that are not held-out domains.
    """
    descriptions = {**{d.name: f"{d.description}; licence: {d.licence}" for d in DOMAINS}, **(descriptions or {})}
    records = {name: evaluation_record(descriptions.get(name, name), blocks[name], block_size, original[name],
                                       final[name]) for name in blocks}
    worst = max(records, key=lambda name: records[name]["ratio_to_original"])
    return dict(records[worst], text=f"the worst of {len(records)} held-out domains: {worst}, "
                                     f"{records[worst]['text']}", worst_domain=worst, domains=records)


def evaluation_record(description: str, blocks, block_size: int, original: float, final: float) -> dict:
    """The ``evaluation`` entry of a job's summary (and of the model card)."""
    return {"text": description, "tokens": len(blocks) * block_size, "block_size": block_size,
            "original_perplexity": original, "perplexity": final, "ratio_to_original": final / original}


def perplexity_of(loss: float) -> float:
    """``exp(loss)``; ``inf`` past the float range, NaN for a NaN loss."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf


class PerplexityTrainer(transformers.Trainer):
    """A ``Trainer`` whose evaluations also log ``eval_perplexity = exp(eval_loss)`` (``eval_<name>_perplexity`` for
    each set of a dict of evaluation datasets).

    ``Trainer.log`` is the public seam for metrics computed outside the training loop (TRL's trainers override it the
    same way): the value is added before the Trainer appends the entry to ``state.log_history`` and before any
    ``report_to`` integration or callback sees it.
    """

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        for key in [key for key in logs if key.startswith("eval_") and key.endswith("_loss")]:
            logs[key.removesuffix("loss") + "perplexity"] = perplexity_of(float(logs[key]))
        super().log(logs, *args, **kwargs)
