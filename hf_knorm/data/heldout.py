"""Held-out evaluation for every training job: texts no step trains on, perplexity through the Trainer's evaluation.

A patched pretrained model is a new model (docs/usage.md, "Conversion"): ``hf-knorm finetune`` and ``hf-knorm convert``
both report held-out perplexity at the start and every ``eval_steps``, through the Trainer's own evaluation
(``eval_dataset``; ``eval_loss`` and ``eval_perplexity`` in the log stream, hence TensorBoard/W&B and
``state.log_history``).

Which texts are held out (:func:`split_held_out`), by whole texts so that no block of the evaluation shares a text
with training:

- an explicit evaluation source (``eval_dataset``, same forms as the training dataset) wins, and all the training
  texts are trained on;
- the embedded corpora hold out fixed texts: ``paul-graham`` the essays 40-48 (of 49, sorted by file name),
  ``shakespeare`` Hamlet and the sonnets, ``chatterbot`` every tenth conversation (9, 19, ...);
- any other dataset holds out its last ``eval_fraction`` of texts (at least one).

The held-out texts are packed exactly like the training texts (blocks of ``block_size`` tokens, the end-of-text token
between texts) and the first ``eval_tokens // block_size`` blocks are kept: every block is one forward pass, every
token but the first of a block is scored, as :func:`hf_knorm.evaluation.perplexity.perplexity` scores windows. The
evaluation is never shortened to fit: a held-out text shorter than ``eval_tokens`` is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    if source == "chatterbot":  # every tenth conversation: held-out questions from every topic file
        held = [index for index in range(len(dataset)) if index % 10 == 9]
        return (dataset.select([index for index in range(len(dataset)) if index % 10 != 9]), dataset.select(held),
                f"chatterbot conversations 9, 19, 29, ... ({len(held)} of {len(dataset)}, not trained on)")
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


@dataclass
class TrainingData:
    """A job's data, ready for the Trainer.

    Attributes:
        records: the training records as loaded (texts, conversations or prompt/completion pairs).
        train: the training examples (``input_ids``, ``labels``): blocks of text, or one example per record.
        held_out: the held-out examples, built the same way.
        description: which records are held out, in one sentence.
        format: the dataset format (:mod:`.dataset_formats`) and where the loss falls.
    """

    records: object
    train: object
    held_out: object
    description: str
    format: dict


def training_and_held_out(source: str, tokenizer, block_size: int, eval_tokens: int, text_column: str = "text",
                          split: str = "train", eval_source: str | None = None, eval_fraction: float = 0.1,
                          max_blocks: int | None = None, train_on_prompt: bool = False) -> TrainingData:
    """Load, check, split and tokenize a job's data in any of the three formats (:mod:`.dataset_formats`).

    Text is packed into blocks (:func:`held_out_blocks`: exactly ``eval_tokens // block_size`` held-out blocks).
    Conversations and prompt/completion pairs are one example per record, cut at ``block_size`` tokens, the loss on
    the replies unless ``train_on_prompt``; the held-out examples are the first held-out records that together carry
    ``eval_tokens`` loss tokens (all of them when they carry fewer: the record states the tokens scored).

    Raises:
        ValueError, FileNotFoundError: as :func:`~hf_knorm.data.text_data.load_records`,
            :func:`~hf_knorm.data.dataset_formats.detect_format`, ``check_records``, :func:`split_held_out`
            and :func:`held_out_blocks` do; an evaluation dataset of another format than the training data's.
    """
    from .dataset_formats import (LANGUAGE_MODELING, check_records, detect_format, format_description,
                                  tokenize_with_loss_mask)
    from .text_data import EMBEDDED, check_text_column, load_records

    records = load_records(source, split)
    text_column = "text" if source in EMBEDDED else text_column
    data_format = detect_format(records.column_names, text_column)
    evaluation = load_records(eval_source, split) if eval_source is not None else None
    if evaluation is not None and detect_format(evaluation.column_names, text_column) != data_format:
        raise ValueError(f"--eval-dataset {eval_source} is not in the training data's format ({data_format}): "
                         f"its columns are {', '.join(evaluation.column_names)}.")
    for dataset, name in ((records, source), (evaluation, eval_source)):
        if dataset is None:
            continue
        if data_format == LANGUAGE_MODELING:
            check_text_column(dataset, name, text_column)
        else:
            check_records(dataset, data_format, tokenizer)
    train_records, held_records, description = split_held_out(records, source, text_column, evaluation, eval_fraction)
    if data_format == LANGUAGE_MODELING:
        held_out = held_out_blocks(held_records, tokenizer, block_size, eval_tokens, text_column)
        train = pack_dataset(train_records, tokenizer, block_size, text_column, max_blocks)
    else:
        held_out = _first_loss_tokens(
            tokenize_with_loss_mask(held_records, data_format, tokenizer, block_size, train_on_prompt), eval_tokens)
        train = tokenize_with_loss_mask(train_records, data_format, tokenizer, block_size, train_on_prompt)
        if max_blocks is not None and len(train) > max_blocks:
            train = train.select(range(max_blocks))
    return TrainingData(train_records, train, held_out, description,
                        format_description(data_format, train_on_prompt))


def _first_loss_tokens(examples, tokens: int):
    """The first examples that together carry ``tokens`` loss tokens (each example's first label is never scored)."""
    total = 0
    for index, labels in enumerate(examples["labels"]):
        total += sum(label != -100 for label in labels[1:])
        if total >= tokens:
            return examples.select(range(index + 1))
    return examples


def is_packed(examples, block_size: int) -> bool:
    """Whether ``examples`` are text blocks: every one ``block_size`` tokens, every token a label."""
    return all(len(ids) == block_size for ids in examples["input_ids"]) and examples["input_ids"] == examples["labels"]


def mean_example_tokens(examples) -> float:
    """The mean length of ``examples`` (blocks: the block size; one example per record: its mean tokens)."""
    return sum(map(len, examples["input_ids"])) / len(examples)


def loss_tokens(examples) -> int:
    """The tokens the held-out evaluation scores in ``examples``: every label but each example's first, not -100."""
    return sum(sum(label != -100 for label in labels[1:]) for labels in examples["labels"])


def held_out_perplexity(model, blocks, desc: str = "held-out perplexity") -> float:
    """The perplexity of ``model`` on the held-out examples
    (:func:`~hf_knorm.evaluation.perplexity.perplexity_of_windows`, one example a window, scored where its ``labels``
    are not -100): what the Trainer's token-weighted ``eval_perplexity`` measures on them."""
    import torch

    from ..evaluation.perplexity import perplexity_of_windows

    was_training = model.training
    model.eval()
    try:
        return perplexity_of_windows(model, [torch.tensor(ids) for ids in blocks["input_ids"]], desc=desc,
                                     labels=[torch.tensor(labels) for labels in blocks["labels"]]).perplexity
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
    """The ``evaluation`` entry of a job's summary (and of the model card); ``tokens``: the held-out tokens (text
    blocks: every token of every block; one example per record: the tokens scored, those carrying the loss)."""
    tokens = len(blocks) * block_size if is_packed(blocks, block_size) else loss_tokens(blocks)
    return {"text": description, "tokens": tokens, "block_size": block_size,
            "original_perplexity": original, "perplexity": final, "ratio_to_original": final / original}


def perplexity_of(loss: float) -> float:
    """``exp(loss)``; ``inf`` past the float range, NaN for a NaN loss."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf


class HeldOutEvaluation:
    """Mixed into a ``Trainer`` (before it): its evaluations are token-weighted and also log
    ``eval_perplexity = exp(eval_loss)`` (``eval_<name>_perplexity`` for each set of a dict of evaluation datasets).

    The Trainer's ``eval_loss`` is the mean over examples of their batch's mean loss: on examples of several lengths
    (one per conversation) a short reply would weigh as much as a long one. Here each batch's loss is rescaled so that
    the Trainer's mean is the mean over every scored token of the set (``labels`` not -100 after the shift), exactly
    what :func:`held_out_perplexity` computes; on text blocks (equal lengths) the scale is 1.

    ``Trainer.log`` is the public seam for metrics computed outside the training loop (TRL's trainers override it the
    same way): the perplexity is added before the Trainer appends the entry to ``state.log_history`` and before any
    ``report_to`` integration or callback sees it.
    """

    _examples_per_token: float | None = None  # of the evaluation set being evaluated

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):  # the Trainer evaluating one set of its dict by name
            dataset = self.eval_dataset[dataset]
        if dataset is None or isinstance(dataset, dict):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        self._examples_per_token = len(dataset) / max(loss_tokens(dataset), 1)
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._examples_per_token = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.token_weighted(model, inputs, result, return_outputs)

    def token_weighted(self, model, inputs, result, return_outputs: bool):
        """``result`` of ``compute_loss`` with an evaluation batch's mean loss rescaled by its scored tokens (see the
        class docstring); training losses pass unchanged."""
        if model.training or self._examples_per_token is None:
            return result
        loss = result[0] if return_outputs else result
        labels = inputs["labels"]
        scale = (labels[:, 1:] != -100).sum() * self._examples_per_token / labels.shape[0]
        loss = loss * scale
        return (loss, result[1]) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        for key in [key for key in logs if key.startswith("eval_") and key.endswith("_loss")]:
            logs[key.removesuffix("loss") + "perplexity"] = perplexity_of(float(logs[key]))
        super().log(logs, *args, **kwargs)


class PerplexityTrainer(HeldOutEvaluation, transformers.Trainer):
    """A ``Trainer`` whose evaluations are token-weighted and log the held-out perplexity
    (:class:`HeldOutEvaluation`)."""
