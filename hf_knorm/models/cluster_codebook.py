"""The cluster codebooks of ``... + sparse K (score) + clusters C``: fitted on the model's own keys, saved with it.

Each attention module of a model patched with clusters holds ``hf_knorm_cluster_codebook``, ``(H_kv, C, D)`` unit
directions (:mod:`hf_knorm.attention.distant_clusters` puts each distant key in the cluster of highest cosine). It is
a frozen ``nn.Parameter``: in ``state_dict``, written by ``save_pretrained`` and read back by ``from_pretrained``,
never trained. :func:`hf_knorm.patch` adds it as zeros, which the attention refuses to run; :func:`fit_cluster_codebook`
fits it: spherical k-means (Dhillon and Modha, 2001) per layer and KV head on the keys the model computes on the
given tokens **with its clusters off** (window, sinks, sparse cache and base part as patched), so that fitting does not
depend on a codebook not fitted yet. :func:`set_clusters` gives a patched model clusters (or another number of them)
and fits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..attention.held import running_as
from ..attention.taps import KVTransform
from ..normalizations import with_clusters
from ..normalizations.windowed import CODEBOOK
from .architectures import attention_modules
from .parameters import PREFIX
from .patching import held_normalization, patched_normalization
from .sparse_cache_size import repatch

ITERATIONS = 20
"""Lloyd iterations of the spherical k-means."""


def set_clusters(model: nn.Module, clusters: int, input_ids=None, *, iterations: int = ITERATIONS,
                 seed: int = 0) -> nn.Module:
    """Give ``model`` (patched with a softmax window and a sparse cache) ``clusters`` pseudo-pairs per layer and KV
    head beside its sparse cache (``0``: none), every learned value kept; with ``input_ids``, fit the codebooks on
    them (:func:`fit_cluster_codebook`), else they are zeros until fitted. Returns the same model.

    Raises:
        ValueError: the model is not patched, or its normalization has no sparse cache beside a window; ``clusters``
            is not an integer >= 0; see :func:`fit_cluster_codebook`.
    """
    normalization = held_normalization(model)
    if normalization is None:
        raise ValueError("The model is not patched by hf_knorm: patch it with a softmax window and a sparse cache "
                         "first, e.g. 'x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff)'.")
    repatch(model, normalization, with_clusters(normalization, clusters))  # checked before any change
    if clusters and input_ids is not None:
        fit_cluster_codebook(model, input_ids, iterations=iterations, seed=seed)
    return model


def fit_cluster_codebook(model: nn.Module, input_ids, *, iterations: int = ITERATIONS, seed: int = 0) -> nn.Module:
    """Fit every attention layer's codebook by spherical k-means on the keys ``model`` computes on ``input_ids``.

    Args:
        model: patched with ``... + clusters C``.
        input_ids: token ids, a ``(T,)`` or ``(B, T)`` LongTensor or a sequence of id lists; each sequence runs alone
            (no padding). At least ``C`` tokens in all.
        iterations: Lloyd iterations (assign each key to the direction of highest cosine, each direction to its
            keys' normalized sum; a direction that gets no key stays).
        seed: the choice of the ``C`` keys the directions start from.

    Returns:
        The same model, its codebooks written in place (in the dtype of the parameter).

    Raises:
        ValueError: the model has no clusters, fewer tokens than clusters, or a key that is not finite.
    """
    normalization = held_normalization(model)
    if normalization is None or not normalization.clusters:
        raise ValueError(f"The model is patched with {patched_normalization(model)!r}, which has no clusters: give it "
                         "some with hf_knorm.models.cluster_codebook.set_clusters(model, C, input_ids).")
    sequences = _sequences(input_ids)
    clusters = normalization.clusters
    if sum(len(ids) for ids in sequences) < clusters:
        raise ValueError(f"Fitting {clusters} clusters needs at least {clusters} tokens; got "
                         f"{sum(len(ids) for ids in sequences)}.")
    keys = _model_keys(model, sequences)
    generator = torch.Generator().manual_seed(seed)
    for (_, module), layer_keys in zip(attention_modules(model), keys):
        if not bool(torch.isfinite(layer_keys).all()):
            raise ValueError(f"Layer {module.layer_idx}'s keys are not finite on these tokens: the model is broken "
                             "there; a codebook cannot be fitted.")
        codebook = spherical_kmeans(layer_keys, clusters, iterations, generator)
        with torch.no_grad():
            module._parameters[PREFIX + CODEBOOK].copy_(codebook)
    return model


def spherical_kmeans(keys: torch.Tensor, clusters: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """``(H, C, D)`` unit directions for ``keys`` ``(H, N, D)`` (``N >= C``), one k-means per head on the unit
    sphere, started from ``C`` distinct keys."""
    units = nn.functional.normalize(keys.double(), dim=-1)
    start = torch.randperm(units.shape[1], generator=generator)[:clusters]
    centroids = units[:, start]
    for _ in range(iterations):
        assign = (units @ centroids.transpose(-1, -2)).argmax(dim=-1)  # (H, N)
        summed = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand_as(units), units)
        empty = summed.norm(dim=-1, keepdim=True) == 0
        centroids = torch.where(empty, centroids, nn.functional.normalize(summed, dim=-1))
    return centroids


def _sequences(input_ids) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        rows = input_ids[None] if input_ids.dim() == 1 else input_ids
        return [row.tolist() for row in rows]
    if isinstance(input_ids, Sequence) and input_ids and isinstance(input_ids[0], int):
        return [list(input_ids)]
    return [list(ids) for ids in input_ids]


def _model_keys(model: nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per attention layer, ``(H_kv, N, D)`` fp32: the keys of every token of ``sequences``, the model run with its
    clusters off (:func:`clusters_off`)."""
    recorded: dict[int, list[torch.Tensor]] = {}

    def record(module, key, value):
        recorded.setdefault(module.layer_idx, []).append(key.detach().float()[0])
        return key, value

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with clusters_off(model), KVTransform(record), torch.no_grad():
            for ids in sequences:
                model(torch.tensor([ids], device=device), use_cache=False)
    finally:
        model.train(was_training)
    return [torch.cat(recorded[module.layer_idx], dim=1).cpu() for _, module in attention_modules(model)]


@contextmanager
def clusters_off(model: nn.Module):
    """Within: ``model`` runs without its clusters in this context (:func:`hf_knorm.attention.held.running_as`; its
    config and what it holds are unchanged, so another thread running it meanwhile keeps them; the codebooks stay,
    unused). Nothing changes for a model without clusters."""
    normalization = held_normalization(model)
    if normalization is None or not normalization.clusters:
        yield model
        return
    with running_as([module for _, module in attention_modules(model)], with_clusters(normalization, 0)):
        yield model


__all__ = ["clusters_off", "fit_cluster_codebook", "set_clusters", "spherical_kmeans"]
