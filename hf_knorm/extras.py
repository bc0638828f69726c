"""Optional dependencies: which extra of ``pip install hf_knorm[...]`` brings each, and one clear error when missing.

The core install is what ``patch``, KNorm, K/V balancing, the norm callback and the Hub need. The jobs' other needs
are extras of ``pyproject.toml``, imported where they are used through :func:`require`:

- ``train``: ``datasets`` (text datasets for ``hf-knorm finetune``), ``tensorboard`` (finetune's default
  ``report_to``), ``scikit-learn`` (the 8x8 digits of ``hf-knorm attention-norms``), ``peft`` (LoRA), ``trl`` (``SFTTrainer`` and its
  packing, under ``finetune``);
- ``demo``: what ``hf-knorm demo`` runs (it fine-tunes: the ``train`` extra);
- ``gpu``: ``triton`` (the fused ``x^p/c`` kernel) and ``fla-core`` (flash-linear-attention's ``x/1``), used on
  CUDA by ``hf_knorm/attention/backends.py``;
- ``dev``: the test suite and the import-layer linter (and the ``gpu`` extra: the Triton tests run on a CPU too).

``OPTIONAL`` is the one table of module -> (extra, distribution); a test checks each entry against ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (extra, distribution name on PyPI)
OPTIONAL: dict[str, tuple[str, str]] = {
    "datasets": ("train", "datasets"),
    "tensorboard": ("train", "tensorboard"),
    "sklearn": ("train", "scikit-learn"),
    "peft": ("train", "peft"),
    "trl": ("train", "trl"),
    "triton": ("gpu", "triton"),
    "fla": ("gpu", "fla-core"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (a key of :data:`OPTIONAL`), or say which extra to install for ``purpose``.

    Raises:
        MissingExtraError: ``module`` is not installed; the message reads, e.g., "hf-knorm finetune's TensorBoard
            logs need tensorboard, which is not installed: pip install 'hf_knorm[train]'".
    """
    extra, distribution = OPTIONAL[module]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(
            f"{purpose} needs {distribution}, which is not installed: pip install 'hf_knorm[{extra}]' "
            f"(or pip install {distribution})."
        ) from error
