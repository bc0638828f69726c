"""Saving and loading patched models so that the normalization always comes back.

Transformers strips ``attn_implementation`` from saved configs; a saved ``x^3/16`` model would load silently as
softmax. ``patch`` therefore stores the settings in the config's ``hf_knorm`` section (with the plugin version) and a
plain ``attn_implementation: "hf_knorm"`` entry that ``from_pretrained`` reads back. With ``hf_knorm`` imported, plain
``AutoModel*.from_pretrained`` loads the model correctly; without it, loading fails with Transformers' error naming
``attn_implementation="hf_knorm"`` (the fix: ``import hf_knorm``). It never loads as softmax. Transformers' own
``save_pretrained`` / ``push_to_hub`` keep the marker too, also right after a plain load (see :mod:`.marker`).

:func:`save_pretrained` here writes the weights and the config; the public ``hf_knorm.save_pretrained``
(:mod:`hf_knorm.hub.saving`) calls it and adds the tokenizer and the model card.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ..attention.interface import ATTENTION_NAME
from ..attention.normalizations import parse_normalization
from ..version import __version__
from .patching import SECTION, patched_normalization


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``model.save_pretrained`` that guarantees the hf_knorm settings are in the saved ``config.json``.

    Returns:
        The folder written.
    """
    save_directory = Path(save_directory)
    model.save_pretrained(save_directory, **kwargs)
    normalization = patched_normalization(model)
    config_path = save_directory / "config.json"
    saved = json.loads(config_path.read_text())
    if normalization is not None and saved.get("attn_implementation") != ATTENTION_NAME:
        saved["attn_implementation"] = ATTENTION_NAME
        _write_json_atomically(config_path, saved)
    return save_directory


def from_pretrained(path: str | os.PathLike, model_class=None, **kwargs) -> nn.Module:
    """Load a model saved with hf_knorm settings and check they are in force.

    Args:
        path: a local folder (or a Hub repo id, when the Hub is reachable).
        model_class: the class to load with (default: the class named in ``config.architectures``).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ...). ``attn_implementation`` may not contradict the
            saved normalization.

    Raises:
        ValueError: the saved normalization is not valid, or ``attn_implementation`` contradicts it.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    section = getattr(config, SECTION, None) or {}
    normalization = section.get("normalization")
    if normalization is not None:
        parse_normalization(normalization)
        requested = kwargs.get("attn_implementation", ATTENTION_NAME)
        if requested != ATTENTION_NAME:
            raise ValueError(
                f"{path} was saved with normalization {normalization}; attn_implementation={requested!r} would replace "
                "it. Load it without attn_implementation, then call hf_knorm.unpatch(model) if you want the original."
            )
        saved_version = section.get("version")
        if saved_version and saved_version.split(".")[0] != __version__.split(".")[0]:
            warnings.warn(f"{path} was saved by hf_knorm {saved_version}; this is {__version__}.", stacklevel=2)
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        model_class = model_class or transformers.AutoModel
    model = model_class.from_pretrained(path, **kwargs)  # config.json's attn_implementation selects "hf_knorm"
    if normalization is not None:
        if model.config._attn_implementation != ATTENTION_NAME:  # a config.json that lost the marker
            model.set_attn_implementation(ATTENTION_NAME)
        model.config.attn_implementation = ATTENTION_NAME  # the marker patch() sets, so a re-save keeps it
    return model


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, **kwargs):
    """Load ``"default"`` (SmolLM2-135M-Instruct, embedded) or a local checkpoint folder, with its tokenizer.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        FileNotFoundError: ``name_or_path`` is neither ``"default"`` nor an existing folder.
    """
    from transformers import AutoTokenizer

    from ..assets.default_model import load_default_model

    if name_or_path == "default":
        return load_default_model(dtype=dtype, **kwargs)
    if not Path(name_or_path).is_dir():
        raise FileNotFoundError(
            f"No model folder at {name_or_path!r}. Pass 'default' for the embedded SmolLM2-135M-Instruct, "
            "or the folder of a checkpoint saved with save_pretrained."
        )
    model = from_pretrained(name_or_path, dtype=dtype, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(name_or_path)


def _write_json_atomically(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)
