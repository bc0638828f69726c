"""Where a model the user names is: the one rule of the library (``hf_knorm.from_pretrained``) and of every job
(``--model`` of ``finetune``, ``convert``, ``kv-norms``, ``niah``, ``demo``).

A model is named in one of three forms, tried in this order:

1. ``"default"``: the embedded SmolLM2-135M-Instruct (:mod:`hf_knorm.assets.default_model`; no Hub access);
2. a checkpoint folder (what ``save_pretrained`` writes);
3. a Hub id (``org/name``) found in the local Hub cache (``HF_HUB_CACHE``, laid out as ``hf download`` writes it:
   ``models--org--name/snapshots/<commit>/``), as ``from_pretrained(..., local_files_only=True)`` finds it.

The jobs never download (the machines they run on may have no network): a Hub id must be in the cache already. The
library's ``from_pretrained`` may also fetch a Hub id that is not there yet into that same cache, as Transformers'
``from_pretrained`` does, unless ``HF_HUB_OFFLINE`` is set or it is called with ``local_files_only=True``. Any other
name raises one error, :class:`ModelNotFoundError`, which names the three forms and what was tried.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT = "default"
"""The name of the embedded default model."""

FORMS = ("'default' (the embedded SmolLM2-135M-Instruct), a checkpoint folder, or a Hub id (org/name) already in the "
         "local Hub cache")
"""The three forms of a model name, as the one error spells them."""
MODEL_HELP = ("'default' (SmolLM2-135M-Instruct, embedded), a checkpoint folder, or a Hub id (org/name) already in the "
              "local Hub cache (nothing is downloaded)")
"""The help of a job's ``--model``."""


class ModelNotFoundError(FileNotFoundError):
    """A model name that is none of the three forms; the message names them and what was tried."""


def model_source(model: str | os.PathLike, *, download: bool = False, revision: str | None = None,
                 cache_dir: str | os.PathLike | None = None) -> Path | str:
    """What ``from_pretrained`` should load for the model the user named (see the module docstring for the rule).

    Args:
        model: ``"default"``, a checkpoint folder, or a Hub id.
        download: let Transformers fetch into the local Hub cache what a Hub id's files lack there (when the model
            loads), as its ``from_pretrained`` does; ignored while ``HF_HUB_OFFLINE`` is set. The jobs never set it.
        revision: the Hub revision (branch, tag or commit) of a Hub id; default ``main``.
        cache_dir: the Hub cache to look in; default ``HF_HUB_CACHE``.

    Returns:
        The model's folder; with ``download`` (and the Hub not offline), a valid Hub id is returned as it is (a
        ``str``), for Transformers to read through the local Hub cache and fetch what is missing there.

    Raises:
        ModelNotFoundError: ``model`` is not ``"default"``, not a folder, and not a Hub id in the local Hub cache
            (nor, with ``download``, a valid Hub id).
    """
    if model == DEFAULT:
        from ..assets.default_model import default_model_dir

        return Path(default_model_dir())
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    name = str(model)
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise not_found(name, "not a Hub id (org/name) either", "pass a checkpoint folder that exists, or a Hub id") \
            from None
    if download and not constants.HF_HUB_OFFLINE:
        return name  # Transformers reads it from the local Hub cache, fetching what is missing there
    try:
        return Path(snapshot_download(repo_id=name, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        offline = "; HF_HUB_OFFLINE is set, so nothing is downloaded" if download else ""
        raise not_found(name, f"not in the local Hub cache ({cache_description(revision, cache_dir)}{offline})",
                        f"download it once with `hf download {name}` on a machine with network, or pass a "
                        "checkpoint folder") from None


def model_folder(model: str | os.PathLike, *, revision: str | None = None,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the model the user named: :func:`model_source` without downloading (what every job loads).

    Raises:
        ModelNotFoundError: ``model`` is not ``"default"``, not a folder, and not a Hub id in the local Hub cache.
    """
    return model_source(model, revision=revision, cache_dir=cache_dir)


def not_found(model: str, hub: str, fix: str) -> ModelNotFoundError:
    """The one error for a model name that is none of the three forms.

    Args:
        model: the name as the user gave it.
        hub: what became of it as a Hub id (``"not in the local Hub cache (HF_HUB_CACHE=...)"``, ...).
        fix: what to do.
    """
    path = Path(model).expanduser().absolute()
    folder = f"not a folder ({path} is a file)" if path.is_file() else f"not a folder (nothing at {path})"
    return ModelNotFoundError(f"{model!r} is not 'default', {folder}, and {hub}: {fix}. A model is named by one of "
                              f"three forms: {FORMS}.")


def cache_description(revision: str | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """Where a Hub id was looked for: ``"HF_HUB_CACHE=/root/.cache/huggingface/hub"`` (or the ``cache_dir`` given),
    and the revision if not ``main``."""
    from huggingface_hub import constants

    where = f"cache_dir={cache_dir}" if cache_dir is not None else f"HF_HUB_CACHE={constants.HF_HUB_CACHE}"
    return where + (f", revision {revision!r}" if revision not in (None, "main") else "")
