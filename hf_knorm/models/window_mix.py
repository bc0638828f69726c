"""A patched model's window mix: the per-head factor ``m_h`` of the polynomial part beside a softmax window.

``x^p/c + softmax window W`` computes ``softmax over the last W keys + m_h * sum_older (s^p / c) v``
(:mod:`hf_knorm.attention.window`). A model patched by hand has no mix (``m_h = 1``); a conversion solves one per
layer and head (:meth:`hf_knorm.conversion.transfer.AttentionTransfer.match_mix`) and stores it here, in the config's
``hf_knorm`` section (``window_mix``), so that it is saved with ``save_pretrained`` and read back by any
``from_pretrained``, exactly (floats in JSON), with nothing added to the weights. ``m_h = 0`` everywhere is the
window alone: :func:`distant_part_off` is the ablation that says whether the polynomial part does any work.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..attention.normalizations import parse_normalization
from ..attention.window import MIX_FIELD
from .architectures import attention_modules
from .patching import SECTION, _configs, patched_normalization


def window_mixes(model: nn.Module) -> list[list[float]] | None:
    """The model's mix, one ``[m_h per query head]`` list per attention layer, or ``None`` (1 everywhere)."""
    mixes = (getattr(model.config, SECTION, None) or {}).get(MIX_FIELD)
    return None if mixes is None else [list(layer) for layer in mixes]


def set_window_mix(model: nn.Module, mixes: Sequence[Sequence[float] | torch.Tensor] | None) -> None:
    """Store ``mixes`` (one ``(H_q,)`` sequence or tensor per attention layer, in layer order) as the model's mix;
    ``None`` removes it (1 everywhere).

    Raises:
        ValueError: the model is not patched with a softmax window, the number of layers or heads is not the
            model's, or a value is not finite.
    """
    name = patched_normalization(model)
    if name is None or not parse_normalization(name).window:
        raise ValueError(f"A window mix scales the polynomial part beside a softmax window; the model is patched "
                         f"with {name}. Patch it with softmax_window=W first.")
    modules = [module for _, module in attention_modules(model)]
    if mixes is not None:
        mixes = [[float(value) for value in (layer.tolist() if isinstance(layer, torch.Tensor) else layer)]
                 for layer in mixes]
        if len(mixes) != len(modules):
            raise ValueError(f"The model has {len(modules)} attention layers; got a mix for {len(mixes)}.")
        for index, (layer, module) in enumerate(zip(mixes, modules)):
            heads = module.config.num_attention_heads
            if len(layer) != heads:
                raise ValueError(f"Layer {index} has {heads} query heads; got {len(layer)} mix values.")
            if not all(torch.isfinite(torch.tensor(layer))):
                raise ValueError(f"Layer {index}'s mix is not finite: {layer}.")
    for config in _configs(model):
        section = dict(getattr(config, SECTION, None) or {})
        if mixes is None:
            section.pop(MIX_FIELD, None)
        else:
            section[MIX_FIELD] = mixes
        setattr(config, SECTION, section)


@contextmanager
def distant_part_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within: the polynomial part switched off (``m_h = 0``), the softmax window alone; the mix restored after."""
    kept = window_mixes(model)
    heads = [module.config.num_attention_heads for _, module in attention_modules(model)]
    set_window_mix(model, [[0.0] * count for count in heads])
    try:
        yield model
    finally:
        set_window_mix(model, kept)
