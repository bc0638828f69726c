"""Convert to ``x^p/c`` by training its twin ``x^p/1``, then folding the constant into the queries: same function.

A constant ``c`` is a reparametrization: ``(alpha * s)^p / c = s^p`` for ``alpha = c^(1/p)``, so a model patched
with ``x^p/1`` computes exactly what the same model computes under ``x^p/c`` once every query is multiplied by
``c^(1/p)`` (the rows of ``q_proj``, and its bias). The function is the same; the training is not: AdamW takes
steps of a fixed size whatever the size of the weights, and the closed-form head scales of the attention transfer
(:mod:`.transfer`) leave the ``x^p/c`` model's q and k larger by ``c^(1/2p)`` each. Measured on the default model,
``x^3/1`` recovered better than "Rethinking Softmax"'s ``x^3/16`` at both budgets tried (at 150 recovery steps the
worst held-out domain 12.1-13.9x the original over three runs, against 15.1-16.2x over three;
docs/research/2026-12-conversion.md, "Per normalization"), so ``hf-knorm convert`` trains the twin and folds
(``--no-fold-constant``: train ``x^p/c`` itself).

``x^p/sqrtN`` has no constant to fold (``c`` depends on the number of keys) and is trained as it is; so is a model
whose queries have no projection of their own to scale (fused QKV) or are not linear in it (a q/k norm, a logit
softcap).
"""

from __future__ import annotations

import torch
from torch import nn

from ..normalizations import Normalization, parse_normalization
from ..models.architectures import attention_modules
from ..models.patching import patch, patched_normalization, unpatch


def training_normalization(model: nn.Module, normalization: str | Normalization) -> Normalization:
    """The normalization to train for ``normalization``: its twin ``x^p/1`` where the constant can be folded.

    Args:
        model: the model to convert (its attention modules decide whether the queries can carry the constant).
        normalization: the normalization the converted model will have.
    """
    target = parse_normalization(normalization)
    twin = target.unit_constant_twin()  # None: softmax, sqrtN, another family; a window: see fold_constant
    if twin is None or twin == target:
        return target
    if not all(_query_scale_site(module) is not None for _, module in attention_modules(model)):
        return target
    return twin


def fold_constant(model: nn.Module, normalization: str | Normalization) -> nn.Module:
    """Give a model patched with ``x^p/1`` the normalization ``x^p/c``, computing the same function; returns it.

    Every query is multiplied by ``c^(1/p)`` (in place, under ``no_grad``), then the model is patched with
    ``x^p/c`` instead of ``x^p/1``.

    Raises:
        ValueError: the model is not patched with the twin of ``normalization``, a module's queries cannot carry
            the constant, or ``normalization`` has a softmax window (the constant would scale its softmax scores).
    """
    target = parse_normalization(normalization)
    if target.window:
        raise ValueError(f"{target.name}: the queries also score the softmax window, which a constant folded into "
                         "them would change; train it as it is (training_normalization returns it unchanged).")
    twin = target.unit_constant_twin()
    if twin is None:
        raise ValueError(f"{target.name}: only the constant c of x^p/c folds into the queries.")
    if patched_normalization(model) != twin.name:
        raise ValueError(f"Folding the constant of {target.name} needs a model patched with {twin.name}, not "
                         f"{patched_normalization(model)}.")
    sites = {name: _query_scale_site(module) for name, module in attention_modules(model)}
    unfoldable = [name for name, site in sites.items() if site is None]
    if unfoldable:  # checked for every module before any weight changes
        raise ValueError(f"{unfoldable[0]}: its queries have no projection of their own that scales them linearly "
                         f"(fused QKV, a q/k norm or a softcap); the constant of {target.name} cannot be folded "
                         "into them.")
    pointwise = target.pointwise
    factor = (1.0 / pointwise.inv_constant) ** (1.0 / pointwise.power)
    with torch.no_grad():
        for site in sites.values():
            site.weight.mul_(factor)
            if site.bias is not None:
                site.bias.mul_(factor)
    unpatch(model)
    return patch(model, target)


def _query_scale_site(module: nn.Module) -> nn.Linear | None:
    """The projection whose rows scale the queries linearly: ``q_proj``; ``None`` where there is none (fused QKV),
    where a norm follows it (``q_norm`` undoes a scale of ``q_proj``, and Gemma's multiplies by ``1 + weight``) or
    where a softcap bends the scores."""
    if getattr(module.config, "attn_logit_softcapping", None) is not None:
        return None
    if isinstance(getattr(module, "q_norm", None), nn.Module):
        return None
    projection = getattr(module, "q_proj", None)
    return projection if isinstance(projection, nn.Linear) else None
