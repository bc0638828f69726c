"""The three dataset formats of supervised fine-tuning, as TRL names them, detected from the columns.

- **language modelling**: a text column (``text``, or ``--text-column``); every token carries the loss; packed into
  blocks (:func:`hf_knorm.data.text_data.pack_dataset`).
- **conversational**: a ``messages`` column of ``{"role", "content"}`` turns, rendered with the tokenizer's chat
  template; the loss falls on the assistant turns (their content and the template's end-of-turn tokens, so the model
  learns to stop).
- **prompt/completion**: ``prompt`` and ``completion`` columns, each plain text or a list of turns (then the prompt
  is rendered with the chat template's generation prompt and the completion as the assistant's reply); the loss
  falls on the completion.

``train_on_prompt=True`` puts the loss on every token of the last two (TRL's ``completion_only_loss=False``). They
are never packed: each record is one example from position 0, padded in its batch (packing several conversations
into one row would let a reply attend to another conversation: sound only with document-aware attention, which the
plugin's normalizations do not have).

Tokenization (:func:`tokenize_with_loss_mask`): the text of a prompt/completion record is tokenized as TRL's
``SFTTrainer`` tokenizes it (plain text with the tokenizer's special tokens, so ``<bos>`` leads where the tokenizer
adds one, and the end-of-text token at the end of a plain completion; a rendered conversation without them, its
template writes its own; the completion starts where the tokenized prompt and prompt + completion diverge, TRL's
``common_prefix_length``). TRL finds the assistant turns of a conversation only in chat templates with
``{% generation %}`` markers, and patches only the templates it knows: a template with the markers gives its mask as
TRL takes it; SmolLM2's has none (TRL's ``get_training_chat_template`` refuses it), so for such templates the turns
are found here, for any template that renders a conversation's beginning as a prefix of the whole: assistant turn
``i`` spans the tokens between the rendering of the turns before it with the generation prompt and the rendering of
the turns up to it.

What is TRL's and what is this project's: the text is tokenized as ``SFTTrainer`` tokenizes it (checked against its
own dataset preparation in ``tests/data/test_dataset_formats.py``), with TRL's public ``common_prefix_length``
and ``pack_dataset`` (:mod:`.text_data`); ``SFTTrainer`` trains the examples under ``finetune``. Kept here, because
TRL has no public function for them: the per-record tokenization itself (TRL's is inside ``SFTTrainer``, and
``convert`` trains the same examples with its own Trainers), the assistant turns of templates without
``{% generation %}``, the checks that name a bad record, and dropping examples left without a loss token.

Every check runs on the records before a model is loaded (:func:`check_records`): columns that fit no format (the
columns found and the formats expected are named), an unknown role, a conversation without an assistant turn, a
prompt or completion missing or empty, a conversational dataset and a tokenizer without a chat template, and no
example left once the examples without a loss token are dropped.
"""

from __future__ import annotations

import re

LANGUAGE_MODELING = "language_modeling"
CONVERSATIONAL = "conversational"
PROMPT_COMPLETION = "prompt_completion"
FORMATS = (LANGUAGE_MODELING, CONVERSATIONAL, PROMPT_COMPLETION)

ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = {LANGUAGE_MODELING: "every token", CONVERSATIONAL: "the assistant turns",
           PROMPT_COMPLETION: "the completions"}


def detect_format(column_names, text_column: str = "text") -> str:
    """The format whose columns ``column_names`` hold: conversational (``messages``), prompt/completion (``prompt``
    and ``completion``), language modelling (``text_column``), in that order.

    Raises:
        ValueError: none fits (the columns found and each format's columns are named), or a preference dataset
            (``chosen``/``rejected``), which is DPO's, not fine-tuning's.
    """
    columns = set(column_names)
    if "messages" in columns:
        return CONVERSATIONAL
    if {"prompt", "completion"} <= columns:
        return PROMPT_COMPLETION
    if text_column in columns:
        return LANGUAGE_MODELING
    found = ", ".join(sorted(columns)) or "none"
    if {"chosen", "rejected"} <= columns:
        raise ValueError(f"The dataset is a preference dataset (columns: {found}): train it with TRL's DPOTrainer "
                         "(NormLoggerCallback works there); fine-tuning takes text, messages or prompt/completion.")
    missing = " (it has 'prompt' but no 'completion')" if "prompt" in columns else ""
    raise ValueError(
        f"The dataset's columns fit no format{missing}: found {found}; expected '{text_column}' (language modelling; "
        "--text-column names another), 'messages' (conversational: lists of role/content turns) or 'prompt' and "
        "'completion' (prompt/completion, plain or conversational).")


def format_description(dataset_format: str, train_on_prompt: bool = False) -> dict:
    """The record of a job's data format: ``{"format", "loss_on"}`` (the run record and the model card)."""
    loss_on = "every token" if train_on_prompt else LOSS_ON[dataset_format]
    return {"format": dataset_format, "loss_on": loss_on}


def check_records(dataset, dataset_format: str, tokenizer=None) -> None:
    """Check every record of a conversational or prompt/completion dataset (language modelling: nothing to check
    here, :func:`hf_knorm.data.text_data.load_text_dataset` checks the text).

    Raises:
        ValueError: an unknown role, a turn without text content, a conversation without an assistant turn, a
            prompt or completion missing or empty, mixed plain and conversational sides, a chat dataset and a
            tokenizer without a chat template, an empty dataset. The record's index is named.
    """
    if dataset_format == LANGUAGE_MODELING:
        return
    if len(dataset) == 0:
        raise ValueError("The dataset is empty: no records to train on.")
    conversational = dataset_format == CONVERSATIONAL  # or a prompt/completion record in turns
    for index, record in enumerate(dataset):
        if dataset_format == CONVERSATIONAL:
            _check_turns(record["messages"], index, "messages")
            if not any(turn["role"] == "assistant" for turn in record["messages"]):
                raise ValueError(f"Record {index}: the conversation has no assistant turn, so nothing carries the "
                                 "loss; drop it or add the reply.")
            continue
        prompt, completion = record["prompt"], record["completion"]
        for side, value in (("prompt", prompt), ("completion", completion)):
            if value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, list)
                                                                                   and not value):
                raise ValueError(f"Record {index}: its {side} is missing or empty; every record needs both a prompt "
                                 "and a completion.")
        for side, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, (str, list)):
                raise ValueError(f"Record {index}: its {side} is {type(value).__name__}, neither text nor a list of "
                                 "role/content turns.")
        if isinstance(prompt, str) != isinstance(completion, str):
            raise ValueError(f"Record {index}: one side is text and the other a list of turns; both must be plain "
                             "text or both conversational.")
        if isinstance(prompt, list):
            _check_turns(prompt, index, "prompt")
            _check_turns(completion, index, "completion")
            conversational = True
    if conversational and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The dataset is conversational but the tokenizer has no chat template to render it with: use "
                         "a model whose tokenizer has one (e.g. an instruct model), or set tokenizer.chat_template.")


def _check_turns(turns, index: int, column: str) -> None:
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"Record {index}: {column!r} must be a non-empty list of role/content turns, not "
                         f"{type(turns).__name__}.")
    for turn in turns:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ROLES:
            raise ValueError(f"Record {index}: unknown role {role!r} in {column!r}; roles are {', '.join(ROLES)}.")
        if not isinstance(turn.get("content"), str):
            raise ValueError(f"Record {index}: a {role} turn in {column!r} has no text content.")


def tokenize_with_loss_mask(dataset, dataset_format: str, tokenizer, max_length: int, train_on_prompt: bool = False):
    """One example per record: ``input_ids`` and ``labels`` (``-100`` where no loss falls), cut at ``max_length``
    tokens; examples left without a loss token are dropped.

    Args:
        dataset: conversational or prompt/completion records (checked by :func:`check_records`).
        dataset_format: :data:`CONVERSATIONAL` or :data:`PROMPT_COMPLETION`.
        tokenizer: the model's tokenizer (its chat template renders the turns).
        max_length: tokens per example at most.
        train_on_prompt: put the loss on every token.

    Raises:
        ValueError: a chat template that does not render a conversation's beginning as a prefix of the whole, or no
            example left.
    """
    def encode(record):
        if dataset_format == CONVERSATIONAL:
            ids, mask = _conversation(record["messages"], tokenizer)
        else:
            ids, mask = _prompt_completion(record["prompt"], record["completion"], tokenizer)
        ids, mask = ids[:max_length], mask[:max_length]
        labels = list(ids) if train_on_prompt else [token if keep else -100 for token, keep in zip(ids, mask)]
        return {"input_ids": ids, "labels": labels}

    encoded = dataset.map(encode, remove_columns=dataset.column_names, desc="tokenizing with the loss mask")
    kept = encoded.filter(lambda example: any(label != -100 for label in example["labels"][1:]),
                          desc="dropping examples without a loss token")
    if len(kept) == 0:
        raise ValueError(f"No example is left once those without a loss token within {max_length} tokens are "
                         "dropped: the prompts fill the whole length. Raise --block-size or shorten the prompts.")
    return kept


def _render(tokenizer, turns, add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""The ``{% generation %}`` block of a chat template that marks the assistant's tokens (Transformers'
``return_assistant_tokens_mask``, TRL's ``assistant_only_loss``)."""


def _conversation(turns: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a rendered conversation; ``mask`` is 1 on the assistant turns' tokens.

    A template with ``{% generation %}`` blocks gives the mask itself, as TRL's ``assistant_only_loss`` takes it
    (``apply_chat_template(..., return_assistant_tokens_mask=True)``); any other (SmolLM2's, most) is located here by
    prefixes, which TRL does not do (see the module docstring).
    """
    from trl.data_utils import common_prefix_length

    if GENERATION_MARKER.search(tokenizer.chat_template or ""):
        rendered = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), list(rendered["assistant_masks"])
    ids = _render(tokenizer, turns)
    mask = [0] * len(ids)
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        upto = _render(tokenizer, turns[:index + 1])
        if ids[:len(upto)] != upto:
            raise ValueError("The chat template renders the beginning of a conversation differently from the whole "
                             "(it is not prefix-preserving), so the assistant turns cannot be located: use "
                             "--train-on-prompt, or a template that renders earlier turns unchanged.")
        start = common_prefix_length(_render(tokenizer, turns[:index], add_generation_prompt=True), upto)
        mask[start:len(upto)] = [1] * (len(upto) - start)
    return ids, mask


def _prompt_completion(prompt, completion, tokenizer) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a prompt/completion record, as TRL's SFTTrainer tokenizes it; ``mask`` is 1 on the
    completion (from where the tokenized prompt and prompt + completion diverge: TRL's ``common_prefix_length``)."""
    from trl.data_utils import common_prefix_length

    from .text_data import encode_texts

    if isinstance(prompt, list):
        prompt_ids = _render(tokenizer, prompt, add_generation_prompt=True)
        ids = _render(tokenizer, prompt + completion)
    else:  # plain text: special tokens added (BOS where the tokenizer adds one), the end-of-text token appended
        prompt_ids = encode_texts(tokenizer, [prompt])[0]
        ids = encode_texts(tokenizer, [prompt + completion], end_of_text=True)[0]
    start = common_prefix_length(prompt_ids, ids)
    return ids, [0] * start + [1] * (len(ids) - start)
