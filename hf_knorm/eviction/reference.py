"""A plain reference for KNorm eviction (arXiv 2406.11430), written for reading and for tests, not for speed.

It works on a *full* ``DynamicCache`` after an ordinary prefill: per layer, batch row and KV head, compute each prompt
token's importance one token at a time (:func:`reference_importance`: the key L2 norm of the paper, or another score of
:mod:`hf_knorm.eviction.scores` written out by hand), sort the tokens (a stable sort, protected tokens first, then by
decreasing importance), keep the first ``ceil((1 - r) * n)``, gather them in position order; then decode greedily token by token with explicit position ids (the true positions), so a cache
holding fewer tokens than were seen still rotates new tokens correctly. :class:`~hf_knorm.KNormCache` must agree
with it: same kept indices, same generated tokens.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from ..compat import cache_kwargs, output_cache


def reference_importance(score: str, k: torch.Tensor, v: torch.Tensor, draws: torch.Tensor | None = None,
                         pool: int = 1) -> list[float]:
    """Importance (higher = kept) of each token of one head, token by token, as :mod:`hf_knorm.eviction.scores` defines it.

    Args:
        score (str): ``"key_norm"``, ``"value_over_key"``, ``"key_diff"``, ``"kv_diff"``, ``"recent"`` or
            ``"random"``.
        k, v (torch.Tensor): (n, D) fp32 keys and values of the head.
        draws (torch.Tensor, optional): (n,) the uniform draws of ``"random"`` for this head.
        pool (int): The window of ``key_diff`` / ``kv_diff`` (odd).
    """
    n = k.shape[0]
    norm = lambda x: float(torch.linalg.vector_norm(x))

    def distinct(x):  # -cos(x_i, mean of the unit vectors)
        anchor = sum(x[i] / norm(x[i]) for i in range(n)) / n
        return [-float(x[i] @ anchor) / (norm(x[i]) * norm(anchor)) for i in range(n)]

    def standardized(xs):
        mean = sum(xs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
        return [(x - mean) / max(std, 1e-12) for x in xs]

    def window_mean(xs):
        half = pool // 2
        return [sum(xs[max(0, i - half):i + half + 1]) / len(xs[max(0, i - half):i + half + 1]) for i in range(n)]

    if score == "key_norm":
        return [-norm(k[i]) for i in range(n)]
    if score == "value_over_key":
        return [norm(v[i]) / norm(k[i]) for i in range(n)]
    if score == "key_diff":
        return window_mean(distinct(k))
    if score == "kv_diff":
        return window_mean([a + b for a, b in zip(standardized(distinct(k)), standardized(distinct(v)))])
    if score == "recent":
        return [float(i) for i in range(n)]
    if score == "random":
        return [float(draws[i]) for i in range(n)]
    raise ValueError(f"No reference for score {score!r}.")


def reference_kept_indices(
    keys: torch.Tensor,
    ratio: float,
    sink_tokens: int = 0,
    recent_window: int = 0,
    key_scale: torch.Tensor | None = None,
    *,
    values: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    score="key_norm",
    layer_idx: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """Kept positions of one layer's prompt tokens.

    Args:
        keys (torch.Tensor): (B, H_kv, n, D) post-RoPE prompt keys.
        ratio (float): Fraction evicted; ``ceil((1 - ratio) * n)`` tokens are kept (at least the protected ones).
        sink_tokens, recent_window (int): The first / last tokens never evicted.
        key_scale (torch.Tensor, optional): (H_kv, D): score ``k * s`` instead of ``k`` (``||k * s||`` for key_norm).
        values (torch.Tensor, optional): (B, H_kv, n, D) values; needed by value-based scores.
        value_scale (torch.Tensor, optional): (H_kv, D): score ``v / t`` instead of ``v``.
        score (str or score object): A name (see :func:`reference_importance`) or a score instance, whose ``pool`` and
            ``seed`` are read; ``layer_idx`` and ``seed`` seed ``"random"``'s draws.

    Returns:
        torch.Tensor: (B, H_kv, k) int64 positions, increasing along the last axis.
    """
    batch, heads, n, _ = keys.shape
    keep = max(n - math.floor(round(ratio * n, 6)), min(n, 1), min(n, sink_tokens + recent_window))
    pool = getattr(score, "pool", {"kv_diff": 5}.get(score, 1))
    seed = getattr(score, "seed", seed)
    score = getattr(score, "name", score)
    draws = None
    if score == "random":  # the same draws as hf_knorm.eviction.scores.Random: one generator per (seed, layer)
        draws = torch.rand((batch, heads, n), generator=torch.Generator().manual_seed(seed * 1_000_003 + layer_idx))
    rows = []
    for b in range(batch):
        per_head = []
        for h in range(heads):
            k = keys[b, h].detach().float()
            if key_scale is not None:
                k = k * key_scale[h].float()
            v = values[b, h].detach().float() if values is not None else torch.zeros_like(k)
            if value_scale is not None:
                v = v / value_scale[h].float()
            importance = reference_importance(score, k, v, None if draws is None else draws[b, h], pool)
            protected = [i < sink_tokens or i >= n - recent_window for i in range(n)]
            order = sorted(range(n), key=lambda i: (not protected[i], -importance[i]))
            per_head.append(sorted(order[:keep]))
        rows.append(per_head)
    return torch.tensor(rows, dtype=torch.long, device=keys.device)


def reference_head_adaptive_kept(keys: torch.Tensor, ratio: float, head_floor: float, *,
                                 values: torch.Tensor | None = None, score: str = "key_norm", sink_tokens: int = 0,
                                 recent_window: int = 0) -> list[list[list[int]]]:
    """Kept positions of one layer's prompt under AdaKV's head-adaptive budget (arXiv 2407.11550), by plain loops.

    Per batch row: ``k = ceil((1 - ratio) * n)`` (at least the protected tokens); every head first keeps its best
    ``ceil(head_floor * k)`` tokens (protected first, then by decreasing importance, ties to the lower position); the
    remaining ``H_kv * (k - floor)`` go to the tokens of the whole layer with the highest per-head z-score of the
    importance (``(x - mean) / std`` over the head's unprotected tokens, population std), protected tokens first, ties
    to the lower (head, position).

    Args:
        keys, values (torch.Tensor): (B, H_kv, n, D) prompt keys / values.

    Returns:
        list: per batch row, per head, the kept positions in increasing order.
    """
    batch, heads, n, _ = keys.shape
    keep = max(n - math.floor(round(ratio * n, 6)), min(n, 1), min(n, sink_tokens + recent_window))
    floor = min(keep, math.ceil(round(head_floor * keep, 6)))
    result = []
    for b in range(batch):
        candidates, kept = [], []
        for h in range(heads):
            k = keys[b, h].float()
            v = values[b, h].float() if values is not None else torch.zeros_like(k)
            importance = reference_importance(score, k, v, None, {"kv_diff": 5}.get(score, 1))
            protected = [i < sink_tokens or i >= n - recent_window for i in range(n)]
            free = [importance[i] for i in range(n) if not protected[i]]
            mean = sum(free) / max(len(free), 1)
            std = math.sqrt(sum((x - mean) ** 2 for x in free) / max(len(free), 1))
            own = sorted(range(n), key=lambda i: (not protected[i], -importance[i], i))
            kept.append(set(own[:floor]))
            for i in own[floor:]:
                z = (importance[i] - mean) / std if std > 0 else 0.0
                candidates.append((not protected[i], -z, h, i))
        for _, _, h, i in sorted(candidates)[: heads * (keep - floor)]:
            kept[h].add(i)
        result.append([sorted(head) for head in kept])
    return result


def reference_global_kept(importance: list[torch.Tensor], ratio: float, head_floor: float, *, sink_tokens: int = 0,
                          recent_window: int = 0) -> list[list[list[list[int]]]]:
    """Kept positions of every layer's prompt under one threshold over the whole cache (KVzip's pair-level eviction,
    arXiv 2505.23416; ``layer_budget="global"``), by plain loops.

    Per batch row: ``k = ceil((1 - ratio) * n)`` (at least the protected tokens); every head of every layer first keeps
    its best ``ceil(head_floor * k)`` tokens (protected first, then by decreasing importance, ties to the lower
    position); the remaining ``layers * H_kv * k`` minus those go to the highest importance anywhere, protected first,
    ties to the lower (layer, head, position).

    Args:
        importance (list of torch.Tensor): per layer, (B, H_kv, n) importance (higher = kept).

    Returns:
        list: per layer, per batch row, per head, the kept positions in increasing order.
    """
    batch, heads, n = importance[0].shape
    keep = max(n - math.floor(round(ratio * n, 6)), min(n, 1), min(n, sink_tokens + recent_window))
    floor = min(keep, math.ceil(round(head_floor * keep, 6)))
    protected = [i < sink_tokens or i >= n - recent_window for i in range(n)]
    result = [[[set() for _ in range(heads)] for _ in range(batch)] for _ in importance]
    for b in range(batch):
        candidates, forced = [], 0
        for layer, scores in enumerate(importance):
            for h in range(heads):
                values = scores[b, h].tolist()
                own = sorted(range(n), key=lambda i: (not protected[i], -values[i], i))
                result[layer][b][h].update(own[:floor])
                forced += min(floor, n)
                candidates += [(not protected[i], -values[i], layer, h, i) for i in own[floor:]]
        for _, _, layer, h, i in sorted(candidates)[: len(importance) * heads * keep - forced]:
            result[layer][b][h].add(i)
    return [[[sorted(head) for head in row] for row in layer] for layer in result]


def reference_compress(cache: DynamicCache, ratio: float, **options) -> tuple[DynamicCache, list[torch.Tensor]]:
    """Gather the kept tokens of every layer of a full cache into a new ``DynamicCache``.

    Returns the new cache (layers of shape (B, H_kv, k, D)) and the kept positions per layer (B, H_kv, k).
    ``options`` go to :func:`reference_kept_indices` (``key_scales`` and ``value_scales`` as per-layer lists).
    """
    scales = options.pop("key_scales", None)
    value_scales = options.pop("value_scales", None)
    data, kept = [], []
    for index, layer in enumerate(cache.layers):
        idx = reference_kept_indices(layer.keys, ratio, key_scale=None if scales is None else scales[index],
                                     values=layer.values, layer_idx=index,
                                     value_scale=None if value_scales is None else value_scales[index], **options)
        gather = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        data.append((layer.keys.gather(2, gather), layer.values.gather(2, gather)))
        kept.append(idx)
    return DynamicCache(data), kept


@torch.no_grad()
def reference_generate(model, input_ids: torch.Tensor, ratio: float, max_new_tokens: int, **options):
    """Greedy decoding after reference eviction of the prompt's cache.

    Args:
        model (PreTrainedModel): A decoder-only causal LM with full-attention layers.
        input_ids (torch.Tensor): (B, n) unpadded prompt.
        ratio, options: As for :func:`reference_compress`.

    Returns:
        tuple: (generated ids (B, max_new_tokens), list of next-token logits (B, V) per step, kept positions per layer).
    """
    n = input_ids.shape[1]
    out = model(input_ids=input_ids, **cache_kwargs(DynamicCache()), use_cache=True)
    cache, kept = reference_compress(output_cache(out), ratio, **options)
    logits = [out.logits[:, -1].float()]
    tokens = [logits[-1].argmax(-1)]
    for step in range(1, max_new_tokens):
        position = torch.full((input_ids.shape[0], 1), n + step - 1, dtype=torch.long, device=input_ids.device)
        out = model(input_ids=tokens[-1][:, None], position_ids=position, **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, dim=1), logits, kept


def reference_max_weights(query: torch.Tensor, key: torch.Tensor, scored: int, scaling: float | None = None,
                          attention_mask: torch.Tensor | None = None):
    """The importance of :func:`hf_knorm.eviction.max_weight.attention_with_max_weights` by materializing every weight,
    in fp64.

    The (B, H_q, m, L) logits ``scaling * q k^T`` (KV head ``h // group`` for query head ``h``), masked by the
    boolean (B or 1, 1, m, L) ``attention_mask`` (``True`` = attended; default: causal for the last ``m`` keys), a
    softmax over each row (a fully masked row: zeros), the first ``scored`` columns, the maximum over rows and the
    group's heads. Returns (B, H_kv, scored) fp64.
    """
    batch, query_heads, rows, dim = query.shape
    heads, length = key.shape[1], key.shape[2]
    group = query_heads // heads
    scaling = dim ** -0.5 if scaling is None else scaling
    keys = key.double().repeat_interleave(group, dim=1)  # (B, H_q, L, D)
    logits = scaling * query.double() @ keys.transpose(-1, -2)
    if attention_mask is None:
        attention_mask = torch.ones(rows, length, dtype=torch.bool, device=query.device).tril(diagonal=length - rows)
    weights = logits.masked_fill(~attention_mask, float("-inf")).softmax(dim=-1).nan_to_num(0.0)[..., :scored]
    return weights.reshape(batch, heads, group, rows, scored).amax(dim=(2, 3))


@torch.no_grad()
def reference_kvzip_importance(model, context_ids: torch.Tensor, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """KVzip's importance (arXiv 2505.23416) from the weights Transformers' eager attention returns.

    For every reconstruction chunk (:func:`hf_knorm.eviction.reconstruction.reconstruction_chunks`) the model reads
    ``context + chunk`` in one forward with ``output_attentions=True``; the rows of the chunk's tokens and the
    columns of the context are kept, and the maximum is taken over those rows, the query heads of each KV head and
    the chunks. ``model`` must run with ``attn_implementation="eager"`` (full-attention layers only).

    Returns:
        list: per layer, (B, H_kv, n) fp64.
    """
    n = context_ids.shape[1]
    heads = model.config.num_key_value_heads
    result = None
    for chunk in chunks:
        ids = torch.cat([context_ids, chunk], dim=1)
        attentions = model(input_ids=ids, output_attentions=True).attentions  # per layer (B, H_q, T, T)
        per_layer = []
        for weights in attentions:
            batch, query_heads = weights.shape[:2]
            rows = weights[:, :, n:, :n].double()  # the chunk's queries on the context's keys
            per_layer.append(rows.reshape(batch, heads, query_heads // heads, -1, n).amax(dim=(2, 3)))
        result = per_layer if result is None else [torch.maximum(a, b) for a, b in zip(result, per_layer)]
    return result
