"""Checks made before a push sends anything: the repo id, the token, the tokenizer, the folder.

Each failure is a ``ValueError`` (``FileNotFoundError`` for a missing folder) that says what to do, raised before the
first request to the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..attention.interface import ATTENTION_NAME

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "preprocessor_config.json", "processor_config.json")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is ``namespace/name`` as the Hub accepts it.

    Raises:
        ValueError: anything else, with the reason.
    """
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"Invalid repo id {repo_id!r}: use 'namespace/name', your user or organization name, a "
                         "slash and the model's name (e.g. 'alice/smollm2-x3-16').")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"Invalid repo id {repo_id!r}: {error}") from None
    return repo_id


def resolve_token(token: str | None) -> str:
    """The token to push with: ``token``, else ``$HF_TOKEN``, else the token file of ``hf auth login``.

    Raises:
        ValueError: none of them holds a token.
    """
    token = token or get_token()
    if not token:
        raise ValueError("No Hugging Face token: pass token=... (--token on the command line), set HF_TOKEN, or run "
                         "`hf auth login` once. Pushing needs a token with write access; nothing was sent.")
    return token


def is_causal_lm(config: dict) -> bool:
    """Whether a saved config describes a causal LM (its class name ends in ForCausalLM or LMHeadModel)."""
    return any(name.endswith(CAUSAL_SUFFIXES) for name in config.get("architectures") or [])


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer or processor files."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def missing_tokenizer_error(what: str, how_to_skip: str) -> ValueError:
    """The error for a causal LM pushed without its tokenizer."""
    return ValueError(f"{what} is a causal LM without its tokenizer: the pushed repo could not be used for generation. "
                      f"Include the tokenizer, or {how_to_skip} to push the model without one (the card says so). "
                      "Nothing was sent.")


def check_saved_model(folder) -> tuple[Path, dict]:
    """``(folder, its config)`` if ``folder`` holds a saved model: a ``config.json`` and all its weight files.

    Raises:
        FileNotFoundError: no such folder.
        ValueError: no config, no ``model_type``, a config with an hf_knorm normalization but without its
            ``attn_implementation`` marker (it would load as softmax), or missing weights / shards.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"No model folder at {folder}.")
    how = "save it with hf_knorm.save_pretrained(model, folder, tokenizer=tokenizer)"
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a saved model: it has no config.json ({how}).")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}).") from None
    if "model_type" not in config:
        raise ValueError(f"{config_path} has no model_type: it is not a Transformers model config ({how}).")
    normalization = (config.get("hf_knorm") or {}).get("normalization")
    if normalization is not None and config.get("attn_implementation") != ATTENTION_NAME:
        raise ValueError(
            f"{config_path} names the hf_knorm normalization {normalization} but lacks \"attn_implementation\": "
            f"\"hf_knorm\" (an earlier hf_knorm could lose it): loaded from the Hub with plain from_pretrained it "
            "would run softmax. Save it again before pushing: hf_knorm.save_pretrained("
            "hf_knorm.from_pretrained(folder), new_folder, tokenizer=tokenizer) writes it."
        )
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        return folder, config
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            shards = sorted(set(json.loads((folder / index).read_text()).get("weight_map", {}).values()))
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing or not shards:
                raise ValueError(f"{folder} is an incomplete sharded checkpoint: {index} names shards that are "
                                 f"missing: {', '.join(missing) or '(none listed)'}.")
            return folder, config
    raise ValueError(f"{folder} has a config.json but no weights ({' or '.join(WEIGHT_FILES + WEIGHT_INDEXES)}); "
                     f"{how}.")
