"""A patched model's window mix: the per-head factor ``m_h`` of the part beside a softmax window.

``base + softmax window W`` computes ``softmax over the last W keys + m_h * (the base family's part over the older
keys)`` (:mod:`hf_knorm.attention.window`). ``m_h`` is a learnable parameter of each attention module
(``hf_knorm_window_mix``, :mod:`.parameters`), 1 when patched; a conversion solves it per layer and head
(:meth:`hf_knorm.conversion.transfer.AttentionTransfer.match_mix`), training may move it, and it is saved with the
weights. ``m_h = 0`` everywhere is the window alone: :func:`distant_part_off` is the ablation that says whether the
part beside the window does any work. The converse, the window dropped (the base family alone over every key,
:mod:`hf_knorm.attention.window_off`), is a training switch: :func:`window_dropped`, which window dropout
(:mod:`hf_knorm.training.window_dropout`) turns on for the steps it draws. Releases before the normalization families kept the mix in the config
(``window_mix``); :func:`hf_knorm.from_pretrained` moves such a mix into the parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..attention.window_off import WINDOW_DROPPED
from ..normalizations.windowed import MIX
from .architectures import attention_modules
from .cluster_codebook import clusters_off
from .parameters import learned_values, query_heads, set_learned_values
from .patching import held_normalization, patched_normalization


def window_mixes(model: nn.Module) -> list[list[float]]:
    """The model's mix, one ``[m_h per query head]`` list per attention layer."""
    _check_windowed(model)
    return [values.tolist() for values in learned_values(model, MIX)]


def set_window_mix(model: nn.Module, mixes: Sequence[Sequence[float] | torch.Tensor] | None) -> None:
    """Write ``mixes`` (one ``(H_q,)`` sequence or tensor per attention layer, in layer order) into the model's mix
    parameters; ``None`` sets 1 everywhere.

    Raises:
        ValueError: the model is not patched with a softmax window, the number of layers or heads is not the
            model's, or a value is not finite.
    """
    _check_windowed(model)
    if mixes is None:
        mixes = [torch.ones(query_heads(module)) for _, module in attention_modules(model)]
    set_learned_values(model, MIX, mixes)


def _check_windowed(model: nn.Module) -> None:
    held = held_normalization(model)
    if held is None or not held.window:
        raise ValueError(f"A window mix scales the part beside a softmax window; the model is patched with "
                         f"{patched_normalization(model)}. "
                         "Patch it with softmax_window=W first.")


@contextmanager
def distant_part_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within: the part beside the window switched off (``m_h = 0``, and clusters beside a sparse cache off:
    :func:`.cluster_codebook.clusters_off`), the softmax window alone (with its sinks and sparse cache); the mix and
    the clusters restored after."""
    kept = window_mixes(model)
    set_window_mix(model, [[0.0] * len(layer) for layer in kept])
    try:
        with clusters_off(model):
            yield model
    finally:
        set_window_mix(model, kept)


def set_window_dropped(model: nn.Module, dropped: bool) -> None:
    """Drop (``True``) or restore (``False``) the softmax window of every attention layer of ``model`` in its
    training forwards (:mod:`hf_knorm.attention.window_off`); a module in eval mode always runs its window.

    Raises:
        ValueError: the model is not patched with a softmax window.
    """
    _check_windowed(model)
    for _, module in attention_modules(model):
        if dropped:
            setattr(module, WINDOW_DROPPED, True)
        else:
            module.__dict__.pop(WINDOW_DROPPED, None)  # the module as it was: no attribute left behind


@contextmanager
def window_dropped(model: nn.Module) -> Iterator[nn.Module]:
    """Within: the softmax window (with the sinks and a sparse cache) dropped in ``model``'s training forwards, the
    base family alone over every key (:mod:`hf_knorm.attention.window_off`); restored after. Evaluation and
    ``generate`` (``model.training`` false) run the window regardless."""
    set_window_dropped(model, True)
    try:
        yield model
    finally:
        set_window_dropped(model, False)
