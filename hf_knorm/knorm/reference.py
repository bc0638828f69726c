"""A plain reference for KNorm eviction (arXiv 2406.11430), written for reading and for tests, not for speed.

It works on a *full* ``DynamicCache`` after an ordinary prefill: per layer, batch row and KV head, sort the prompt's
keys by L2 norm (a stable sort, protected tokens first), keep the first ``ceil((1 - r) * n)``, gather them in
position order; then decode greedily token by token with explicit position ids (the true positions), so a cache
holding fewer tokens than were seen still rotates new tokens correctly. :class:`~hf_knorm.KNormCache` must agree
with it: same kept indices, same generated tokens.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache


def reference_kept_indices(
    keys: torch.Tensor,
    ratio: float,
    sink_tokens: int = 0,
    recent_window: int = 0,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept positions of one layer's prompt keys.

    Args:
        keys (torch.Tensor): (B, H_kv, n, D) post-RoPE prompt keys.
        ratio (float): Fraction evicted; ``ceil((1 - ratio) * n)`` tokens are kept (at least the protected ones).
        sink_tokens, recent_window (int): The first / last tokens never evicted.
        key_scale (torch.Tensor, optional): (H_kv, D): score ``||k * s||`` instead of ``||k||``.

    Returns:
        torch.Tensor: (B, H_kv, k) int64 positions, increasing along the last axis.
    """
    batch, heads, n, _ = keys.shape
    keep = max(n - math.floor(round(ratio * n, 6)), min(n, 1), min(n, sink_tokens + recent_window))
    rows = []
    for b in range(batch):
        per_head = []
        for h in range(heads):
            k = keys[b, h].detach().float()
            if key_scale is not None:
                k = k * key_scale[h].float()
            norms = [float(torch.linalg.vector_norm(k[i])) for i in range(n)]
            protected = [i < sink_tokens or i >= n - recent_window for i in range(n)]
            order = sorted(range(n), key=lambda i: (not protected[i], norms[i]))
            per_head.append(sorted(order[:keep]))
        rows.append(per_head)
    return torch.tensor(rows, dtype=torch.long, device=keys.device)


def reference_compress(cache: DynamicCache, ratio: float, **options) -> tuple[DynamicCache, list[torch.Tensor]]:
    """Gather the kept tokens of every layer of a full cache into a new ``DynamicCache``.

    Returns the new cache (layers of shape (B, H_kv, k, D)) and the kept positions per layer (B, H_kv, k).
    ``options`` go to :func:`reference_kept_indices` (``key_scales`` as a per-layer list).
    """
    scales = options.pop("key_scales", None)
    data, kept = [], []
    for index, layer in enumerate(cache.layers):
        idx = reference_kept_indices(layer.keys, ratio, key_scale=None if scales is None else scales[index], **options)
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
    out = model(input_ids=input_ids, cache=DynamicCache(), use_cache=True)
    cache, kept = reference_compress(out.cache, ratio, **options)
    logits = [out.logits[:, -1].float()]
    tokens = [logits[-1].argmax(-1)]
    for step in range(1, max_new_tokens):
        position = torch.full((input_ids.shape[0], 1), n + step - 1, dtype=torch.long, device=input_ids.device)
        out = model(input_ids=tokens[-1][:, None], position_ids=position, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, dim=1), logits, kept
