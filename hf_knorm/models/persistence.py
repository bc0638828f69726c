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

A normalization's learnable values (:mod:`.parameters`: ``hf_knorm_<name>`` on each attention module) are saved with
the weights; a model built from a patched config has them, so Transformers' loader reads them back;
:func:`from_pretrained` also refuses a checkpoint that lacks one. The section records the normalization twice:
its spelling (``normalization``), and a versioned typed record (``normalization_record``, ``format`` 2); the two must
agree. A checkpoint of format 1 (the spelling alone, a window mix as JSON floats in ``window_mix``) loads to the same
logits: the mix moves into the parameters.

:func:`from_pretrained` takes a model by any name of the one loader's rule (:mod:`.sources`: ``"default"``, a folder,
or a Hub id in the local Hub cache); :func:`load_model` is what the jobs call (the same rule, never downloading).

:func:`save_weights_and_config` writes the weights and the config; the one public save, ``hf_knorm.save_pretrained``
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
from ..normalizations import Normalization, from_record, parse_normalization
from ..normalizations.registry import RECORD_FORMAT
from ..normalizations.windowed import MIX
from ..version import __version__
from .parameters import LEGACY_MIX_FIELD, PREFIX
from .patching import SECTION, _configs
from .sources import cache_description, model_folder, model_source, not_found

HUB_ARGUMENTS = ("revision", "cache_dir", "token", "local_files_only")
"""The arguments of a load that say where a Hub id's files are (Transformers' names)."""


def save_weights_and_config(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``model.save_pretrained``: the weights and ``config.json``, with the hf_knorm section and its marker.

    Returns:
        The folder written.
    """
    save_directory = Path(save_directory)
    model.save_pretrained(save_directory, **kwargs)
    return save_directory


def from_pretrained(path: str | os.PathLike, model_class=None, **kwargs) -> nn.Module:
    """Load a model (one saved with hf_knorm settings comes back with them, checked to be in force).

    Args:
        path: ``"default"`` (the embedded SmolLM2-135M-Instruct), a checkpoint folder, or a Hub id (``org/name``)
            in the local Hub cache, or fetched into it where the Hub is reachable, as Transformers does (not with
            ``HF_HUB_OFFLINE`` set or ``local_files_only=True``): the one rule of :mod:`.sources`.
        model_class: the class to load with (default: the class named in ``config.architectures``).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ``revision``, ...). ``attn_implementation`` may not
            contradict the saved normalization.

    Raises:
        ModelNotFoundError: ``path`` is none of the three forms (or a Hub id that could not be fetched).
        ValueError: the saved normalization is not valid, or ``attn_implementation`` contradicts it.
    """
    import transformers

    hub = {key: kwargs[key] for key in HUB_ARGUMENTS if key in kwargs}
    source = model_source(path, download=not hub.get("local_files_only", False), revision=hub.get("revision"),
                          cache_dir=hub.get("cache_dir"))  # a folder, or a Hub id for Transformers to fetch
    try:
        config = transformers.AutoConfig.from_pretrained(source, **hub)
    except OSError as error:
        if not isinstance(source, str):  # a folder: its own error (no config.json, ...)
            raise
        cache = cache_description(hub.get("revision"), hub.get("cache_dir"))
        reason = " ".join(str(error).split())  # Transformers' message, on one line
        raise not_found(source, f"not in the local Hub cache ({cache}), and fetching it from the Hub failed ({reason})",
                        "check the id (a private repo needs a token), or pass a checkpoint folder") from error
    section = getattr(config, SECTION, None) or {}
    normalization = section.get("normalization")
    if normalization is not None:
        normalization = saved_normalization(section, path)
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
    model = model_class.from_pretrained(source, **kwargs)  # a p = 1 model decodes with its state (recurrent.generation)
    if normalization is not None and normalization.learnable():
        _check_learned(model, normalization, source, section, hub)
    if normalization is not None:
        _upgrade_section(model, normalization)
    return model


def _upgrade_section(model: nn.Module, normalization: Normalization) -> None:
    """Write the loaded model's section in the current format (the typed record; no config-held mix, which now
    lives in the parameters), so that saving it again is saving this release's checkpoint."""
    for config in _configs(model):
        section = dict(getattr(config, SECTION, None) or {})
        section.pop(LEGACY_MIX_FIELD, None)
        section.update(normalization_record=normalization.to_record(), format=RECORD_FORMAT)
        setattr(config, SECTION, section)


def saved_normalization(section: dict, path) -> Normalization:
    """The normalization a config's ``hf_knorm`` section names: its typed record (format 2) checked against its
    spelling, or the spelling alone (format 1).

    Raises:
        ValueError: a format this hf_knorm does not know, or a record and a spelling that disagree.
    """
    spelled = parse_normalization(section["normalization"])
    fmt = section.get("format", 1)
    if fmt not in (1, RECORD_FORMAT):
        raise ValueError(f"{path}'s hf_knorm section has format {fmt}; this hf_knorm reads formats 1 and "
                         f"{RECORD_FORMAT}. Upgrade hf_knorm.")
    record = section.get("normalization_record")
    if record is not None and from_record(record) != spelled:
        raise ValueError(f"{path}'s config names {spelled.name} and records {from_record(record).name}; fix "
                         "config.json's hf_knorm section (the record is what patch wrote).")
    return spelled


def _check_learned(model: nn.Module, normalization: Normalization, path, section: dict, hub: dict) -> None:
    """Check that the checkpoint held every learned value the model now has (Transformers' loader read them:
    :func:`hf_knorm.models.parameters.register`); a format-1 window mix comes from the config (or is 1).

    Raises:
        ValueError: the checkpoint lacks a learned value the normalization needs.
    """
    saved = _saved_names(path, hub)
    names = {name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1].startswith(PREFIX)}
    missing = sorted(names - saved)
    if section.get("format", 1) == 1:  # the mix: from the config's window_mix, or 1 (initial_values)
        missing = [name for name in missing if not name.endswith(PREFIX + MIX)]
    if missing:
        raise ValueError(f"{path} holds no saved value for {missing[0]} ({len(missing)} missing): it was saved "
                         f"without {normalization.name}'s learned values. Save the patched model with "
                         "hf_knorm.save_pretrained or model.save_pretrained.")


def _saved_names(path, hub: dict) -> set[str]:
    """The names of the ``hf_knorm_*`` tensors in a checkpoint's safetensors files (a local folder or a Hub
    repository, found with the ``hub`` arguments of the load)."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    folder = Path(path)
    if not folder.is_dir():
        folder = Path(cached_file(str(path), "config.json", **hub)).parent
    names = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update(name for name in handle.keys() if name.rsplit(".", 1)[-1].startswith(PREFIX))
    return names


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs):
    """Load the model a job names, with its tokenizer: ``"default"`` (SmolLM2-135M-Instruct, embedded), a checkpoint
    folder, or a Hub id in the local Hub cache; nothing is downloaded (:func:`.sources.model_folder`).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelNotFoundError: ``name_or_path`` is none of the three forms.
    """
    from transformers import AutoTokenizer

    folder = model_folder(name_or_path)
    model = from_pretrained(folder, dtype=dtype, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(folder)
