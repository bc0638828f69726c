"""Saving and loading patched models so that the normalization always comes back.

Transformers strips ``attn_implementation`` from saved configs; a saved ``x^3/16`` model would load silently as
softmax. ``patch`` therefore stores the settings in the config's ``hf_knorm`` section (with the plugin version), and
every save of a config with that section (Transformers' own ``save_pretrained`` / ``push_to_hub`` included, also
right after a plain load) writes ``"attn_implementation": "hf_knorm"`` beside it, which ``from_pretrained`` reads
back (the one writer of that marker: :mod:`hf_knorm.attention.registration`). With ``hf_knorm`` imported, plain
``AutoModel*.from_pretrained`` loads the model correctly; without it, loading fails with Transformers' error naming
``attn_implementation="hf_knorm"`` (the fix: ``import hf_knorm``). It never loads as softmax.
:func:`from_pretrained` here reads the section itself, so a checkpoint whose ``config.json`` lost the marker (saved
by an earlier hf_knorm) loads with its normalization too.

:func:`save_pretrained` here writes the weights and the config; the public ``hf_knorm.save_pretrained``
(:mod:`hf_knorm.hub.saving`) calls it and adds the tokenizer and the model card.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ..attention.interface import ATTENTION_NAME
from ..attention.paths import LINEAR_POLICIES
from ..attention.normalizations import parse_normalization
from ..version import __version__
from .patching import SECTION


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``model.save_pretrained``: the weights and ``config.json``, with the hf_knorm section and its marker.

    Returns:
        The folder written.
    """
    save_directory = Path(save_directory)
    model.save_pretrained(save_directory, **kwargs)
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
        if section.get("linear", "auto") not in LINEAR_POLICIES:
            raise ValueError(f"{path}'s config names linear={section['linear']!r}; the policies are "
                             f"{', '.join(LINEAR_POLICIES)}. Fix config.json's hf_knorm section.")
        requested = kwargs.get("attn_implementation", ATTENTION_NAME)
        if requested != ATTENTION_NAME:
            raise ValueError(
                f"{path} was saved with normalization {normalization}; attn_implementation={requested!r} would replace "
                "it. Load it without attn_implementation, then call hf_knorm.unpatch(model) if you want the original."
            )
        saved_version = section.get("version")
        if saved_version and saved_version.split(".")[0] != __version__.split(".")[0]:
            warnings.warn(f"{path} was saved by hf_knorm {saved_version}; this is {__version__}.", stacklevel=2)
        kwargs["attn_implementation"] = ATTENTION_NAME  # also for a config.json that lost the marker
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        model_class = model_class or transformers.AutoModel
    return model_class.from_pretrained(path, **kwargs)  # a p = 1 model decodes with its state (recurrent.generation)


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
