"""A plain reference of the plugin's attention, for tests: the whole score matrix at once, K/V repeated for GQA;
and of a normalization with a softmax window (:func:`reference_window_attention`).

Written independently of ``kernel.py`` and of ``Normalization.weights`` (it reads only ``power``, ``constant``
and ``sqrt_n``), so that the memory-efficient path is checked against a second formulation of the same definition.
"""

from __future__ import annotations

import torch

from .normalizations import Normalization
from .window import ROW_EPS


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in fp32 (fp64 for fp64 inputs).

    Args:
        query ``(B, H_q, q, D)``; key, value ``(B, H_kv, kv, D)``; allowed: bool ``(B or 1, 1, q, kv)`` or None (then
        ``causal`` means a top-left causal mask).

    Returns:
        ``(output (B, q, H_q, D) in the query dtype, weights (B, H_q, q, kv) fp32)``.
    """
    groups = query.shape[1] // key.shape[1]
    compute = torch.promote_types(query.dtype, torch.float32)
    k = key.to(compute).repeat_interleave(groups, dim=1)
    v = value.to(compute).repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query.to(compute) @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is None:
        q_len, kv_len = scores.shape[-2:]
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        if causal:
            allowed = allowed.tril()
    allowed = allowed.expand_as(scores)
    if normalization.is_softmax:
        weights = torch.softmax(torch.where(allowed, scores, float("-inf")), dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # rows with nothing to attend
    else:
        weights = torch.where(allowed, scores, torch.zeros_like(scores)) ** normalization.power
        if normalization.sqrt_n:
            weights = weights / allowed.sum(-1, keepdim=True).clamp_min(1).to(compute).sqrt()
        else:
            weights = weights / normalization.constant
    output = (weights @ v).transpose(1, 2).to(query.dtype)
    return output, weights


def reference_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    scaling: float | None = None,
    softcap: float | None = None,
    mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of a normalization with a softmax window (``x^p/c + softmax window W``, :mod:`.window`), in fp32
    (fp64 for fp64 inputs): the whole score matrix, the two parts side by side.

    Row ``i``'s position ``a_i`` is the last key it may attend (its own, under a causal mask). Its window is the keys
    it may attend with ``a_i - W < j <= a_i``, and its sinks, the first ``S`` keys it may attend: weighted by softmax
    over them. Its older keys (``j <= a_i - W``, not sinks) are
    weighted by ``s^p / c`` (``c = sqrtN``: the square root of the number of those older keys). The output is
    ``softmax part + mix_h * polynomial part / sqrt(mean square + ROW_EPS)`` (row by row, over the head dimension).

    Args:
        query ``(B, H_q, q, D)``; key, value ``(B, H_kv, kv, D)``; allowed: bool ``(B or 1, 1, q, kv)``, or ``None``
        for a bottom-right causal mask (query ``i`` attends keys ``j <= kv - q + i``); mix: ``(H_q,)`` factors of the
        polynomial part, or ``None`` (1).

    Returns:
        ``(output (B, q, H_q, D) in the query dtype, weights (B, H_q, q, kv))``.
    """
    window = normalization.window
    compute = torch.promote_types(query.dtype, torch.float32)
    groups = query.shape[1] // key.shape[1]
    k = key.to(compute).repeat_interleave(groups, dim=1)
    v = value.to(compute).repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query.to(compute) @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, kv_len = scores.shape[-2:]
    positions = torch.arange(kv_len, device=query.device)
    if allowed is None:
        allowed = positions[None, :] <= positions[:q_len, None] + (kv_len - q_len)
    allowed = allowed.expand_as(scores)
    last = torch.where(allowed, positions, -1).amax(dim=-1, keepdim=True)  # a_i; -1 for a row with no key
    sinks = allowed & (allowed.cumsum(dim=-1) <= normalization.sinks)  # the first S keys each row may attend
    in_window = allowed & ((positions > last - window) | sinks)
    older = allowed & ~in_window
    soft = torch.nan_to_num(torch.softmax(torch.where(in_window, scores, float("-inf")), dim=-1), nan=0.0)
    poly = torch.where(older, scores, torch.zeros_like(scores)) ** normalization.power
    if normalization.sqrt_n:
        poly = poly / older.sum(-1, keepdim=True).clamp_min(1).to(compute).sqrt()
    else:
        poly = poly / normalization.constant
    part = poly @ v  # (B, H_q, q, D): the polynomial part before its row normalization
    factor = torch.rsqrt(part.pow(2).mean(dim=-1, keepdim=True) + ROW_EPS)  # 1 / RMS of each row (window.row_scale)
    if mix is not None:
        factor = factor * mix.to(compute)[None, :, None, None]
    weights = soft + poly * factor
    output = (weights @ v).transpose(1, 2).to(query.dtype)
    return output, weights
