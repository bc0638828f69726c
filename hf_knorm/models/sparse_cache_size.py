"""A patched model's sparse cache resized in place, its learned values kept.

``x/1 + softmax window 64 + sinks 4 + sparse K (score)`` keeps, per layer and KV head, the ``K`` older key/value pairs
of highest score beside the window (:mod:`hf_knorm.attention.sparse`). ``K`` is no weight: a converted model can be
read with another ``K`` without training again, and where its training blocks were short enough for the cache to
hold every older key (the default conversion's 256-token blocks, ``K >= 192``) its weights do not depend on ``K`` at
all. How much ``K`` matters depends on the length: the default conversion is 1.24x the original beyond the window on
technical text in 1,024-token blocks at ``K = 256``, 2.21x in 4,096-token blocks, and 1.47x there with ``K = 956``
(25% of the pairs at 4,096 tokens; medians of three seeds, docs/results/conversion.md "At 4,096 tokens"); but with
``K = 956`` it finds 0 of 8 passkeys at 4,000 tokens where ``K = 256`` finds 6 (seed 0): a size is a trade.

:func:`set_sparse_cache` patches the model again with the new ``K`` (and score), and puts back every learned value
the normalization has (the window mix, a base family's own) and its cluster codebooks: the same model but for the
cache. :func:`repatch` does it for any such change (:func:`hf_knorm.models.cluster_codebook.set_clusters` too).
"""

from __future__ import annotations

import torch.nn as nn

from ..normalizations import Normalization, with_sparse
from ..normalizations.sparse_choice import DEFAULT_SCORE
from ..normalizations.windowed import CODEBOOK
from .architectures import attention_modules
from .parameters import PREFIX, learned_values, set_learned_values
from .patching import SECTION, held_normalization, patch, unpatch


def set_sparse_cache(model: nn.Module, sparse: int, score: str | None = None) -> nn.Module:
    """Give ``model``'s softmax window a sparse cache of ``sparse`` pairs per layer and KV head (``0``: none),
    chosen by ``score`` (``None``: the model's, or :data:`~hf_knorm.normalizations.sparse_choice.DEFAULT_SCORE` if it
    has no cache); every learned value (``hf_knorm_*`` parameters, frozen or not as they were) and the ``linear``
    policy are kept. Returns the same model; save it to keep the new cache in its config.

    Raises:
        ValueError: the model is not patched, or its normalization has no softmax window; ``sparse`` is not an
            integer >= 0 or ``score`` is not a sparse cache's (:func:`hf_knorm.normalizations.with_sparse`); the
            model cannot take a sparse cache (a layer with its own sliding window: :func:`.patching.patch`). The
            model is then as it was.
    """
    normalization = held_normalization(model)
    if normalization is None:
        raise ValueError("The model is not patched by hf_knorm: patch it with a normalization that has a softmax "
                         "window first, e.g. 'x/1 + softmax window 64 + sinks 4 + sparse 256'.")
    if not normalization.window:
        raise ValueError(f"{normalization.name} has no softmax window, which a sparse cache sits beside: patch the model with "
                         "a window (hf_knorm.unpatch, then hf_knorm.patch(model, ..., softmax_window=W)).")
    if score is None:
        score = normalization.score if normalization.sparse else DEFAULT_SCORE
    return repatch(model, normalization, with_sparse(normalization, sparse, score))  # checked before any change


def repatch(model: nn.Module, normalization: Normalization, changed: Normalization) -> nn.Module:
    """Patch ``model`` (patched with ``normalization``) again with ``changed``, which differs from it in its attention
    sinks, sparse cache or clusters only (e.g. an ablation: ``dataclasses.replace(normalization, sinks=0)``): every
    learned value (frozen or not, as it was), the ``linear`` policy and, when the number of clusters is the same, the
    cluster codebooks are kept. A refused patch leaves the model as it was and raises its ValueError."""
    if changed == normalization:
        return model
    kept = {name: learned_values(model, name) for name in normalization.learnable()}
    trainable = {name: parameter.requires_grad for name, parameter in model.named_parameters()
                 if name.rpartition(".")[2].startswith(PREFIX)}  # frozen or not, as they were
    codebooks = [module._parameters.get(PREFIX + CODEBOOK) for _, module in attention_modules(model)]
    linear = getattr(model.config, SECTION).get("linear", "auto")
    unpatch(model)
    try:
        patch(model, changed, linear=linear)
        restored = changed
    except ValueError:
        patch(model, normalization, linear=linear)  # refused: the model as it was, then the reason
        restored = normalization
        raise
    finally:
        for name, values in kept.items():
            set_learned_values(model, name, values)
        if restored.clusters == normalization.clusters:
            for (_, module), codebook in zip(attention_modules(model), codebooks):
                if codebook is not None:
                    module._parameters[PREFIX + CODEBOOK].data.copy_(codebook.data)
        for name, parameter in model.named_parameters():
            if name in trainable:
                parameter.requires_grad_(trainable[name])
    return model


__all__ = ["repatch", "set_sparse_cache"]
