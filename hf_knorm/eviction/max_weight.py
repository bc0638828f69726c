"""Softmax attention that also returns the largest weight each cached key receives, in one pass over the scores.

KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416) scores
a cached pair by the largest attention weight any query of a reconstruction pass gives it:

    score[b, g, j] = max over query rows i and query heads h of KV head g of  softmax_j'(s[b, h, i, j'])[j],
    s[b, h, i, j] = scaling * <q[b, h, i], k[b, g, j]>  (+ the attention mask),

the softmax taken over the whole row (every key the query sees). The reconstruction needs the attention's output as
well, so :func:`attention_with_max_weights` computes both from the same scores, in plain PyTorch, one block of query
rows at a time: per block, one ``q k^T`` tile ``(B, H_kv, group * m_b, L_b)`` (the block's rows of every query head
of a KV head's group, against the keys any of them sees), the mask, the softmax in fp32 (fp64 for fp64 inputs), the
output rows ``weights @ V``, and the running maximum of the weights over the block's rows. A boolean mask's leading
columns that every row attends (the cached context of a reconstruction) are not masked column by column. No ``N x N``
matrix is held beyond one tile (:data:`TILE_ELEMENTS` scores), and no weight comes from the model's attention
implementation.
The plain references are :func:`hf_knorm.eviction.reference.reference_max_weights` (the weights materialized) and
``torch.nn.functional.scaled_dot_product_attention`` (the output).
"""

from __future__ import annotations

import math

import torch

__all__ = ["TILE_ELEMENTS", "attention_with_max_weights"]

TILE_ELEMENTS = 1 << 21
"""Scores held per tile (8 MiB in fp32); the block of query rows is sized to stay under it. Measured on one CPU thread
against ``1 << 23`` (scripts/knorm/bench_kvzip_cost.py's shapes: 9/3 heads, a 2,068-row chunk over 1k-4k cached
keys): 0.74-0.85x the time; ``1 << 19`` to ``1 << 22`` within 0.1x of it."""


def attention_with_max_weights(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scored: int, scaling: float | None = None,
                               is_causal: bool = True, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` over ``key`` / ``value`` and the largest weight each of the first ``scored``
    keys receives from any query row of its KV head's group.

    Args:
        query (torch.Tensor): (B, H_q, m, D) post-RoPE queries: the *last* ``m`` positions of the sequence whose keys
            are ``key``.
        key (torch.Tensor): (B, H_kv, L, D) post-RoPE keys, ``L >= m``, not repeated for GQA (query head ``h`` reads
            KV head ``h // (H_q // H_kv)``, Transformers' ``repeat_kv`` order).
        value (torch.Tensor): (B, H_kv, L, D_v) values.
        attention_mask (torch.Tensor, optional): (B or 1, 1, m, L) or longer in the last axis (cut to ``L``, as
            Transformers' SDPA attention does): boolean (``True`` = attended, Transformers' ``sdpa_mask``) or
            additive float. ``None``: causal with the queries at the end (query ``i`` sees keys ``0 .. L - m + i``)
            when ``is_causal``, every key otherwise.
        scored (int): How many leading keys to score, ``0 <= scored <= L``.
        scaling (float, optional): The logit scale; default ``1 / sqrt(D)`` (SDPA's).
        is_causal (bool): Whether the attention is causal (the module's flag; read only without a mask).
        rows (int, optional): Query rows per tile; default: as many as keep a tile under :data:`TILE_ELEMENTS`.

    Returns:
        tuple: the (B, H_q, m, D_v) output in ``query``'s dtype (what SDPA returns: a fully masked row gives zeros),
        and the (B, H_kv, scored) largest weights, in fp32 (fp64 for fp64 inputs): the maximum over the group's query
        heads and the ``m`` rows of each key's softmax weight (0 for a key no row sees).
    """
    batch, query_heads, length_q, dim = query.shape
    _, heads, length, _ = key.shape
    if query_heads % heads:
        raise ValueError(f"{query_heads} query heads do not share {heads} KV heads evenly.")
    if length < length_q or not 0 <= scored <= length:
        raise ValueError(f"attention_with_max_weights needs m <= L and 0 <= scored <= L, got m={length_q}, L={length}, "
                         f"scored={scored}.")
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-2] != length_q:
            raise ValueError(f"attention_with_max_weights takes a (B or 1, 1, m, L) mask shared by the heads, got "
                             f"{tuple(attention_mask.shape)} for m={length_q}.")
        attention_mask = attention_mask[..., :length]
    group, offset = query_heads // heads, length - length_q
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
    keys, values = key.to(dtype), value.to(dtype)
    if rows is None:
        rows = max(1, TILE_ELEMENTS // max(1, batch * query_heads * length))
    # the keys a block of rows [start, stop) reaches: the causal bound, or its boolean mask's last True column + 1
    reaches, open_front = None, 0
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # the cached keys every row attends (a reconstruction's context): masked nowhere, so not masked column by column
        open_front = offset if offset and bool(attention_mask[..., :offset].view(torch.uint8).amin()) else 0
        reaches = _reaches(attention_mask, rows)

    output = query.new_empty(batch, heads, group, length_q, value.shape[-1])
    importance = torch.zeros(batch, heads, scored, dtype=dtype, device=query.device)
    for start in range(0, length_q, rows):
        stop = min(length_q, start + rows)
        if reaches is not None:
            columns = max(1, reaches[start // rows])  # >= 1: a fully masked block still gives zeros
        elif attention_mask is None and is_causal:
            columns = offset + stop
        else:
            columns = length
        q = (query[:, :, start:stop].to(dtype) * scale).reshape(batch, heads, group * (stop - start), dim)
        logits = q @ keys[:, :, :columns].transpose(-1, -2)  # (B, H_kv, group * m_b, L_b), head-major rows
        tile = logits.view(batch, heads, group, stop - start, columns)
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:  # (B or 1, 1, 1, m_b, L_b), the open front left out
                tile[..., open_front:].masked_fill_(~attention_mask[:, :, None, start:stop, open_front:columns],
                                                    float("-inf"))
            else:
                tile.add_(attention_mask[:, :, None, start:stop, :columns].to(dtype))
        elif is_causal:  # row i sees keys 0 .. offset + i
            index = torch.arange(start, stop, device=query.device)
            tile.masked_fill_(torch.arange(columns, device=query.device) > offset + index[:, None], float("-inf"))
        peak = logits.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # a fully masked row: 0, its exps all 0
        weights = logits.sub_(peak).exp_()
        weights.div_(weights.sum(-1, keepdim=True).clamp_min_(1.0))  # the peak's exp is 1: only fully masked rows clamp
        output[:, :, :, start:stop] = (weights @ values[:, :, :columns]).view(batch, heads, group, stop - start, -1)
        seen = min(scored, columns)
        torch.maximum(importance[..., :seen], weights[..., :seen].amax(-2), out=importance[..., :seen])
    return output.view(batch, query_heads, length_q, -1), importance


def _reaches(mask: torch.Tensor, rows: int) -> list[int]:
    """For each block of ``rows`` query rows of the boolean ``(B or 1, 1, m, L)`` mask, one past the last column any
    of its rows attends (0: none). Read from the mask's bytes, one pass (an index tensor of the mask's size cost 15%
    of a reconstruction layer's attention at 4k keys, a ``bool`` reduction 4%), and one transfer to the host."""
    attended = torch.stack([mask[..., start:start + rows, :].view(torch.uint8).amax(dim=-2).flatten(0, -2).amax(dim=0)
                            for start in range(0, mask.shape[-2], rows)])  # (blocks, L), 1 where a row attends
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (attended * columns).amax(dim=-1).tolist()
