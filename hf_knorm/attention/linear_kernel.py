"""Linear-time attention for ``p = 1`` (``x/c``): the chunkwise form for prefill and training, a state for decoding.

With ``p = 1`` the normalization of "Rethinking Softmax" (arXiv 2410.18613) is linear attention (Katharopoulos et
al., "Transformers are RNNs", arXiv 2006.16236) with the identity feature map: for a causal row ``i``,

    o_i = (scaling / c_i) * q_i^T S_i,      S_i = sum_{j <= i, j valid} k_j v_j^T    (a D x D_v state per KV head)

so nothing of size N x N is needed. The chunkwise form (flash-linear-attention's "chunk" kernels; Yang et al.,
"Gated Linear Attention", arXiv 2312.06635) splits the queries into chunks of C rows; with ``S_t`` the state of every
key before chunk ``t``:

    O_t = a * (Q_t S_t + tril(Q_t K_t^T) V_t),      S_{t+1} = S_t + K_t^T V_t.

All chunks are computed at once (the states are an exclusive cumulative sum over chunks), in time and memory linear
in N: ``O(N * (D * D_v + C * (D + D_v)))`` per query head. Autograd differentiates it (the saved activations are
linear in N too). GQA groups the query heads of each KV head; K and V are never repeated.

Masking. Invalid (padded) keys are zeroed, so they add nothing to any state. Queries sit at the *bottom right* of
the keys, as in Transformers' masks with a cache: query ``i`` is at key position ``kv - q + i``, and the first
``kv - q`` keys (the cache) are visible to every query. ``c = sqrtN`` divides row ``i`` by the square root of its
count of valid keys, like the quadratic kernel.

The squared Frobenius norm of each attention matrix (the norm recorder's figure) needs a second state:
``||A||_F^2 = sum_i a_i^2 q_i^T (sum_{j <= i} k_j k_j^T) q_i``, the same chunkwise sum with ``K^T K`` in place of
``K^T V``. ``reference.py`` and the quadratic ``kernel.py`` are what this is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .full_precision import full_precision
from ..normalizations import Normalization

DEFAULT_CHUNK_SIZE = 64
"""Query rows per chunk (docs/results/attention.md, "Linear-time x/1": 64 was the fastest of 32-256 on the layer
benchmark)."""
SEGMENT_ELEMENTS = 1 << 21
"""Scores per segment (``B * H_q * rows * C``; 8 MiB in fp32): the chunks of a segment are computed at once, the
segments one after the other carrying the state, so the working set stays the same size whatever N."""


def is_linear(normalization: Normalization) -> bool:
    """Whether ``normalization`` is linear attention (an element-wise weight ``s / c`` or ``s / sqrt(n)``, its
    :attr:`~hf_knorm.normalizations.routes.Pointwise.is_linear`: ``x/c``, ``x/sqrtN``), or has it beside a softmax
    window."""
    pointwise = normalization.without_window.pointwise
    return pointwise is not None and pointwise.is_linear


@full_precision
def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    normalization: Normalization,
    *,
    scaling: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_count: torch.Tensor | None = None,
    frobenius_sq: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_state: bool = False,
):
    """Causal attention with a ``p = 1`` normalization, in time and memory linear in the sequence length.

    Args:
        query: ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``kv >= q``,
            ``H_q % H_kv == 0``. Query ``i`` sits at key position ``kv - q + i`` (bottom-right causal).
        key_valid: bool ``(B, kv)`` (False = a padded key that nobody attends), or ``None`` (every key valid).
        normalization: ``x/c`` or ``x/sqrtN``.
        scaling: score scale (default ``D ** -0.5``).
        initial_state: ``(B, H_kv, D, D_v)``, the state ``sum k_j v_j^T`` of keys before these (recurrent decoding),
            in the compute dtype; ``None`` = no earlier keys.
        initial_count: ``(B,)`` valid keys before these (read by ``sqrtN`` only).
        frobenius_sq: optional ``(B, H_kv, G)`` accumulator for each head's squared Frobenius norm (no gradient);
            not available with an ``initial_state`` (the ``K^T K`` state of earlier keys is not kept).
        chunk_size: query rows per chunk.
        return_state: also return the state after the last key and the count of valid keys.

    Returns:
        ``output (B, q, H_q, D_v)`` in the query dtype, computed in fp32 (fp64 for fp64 inputs) under autocast too
        (:mod:`.full_precision`); with ``return_state``, ``(output, state (B, H_kv, D, D_v), count (B,))`` in the
        compute dtype.
    """
    if normalization.window:
        raise ValueError(f"The linear kernel computes x/c over every key; {normalization.name} needs its softmax "
                         "window: hf_knorm.attention.window.window_attention.")
    if not is_linear(normalization):
        raise ValueError(f"The linear path computes p = 1 normalizations (x/c, x/sqrtN), not {normalization.name}.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    if kv_len < q_len:
        raise ValueError(f"The linear path needs at least as many keys as queries (causal), got {kv_len} < {q_len}.")
    if frobenius_sq is not None and initial_state is not None:
        raise ValueError("Attention norms need every key's K^T K, which a recurrent state does not keep: record norms "
                         "on a forward pass without a cache (use_cache=False), or generate with cache=DynamicCache().")
    scaling = head_dim**-0.5 if scaling is None else scaling
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.to(compute) * scaling
    k, v = key.to(compute), value.to(compute)
    if key_valid is not None:
        invalid = ~key_valid[:, None, :, None]
        k, v = k.masked_fill(invalid, 0.0), v.masked_fill(invalid, 0.0)

    prefix = kv_len - q_len  # keys every query sees (the cache)
    state = (torch.zeros(batch, kv_heads, head_dim, v.shape[-1], dtype=compute, device=query.device)
             if initial_state is None else initial_state.to(compute))
    if prefix:
        state = state + k[:, :, :prefix].transpose(-1, -2) @ v[:, :, :prefix]
    row_scale = _row_scale(normalization, key_valid, initial_count, prefix, q_len, batch, compute, query.device)

    chunk = max(1, min(chunk_size, q_len))
    segment = chunk * max(1, SEGMENT_ELEMENTS // (batch * q_heads * chunk * chunk))
    key_state = None
    if frobenius_sq is not None:
        key_state = k[:, :, :prefix].transpose(-1, -2) @ k[:, :, :prefix]
    outputs = []
    # torch.split, not slicing: one backward node gathers the segments' gradients (a slice's backward writes a
    # zero-filled tensor of the whole input per segment, quadratic in N).
    pieces = [torch.split(tensor, segment, dim=dim) for tensor, dim in
              ((q, 2), (k[:, :, prefix:], 2), (v[:, :, prefix:], 2), (row_scale, 1))]
    for q_piece, k_piece, v_piece, scale_piece in zip(*pieces):  # each segment starts from the state before it
        output, state, key_state = _segment(q_piece, k_piece, v_piece, state, scale_piece, chunk, frobenius_sq,
                                            key_state)
        outputs.append(output)
    output = torch.cat(outputs, dim=1).to(query.dtype)
    if not return_state:
        return output
    valid = kv_len if key_valid is None else key_valid.sum(dim=-1)
    count = (torch.zeros(batch, dtype=compute, device=query.device) if initial_count is None
             else initial_count.to(compute)) + valid
    return output, state, count


def _segment(q, k, v, state, row_scale, chunk, frobenius_sq, key_state):
    """Outputs ``(B, n, H_q, D_v)`` of ``n`` queries (already scaled) and their ``n`` keys, given the ``state`` of
    every key before them; returns them with the state after them (and the ``K^T K`` state when norms are recorded).
    All chunks of the segment at once: its states are an exclusive cumulative sum over chunks."""
    batch, q_heads, rows, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    chunk = min(chunk, rows)
    chunks = -(-rows // chunk)
    pad = chunks * chunk - rows
    layout = (groups, chunks, chunk, pad)
    q_chunks = _query_chunks(q, kv_heads, groups, chunks, chunk, pad)  # (B, H_kv, T, G*C, D)
    k_chunks = F.pad(k, (0, 0, 0, pad)).view(batch, kv_heads, chunks, chunk, head_dim)
    v_chunks = F.pad(v, (0, 0, 0, pad)).view(batch, kv_heads, chunks, chunk, -1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril().repeat(groups, 1)  # (G*C, C)

    chunk_states = k_chunks.transpose(-1, -2) @ v_chunks  # (B, H_kv, T, D, D_v)
    states = _exclusive_cumsum(chunk_states, state)
    scores = (q_chunks @ k_chunks.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (B, H_kv, T, G*C, C)
    output = (q_chunks @ states + scores @ v_chunks) * _chunked_rows(row_scale, *layout)  # (B, H_kv, T, G*C, D_v)
    if frobenius_sq is not None:
        key_state = _accumulate_frobenius(frobenius_sq, q_chunks, k_chunks, scores, key_state, row_scale, layout)
    output = (output.view(batch, kv_heads, chunks, groups, chunk, -1).permute(0, 2, 4, 1, 3, 5)
              .reshape(batch, chunks * chunk, q_heads, -1)[:, :rows])
    return output, states[:, :, -1] + chunk_states[:, :, -1], key_state

def _row_scale(normalization, key_valid, initial_count, prefix, q_len, batch, dtype, device):
    """``(B, q)`` factor ``1 / c_i`` per query row."""
    pointwise = normalization.without_window.pointwise
    if pointwise.row_rule == "constant":
        return torch.full((batch, q_len), pointwise.inv_constant, dtype=dtype, device=device)
    valid = (torch.ones(batch, prefix + q_len, dtype=dtype, device=device) if key_valid is None
             else key_valid.to(dtype).expand(batch, -1))
    counts = valid.cumsum(dim=-1)[:, prefix:]
    if initial_count is not None:
        counts = counts + initial_count.to(dtype)[:, None]
    return counts.clamp_min(1.0).rsqrt()


def _query_chunks(q, kv_heads, groups, chunks, chunk, pad):
    """``(B, H_q, q, D)`` -> ``(B, H_kv, T, G*C, D)``: each chunk's rows, group-major, for one matmul per chunk."""
    batch, _, _, dim = q.shape
    q = F.pad(q, (0, 0, 0, pad)).view(batch, kv_heads, groups, chunks, chunk, dim)
    return q.permute(0, 1, 3, 2, 4, 5).reshape(batch, kv_heads, chunks, groups * chunk, dim)


def _chunked_rows(row_scale, groups, chunks, chunk, pad):
    """``(B, q)`` per-row factors -> ``(B, 1, T, G*C, 1)``, matching :func:`_query_chunks`' row order."""
    batch = row_scale.shape[0]
    rows = F.pad(row_scale, (0, pad)).view(batch, 1, chunks, 1, chunk, 1)
    return rows.expand(batch, 1, chunks, groups, chunk, 1).reshape(batch, 1, chunks, groups * chunk, 1)


def _exclusive_cumsum(chunk_states, initial):
    """``initial + sum of chunk_states[:, :, :t]`` for every chunk ``t``: the state each chunk starts from."""
    before = F.pad(chunk_states.cumsum(dim=2)[:, :, :-1], (0, 0, 0, 0, 1, 0))
    return before + initial[:, :, None]


def _accumulate_frobenius(frobenius_sq, q_chunks, k_chunks, scores, key_state, row_scale, layout):
    """Add ``sum_i a_i^2 q_i^T (sum_{j <= i} k_j k_j^T) q_i`` per head (``(B, H_kv, G)``) to ``frobenius_sq``, given
    the ``K^T K`` state of the keys before the segment; returns the state after it."""
    groups, chunks, chunk, pad = layout
    with torch.no_grad():
        chunk_key_states = k_chunks.transpose(-1, -2) @ k_chunks
        key_states = _exclusive_cumsum(chunk_key_states, key_state.detach())
        per_row = ((q_chunks @ key_states) * q_chunks).sum(dim=-1) + scores.square().sum(dim=-1)  # (B, H_kv, T, G*C)
        per_row = per_row * _chunked_rows(row_scale, groups, chunks, chunk, pad).squeeze(-1).square()
        batch, kv_heads = per_row.shape[:2]
        total = per_row.view(batch, kv_heads, chunks, groups, chunk).sum(dim=(2, 4))
        frobenius_sq += total.to(frobenius_sq.dtype)
        return key_states[:, :, -1] + chunk_key_states[:, :, -1]

