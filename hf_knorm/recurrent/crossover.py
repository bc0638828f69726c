"""Where a recurrent state stops being larger than the plain K/V cache it replaces: ``generate`` keeps the plain cache
below that length.

A :class:`~.cache.RecurrentStateCache` holds, per sequence and layer, a bounded state whatever the length: the ``D x
D_v`` sums of ``x/1`` and, with a softmax window, the window's ``W`` pairs, the sinks, the sparse cache's ``K`` pairs
with their scores and positions, a prefix score's running statistics and the clusters' sums. A plain K/V cache holds
``2 * D`` numbers per token and KV head. Below the crossover the plain cache is the smaller one: on the default
conversion (``x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 600``, SmolLM2's 3 KV heads
of dimension 64, fp32) the state holds as many bytes as about 970 tokens' keys and values. Both compute the same
function (the plain cache decodes through the full forward's attention), so :func:`keeps_plain_cache` tells
``generate`` (:mod:`.generation`, for a model with a sparse cache) to decode a call whose longest sequence stays at
or below the crossover with the plain cache: the cache ``generate`` holds is then never larger than the plain cache
of the call's length.

:func:`state_bytes` is an upper bound of :meth:`~.cache.RecurrentStateCache.nbytes` per sequence, from the shapes
the layers hold once full (``tests/recurrent/test_crossover.py`` checks it against the bytes a decoded cache holds);
an upper bound keeps the plain cache where the two are within its slack, never the state where it is the larger.
"""

from __future__ import annotations

import torch

from ..normalizations import Normalization
from ..normalizations.prefix_kv_diff import REACH

__all__ = ["crossover_length", "keeps_plain_cache", "plain_bytes", "state_bytes"]

PREFIX_SCORE = "prefix_kv_diff"
"""The sparse-cache score that carries running statistics from step to step."""


def state_bytes(normalization: Normalization, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """At most the bytes one sequence's state holds in one layer, once full (``W + S + K`` pairs kept).

    Args:
        normalization: a ``p = 1`` normalization (the state's; its window, sinks, sparse cache and clusters).
        kv_heads: ``H_kv``; head_dim: ``D`` (keys and values alike).
        dtype: the model's (the keys' and values'); the sums are fp32, fp64 for fp64.
    """
    item = torch.empty((), dtype=dtype).element_size()
    summed = 8 if dtype == torch.float64 else 4  # the sums' dtype: fp32, fp64 for fp64
    total = kv_heads * head_dim * head_dim * summed + 8  # x/1's sum of k v^T and the count
    window, sinks, sparse = normalization.window, normalization.sinks, normalization.sparse
    total += 2 * kv_heads * (window + sinks) * head_dim * item + sinks * (8 + 1)  # pairs; sinks' positions, validity
    total += kv_heads * sparse * (2 * head_dim * item + summed + 8 + 1)  # pairs, scores, positions, filled slots
    if sparse and normalization.score == PREFIX_SCORE:  # fp64 running statistics (prefix_kv_diff.PrefixStatistics)
        tail = window + REACH
        total += 8 * (kv_heads * (2 * head_dim + 4 + tail) + 1) + tail + 8
    total += kv_heads * normalization.clusters * (2 * head_dim + 1) * summed  # key sums, value sums, counts
    return total


def plain_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype, length: int) -> int:
    """The bytes a plain K/V cache holds for one sequence of ``length`` tokens in one layer."""
    return 2 * kv_heads * length * head_dim * torch.empty((), dtype=dtype).element_size()


def crossover_length(normalization: Normalization, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The longest length at which the plain K/V cache holds at most :func:`state_bytes` (so from one token more
    the state is the smaller)."""
    return state_bytes(normalization, kv_heads, head_dim, dtype) // plain_bytes(kv_heads, head_dim, dtype, 1)


def keeps_plain_cache(normalization: Normalization, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      max_length: int | None) -> bool:
    """Whether a ``generate`` call whose sequences reach at most ``max_length`` tokens (prompt and new tokens;
    ``None``: unknown) decodes with less memory from the plain K/V cache than from the state."""
    return max_length is not None and max_length <= crossover_length(normalization, kv_heads, head_dim, dtype)
