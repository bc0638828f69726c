"""Clusters beside a converted model's sparse cache (``... + sparse K (score) + clusters C``), their codebooks fitted on
text from the conversion's training mixture.

:func:`hf_knorm.models.cluster_codebook.fit_cluster_codebook` fits a codebook on any tokens; a conversion fits it on
Paul Graham's essays, the first of them in order (in the training mixture, not in any held-out domain:
:mod:`hf_knorm.evaluation.domains`), ``max(2048, 8 C)`` tokens in 1,024-token sequences: about 8 keys per direction
and head. These are the choices ``research/2026-12/clustered_distant_part.py`` measured; ``hf-knorm convert
--cluster-tokens N`` fits on another number of tokens (the test suite's short runs: fewer).
"""

from __future__ import annotations

import torch.nn as nn

from ..data.text_data import embedded_records, encode_texts
from ..models.cluster_codebook import set_clusters

CORPUS = "paul-graham"
SEQUENCE = 1024
"""Tokens per sequence the codebook's keys come from."""


def default_calibration_tokens(clusters: int) -> int:
    """``max(2048, 8 * clusters)``: the tokens a codebook of ``clusters`` directions is fitted on by default."""
    return max(2048, 8 * clusters)


def calibration_ids(tokenizer, clusters: int, tokens: int | None = None) -> list[list[int]]:
    """``tokens`` tokens of the essays (default: :func:`default_calibration_tokens`), in order, cut into
    :data:`SEQUENCE`-token sequences.

    Raises:
        ValueError: fewer tokens than clusters asked for, or the corpus holds fewer tokens.
    """
    needed = default_calibration_tokens(clusters) if tokens is None else tokens
    if needed < clusters:
        raise ValueError(f"Fitting {clusters} clusters needs at least {clusters} calibration tokens (one key per "
                         f"direction); {needed} asked for. Raise --cluster-tokens (default: "
                         f"{default_calibration_tokens(clusters)}).")
    ids: list[int] = []
    for text in embedded_records(CORPUS)["text"]:
        ids.extend(encode_texts(tokenizer, [text])[0])
        if len(ids) >= needed:
            return [ids[start:min(needed, start + SEQUENCE)] for start in range(0, needed, SEQUENCE)]
    raise ValueError(f"{clusters} clusters need {needed} calibration tokens; the {CORPUS} corpus has {len(ids)}.")


def add_clusters(model: nn.Module, tokenizer, clusters: int, seed: int = 0, tokens: int | None = None) -> nn.Module:
    """Give ``model`` (a windowed model with a sparse cache) ``clusters`` pseudo-pairs per layer and KV head, their
    codebooks fitted on :func:`calibration_ids` (``tokens`` of them; :func:`hf_knorm.models.cluster_codebook.set_clusters`)."""
    ids = calibration_ids(tokenizer, clusters, tokens) if clusters else None
    return set_clusters(model, clusters, ids, seed=seed)


__all__ = ["add_clusters", "calibration_ids", "default_calibration_tokens"]
