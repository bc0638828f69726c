"""Where a KNorm cache spends its budget: across the KV heads of a layer, and across layers.

Two rules, both pure functions of a layer's eviction order (what :meth:`~hf_knorm.eviction.settings.EvictionSettings.
eviction_order` returns: the negated importance, low = kept, protected tokens ``-inf``):

- :func:`head_adaptive_keep`: AdaKV's head-wise allocation (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by
  Adaptive Budget Allocation for Efficient LLM Inference", arXiv 2407.11550) for a query-agnostic score. A layer keeps
  ``H_kv * k`` tokens in all (``k`` = the uniform count per head); each head first keeps its own best
  ``floor = ceil(head_floor * k)`` tokens, then the rest of the layer's budget goes to the best remaining tokens of the
  whole layer, compared across heads on the **per-head z-score** of the importance, computed in fp32. Scores are not
  comparable across heads as they are (a head's key norms sit on its own scale, arXiv 2406.11430 Fig. 2); a z-score
  puts every head on one scale. A per-head *rank* would not do: every head has the same ranks, so a shared top-k of
  ranks gives back the uniform budget. Protected tokens (sinks, recent window) are always kept.
- :func:`layer_keep_counts`: a per-layer schedule of kept counts whose total is the uniform one (``layers * k``):
  ``"uniform"``; ``"skip_first"`` (the KNorm authors' code leaves layers 0-1 uncompressed, github
  alessiodevoto/l2compress; the other layers share what is left); ``"dispersion"`` (from the prefill: a layer whose
  importance is flat, i.e. whose scores single out few tokens, keeps more; shares proportional to
  ``1 / (1 + cv / mean(cv))``, ``cv`` = the layer's coefficient of variation of the importance over its heads'
  tokens, relative to the layers' mean so that the spread of shares does not depend on the score's scale). This is a
  cheap heuristic of ours, not from a paper; the kept counts stay within [protected tokens (at least 1), prompt].
- :func:`global_keep` (``layer_budget="global"``): KVzip's pair-level eviction (Kim et al., arXiv 2505.23416; kvpress
  ``KVzipPress`` with ``layerwise=False``): one threshold over the importance of every layer's and head's pairs, so a
  layer or head whose attention singles out few pairs keeps few and another keeps many; the total is the uniform one.
  The importance is compared as it is, which means something only for a score on one scale in every layer and head
  (KVzip's: an attention weight in [0, 1]); each head first keeps its best ``ceil(head_floor * k)`` (KVzip: none,
  ``head_floor=0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["HEAD_BUDGETS", "LAYER_BUDGETS", "allocate", "global_keep", "head_adaptive_keep", "head_floor_count",
           "layer_dispersion", "layer_keep_counts"]

HEAD_BUDGETS = ("uniform", "heads")
LAYER_BUDGETS = ("uniform", "skip_first", "dispersion", "global")


def head_floor_count(keep: int, head_floor: float) -> int:
    """Tokens every head keeps at least, out of a uniform share of ``keep``: ``ceil(head_floor * keep)``."""
    return min(keep, math.ceil(round(head_floor * keep, 6)))


def head_adaptive_keep(order: torch.Tensor, keep: int, head_floor: float) -> torch.Tensor:
    """Which tokens a layer keeps under a head-adaptive budget.

    Args:
        order (torch.Tensor): (B, H_kv, S) eviction order, low = kept; protected tokens ``-inf``.
        keep (int): The uniform count per head; the layer keeps ``H_kv * keep`` tokens per batch row.
        head_floor (float): In [0, 1]: each head keeps at least ``ceil(head_floor * keep)`` tokens. ``1`` gives the
            uniform budget (the same tokens as a per-head top-``keep``).

    Returns:
        torch.Tensor: (B, H_kv, S) bool, True = kept; ``H_kv * keep`` True per batch row.
    """
    heads, floor = order.shape[1], head_floor_count(keep, head_floor)
    order = order.float()
    best = _best_per_head(order, floor)
    if floor == keep:  # every head's floor is its whole share: the uniform budget
        return best
    finite = torch.isfinite(order)
    values = torch.where(finite, order, torch.zeros_like(order))
    count = finite.sum(-1, keepdim=True).clamp_min(1)
    mean = values.sum(-1, keepdim=True) / count
    std = (((values - mean) * finite).pow(2).sum(-1, keepdim=True) / count).sqrt()
    z = torch.where(finite, (order - mean) / std.clamp_min(torch.finfo(torch.float32).tiny), order)  # -inf stays
    return _floors_then_lowest([best], [z], heads * keep)[0]


def global_keep(orders: Sequence[torch.Tensor], keep: int, head_floor: float) -> list[torch.Tensor]:
    """Which pairs every layer keeps under one threshold over the whole cache (KVzip's pair-level eviction).

    Args:
        orders (sequence of torch.Tensor): Per layer, the (B, H_kv, S) eviction order (low = kept, protected tokens
            ``-inf``), on one scale across layers and heads.
        keep (int): The uniform count per head; the cache keeps ``layers * H_kv * keep`` pairs per batch row.
        head_floor (float): In [0, 1]: each head first keeps its best ``ceil(head_floor * keep)``.

    Returns:
        list of torch.Tensor: per layer, (B, H_kv, S) bool, True = kept; ``layers * H_kv * keep`` True per batch row
        in all. Ties are broken by (layer, head, position), as a stable sort of the concatenated orders gives them.
    """
    floor = head_floor_count(keep, head_floor)
    orders = [order.float() for order in orders]
    return _floors_then_lowest([_best_per_head(order, floor) for order in orders], orders,
                               keep * sum(order.shape[1] for order in orders))


def _best_per_head(order: torch.Tensor, floor: int) -> torch.Tensor:
    """(B, H, S) bool: each head's ``floor`` lowest entries of ``order`` (ties to the lower position)."""
    return order.argsort(dim=-1, stable=True).argsort(dim=-1) < floor


def _floors_then_lowest(floors: Sequence[torch.Tensor], compared: Sequence[torch.Tensor],
                        total: int) -> list[torch.Tensor]:
    """Per part (a layer), (B, H, S) bool: the ``floors`` (each head's own best), then the lowest ``compared`` values
    of all parts together until ``total`` per batch row; ties to the lower (part, head, position), by a stable sort
    of the flattened parts (the references' order)."""
    flat = torch.cat([values.masked_fill(floor, float("-inf")).flatten(1) for floor, values in zip(floors, compared)],
                     dim=-1)  # (B, parts * H * S): the floors sort first, with the protected tokens (-inf already)
    kept = torch.zeros_like(flat, dtype=torch.bool).scatter(1, flat.argsort(dim=-1, stable=True)[:, :total], True)
    return [part.view(floor.shape) for part, floor in zip(kept.split([floor[0].numel() for floor in floors], -1),
                                                          floors)]


def allocate(total: int, weights: Sequence[float], low: Sequence[int], high: Sequence[int]) -> list[int]:
    """Integer counts ``c_i`` in ``[low_i, high_i]`` summing to ``total``, proportional to ``weights`` where the bounds
    allow (water-filling, then largest remainders; ties to the lower index)."""
    n = len(weights)
    if not sum(low) <= total <= sum(high):
        raise ValueError(f"Cannot place {total} tokens in layers holding between {sum(low)} and {sum(high)}.")
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = total - sum(fixed.values())
        weight = sum(weights[i] for i in free)
        share = {i: left * weights[i] / weight if weight > 0 else left / len(free) for i in free}
        clamped = {i: min(max(share[i], low[i]), high[i]) for i in free if not low[i] <= share[i] <= high[i]}
        if not clamped:
            break
        fixed.update(clamped)
    real = [fixed.get(i, share.get(i, 0.0)) for i in range(n)]
    counts = [min(max(math.floor(x), low[i]), high[i]) for i, x in enumerate(real)]
    remainders = sorted(range(n), key=lambda i: (-(real[i] - math.floor(real[i])), i))
    while sum(counts) < total:
        for i in remainders:
            if sum(counts) < total and counts[i] < high[i]:
                counts[i] += 1
    while sum(counts) > total:
        for i in reversed(remainders):
            if sum(counts) > total and counts[i] > low[i]:
                counts[i] -= 1
    return counts


def layer_dispersion(order: torch.Tensor) -> float:
    """A layer's coefficient of variation of the importance, ``std / |mean|`` over its finite (B, H_kv, S) ``order``
    entries (fp32; ``0`` when there are none)."""
    values = order.float()
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return 0.0
    return float(values.std(unbiased=False) / values.mean().abs().clamp_min(torch.finfo(torch.float32).tiny))


def layer_keep_counts(schedule: str, prompt_length: int, keep: int, num_layers: int, low: int = 1,
                      dispersions: Sequence[float] | None = None, skip_layers: int = 2) -> list[int]:
    """Kept tokens per head for each of ``num_layers`` layers, totalling ``num_layers * keep``.

    Args:
        schedule (str): ``"uniform"``, ``"skip_first"`` or ``"dispersion"`` (see the module docstring).
        prompt_length (int): Tokens in the prompt (a layer keeps at most this many).
        keep (int): The uniform count per head.
        low (int): The least a layer keeps (the protected tokens, at least 1).
        dispersions (sequence of float): Per-layer :func:`layer_dispersion`, needed by ``"dispersion"``.
        skip_layers (int): Layers left uncompressed by ``"skip_first"`` (the authors' code: 2).
    """
    total = num_layers * keep
    if schedule == "uniform":
        return [keep] * num_layers
    lows, highs = [low] * num_layers, [prompt_length] * num_layers
    if schedule == "skip_first":
        skipped = min(skip_layers, num_layers)
        if skipped * prompt_length + (num_layers - skipped) * low > total:
            raise ValueError(
                f"layer_budget='skip_first' keeps layers 0-{skipped - 1} whole ({prompt_length} tokens each), which "
                f"leaves fewer than {low} tokens per head for the other layers at this ratio; use a lower "
                "compression_ratio or layer_budget='uniform'."
            )
        lows[:skipped] = [prompt_length] * skipped
        return allocate(total, [0.0] * skipped + [1.0] * (num_layers - skipped), lows, highs)
    if schedule == "dispersion":
        if dispersions is None or len(dispersions) != num_layers:
            raise ValueError("layer_budget='dispersion' needs one dispersion per layer.")
        mean = sum(dispersions) / num_layers
        relative = [d / mean if mean > 0 else 1.0 for d in dispersions]
        return allocate(total, [1.0 / (1.0 + r) for r in relative], lows, highs)
    raise ValueError(f"Unknown layer_budget {schedule!r}; use one of {', '.join(LAYER_BUDGETS)}.")
