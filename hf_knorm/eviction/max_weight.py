"""The largest softmax weight each cached key receives from a block of queries, without the ``m x n`` weight matrix.

KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416) scores
a cached pair by the largest attention weight any query of a reconstruction pass gives it:

    score[b, g, j] = max over query rows i and query heads h of KV head g of  softmax_j'(s[b, h, i, j'])[j],
    s[b, h, i, j] = scaling * <q[b, h, i], k[b, g, j]>,

the softmax taken over the whole row (every key the query sees, causally). :func:`max_attention_weights` computes it
in two passes over blocks of keys, in plain PyTorch, holding one ``(B, H_kv, group * m, block)`` tile at a time:

1. each row's log-sum-exp ``lse_i`` (running maximum and rescaled sum, the online softmax of FlashAttention);
2. for the keys to score, ``max_i exp(s_ij - lse_i)``, maximized block by block.

So no attention weight comes from the model's attention implementation (SDPA, flash) and no ``N x N`` matrix is
built. The plain reference that materializes the weights is
:func:`hf_knorm.eviction.reference.reference_max_weights`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TILE_ELEMENTS", "max_attention_weights"]

TILE_ELEMENTS = 1 << 24  # scores held per tile (64 MiB in fp32); the key block is sized to stay under it


def max_attention_weights(query: torch.Tensor, key: torch.Tensor, scored: int, scaling: float | None = None,
                          block: int | None = None) -> torch.Tensor:
    """The largest softmax weight each of the first ``scored`` keys receives from any query of its KV head's group.

    Args:
        query (torch.Tensor): (B, H_q, m, D) post-RoPE queries: the *last* ``m`` positions of the sequence whose keys
            are ``key``; query ``i`` sees keys ``0 .. L - m + i`` (causal).
        key (torch.Tensor): (B, H_kv, L, D) post-RoPE keys, ``L >= m``, not repeated for GQA (query head ``h`` reads
            KV head ``h // (H_q // H_kv)``, Transformers' ``repeat_kv`` order).
        scored (int): How many leading keys to score, at most ``L - m`` (keys every query sees: the cached context).
        scaling (float, optional): The logit scale; default ``1 / sqrt(D)`` (SDPA's).
        block (int, optional): Keys per tile; default: as many as keep a tile under :data:`TILE_ELEMENTS` scores.

    Returns:
        torch.Tensor: (B, H_kv, scored), in fp32 (fp64 for fp64 inputs): the maximum over the group's query heads and
        the ``m`` rows of each key's softmax weight.
    """
    batch, query_heads, rows, dim = query.shape
    _, heads, length, _ = key.shape
    if query_heads % heads:
        raise ValueError(f"{query_heads} query heads do not share {heads} KV heads evenly.")
    offset = length - rows  # keys before the queries' own
    if offset < 0 or not 0 <= scored <= offset:
        raise ValueError(f"max_attention_weights scores keys every query sees: need scored <= L - m, got "
                         f"scored={scored}, L={length}, m={rows}.")
    group = query_heads // heads
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
    q = (query.to(dtype) * scale).reshape(batch, heads, group * rows, dim)  # rows of a KV head's group, head-major
    if block is None:
        block = max(1, TILE_ELEMENTS // max(1, batch * query_heads * rows))
    row = torch.arange(rows, device=query.device).repeat(group)  # (group * m,) each flattened row's query index

    peak = torch.full((batch, heads, group * rows), float("-inf"), dtype=dtype, device=query.device)
    total = torch.zeros_like(peak)
    for start in range(0, length, block):  # pass 1: lse_i over every key the row sees
        logits = q @ key[:, :, start:start + block].to(dtype).transpose(-1, -2)  # (B, H_kv, group * m, block)
        if start + logits.shape[-1] > offset:  # the queries' own keys: causal
            columns = torch.arange(start, start + logits.shape[-1], device=query.device)
            logits.masked_fill_(columns[None, :] > offset + row[:, None], float("-inf"))
        new_peak = torch.maximum(peak, logits.amax(-1))
        total = total * torch.exp(peak - new_peak) + logits.sub_(new_peak[..., None]).exp_().sum(-1)  # in place
        peak = new_peak
    lse = (peak + torch.log(total))[..., None]  # (B, H_kv, group * m, 1); key 0 is seen by every row: finite

    out = torch.empty(batch, heads, scored, dtype=dtype, device=query.device)
    for start in range(0, scored, block):  # pass 2: max_i exp(s_ij - lse_i) over the scored keys (no mask needed)
        stop = min(scored, start + block)
        logits = q @ key[:, :, start:stop].to(dtype).transpose(-1, -2)
        out[..., start:stop] = logits.sub_(lse).amax(-2).exp()  # exp is monotone: one exp per key
    return out
