"""A plain reference of the plugin's attention, for tests: the whole score matrix at once, K/V repeated for GQA;
and of a normalization with a softmax window (:func:`reference_window_attention`).

Written independently of ``kernel.py``; softmax and the element-wise families (``x^p/c``, ``relu(x)^p/c``) also
independently of their ``weights`` (softmax as ``torch.softmax``; the others through their declared
:class:`~hf_knorm.normalizations.routes.Pointwise` form's plain
:meth:`~hf_knorm.normalizations.routes.Pointwise.reference`), so that the memory-efficient paths are checked against
a second formulation of the same definition. Every other family's ``weights`` is its plain definition
(:mod:`hf_knorm.normalizations`), applied here to the whole score matrix at once, with the learnable values broadcast
per query head.
"""

from __future__ import annotations

import torch

from ..normalizations import Normalization
from ..normalizations.sparse_choice import PREFIX_SCORES, ranked, token_scores
from .window_parts import ROW_EPS


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = False,
    params: dict[str, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in fp32 (fp64 for fp64 inputs).

    Args:
        query ``(B, H_q, q, D)``; key, value ``(B, H_kv, kv, D)``; allowed: bool ``(B or 1, 1, q, kv)`` or None (then
        ``causal`` means a top-left causal mask); params: the family's learnable values, ``(H_q,)`` each; bias: an
        additive float mask broadcastable to the scores, added after the softcap (as the kernels add it), or None.

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
    if bias is not None:
        scores = scores + bias.to(compute)
    if allowed is None:
        q_len, kv_len = scores.shape[-2:]
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        if causal:
            allowed = allowed.tril()
    allowed = allowed.expand_as(scores)
    if normalization.is_softmax:
        weights = torch.softmax(torch.where(allowed, scores, float("-inf")), dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # rows with nothing to attend
    elif normalization.pointwise is not None:  # the element-wise form, in its plainest terms
        weights = normalization.pointwise.reference(scores, allowed)
    else:
        weights = normalization.weights(scores, allowed, per_head(params, compute))
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
    params: dict[str, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of a normalization with a softmax window (``x^p/c + softmax window W``, :mod:`.window`), in fp32
    (fp64 for fp64 inputs): the whole score matrix, the two parts side by side. With a sparse cache
    (``+ sparse K (score)``, :mod:`.sparse`) each row's ``K`` best older keys per KV head (:func:`sparse_split`)
    join the softmax part and leave the polynomial one. With clusters (``+ clusters C``, :mod:`.distant_clusters`)
    each cluster of a row's remaining older keys (their codebook direction of highest cosine, ``codebook``
    ``(H_kv, C, D)``) joins the softmax as one more logit, the mean of its keys' scores plus the log of their
    number, whose weight goes to its keys in equal shares.

    Which keys go to which part is decided row by row from positions (:func:`window_split`, a loop in Python,
    written apart from the implementation's tensor expressions); the weights are then the definition's. Sinks and
    window keys are weighted by softmax over them; older keys by ``s^p / c`` (``c = sqrtN``: the square root of the
    number of those older keys). The output is ``softmax part + mix_h * polynomial part / sqrt(mean square +
    ROW_EPS)`` (row by row, over the head dimension).

    Args:
        query ``(B, H_q, q, D)``; key, value ``(B, H_kv, kv, D)``; allowed: bool ``(B or 1, 1 or H_q, q, kv)``, or
        ``None`` for a bottom-right causal mask (query ``i`` attends keys ``j <= kv - q + i``); mix: ``(H_q,)``
        factors of the polynomial part, or ``None`` (1); params: the base family's learnable values; bias: an
        additive float mask broadcastable to the scores, added after the softcap, or ``None``.

    Returns:
        ``(output (B, q, H_q, D) in the query dtype, weights (B, H_q, q, kv))``.

    Raises:
        ValueError: sinks, and a mask in which a row does not attend the first keys of its sequence (a sliding
            window): see :func:`window_split`.
    """
    compute = torch.promote_types(query.dtype, torch.float32)
    groups = query.shape[1] // key.shape[1]
    k = key.to(compute).repeat_interleave(groups, dim=1)
    v = value.to(compute).repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query.to(compute) @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(compute)
    q_len, kv_len = scores.shape[-2:]
    if allowed is None:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    in_window, older = window_split(allowed, normalization.window, normalization.sinks)
    in_window, older = in_window.expand_as(scores), older.expand_as(scores)
    if normalization.sparse:  # the sparse cache: each row's best older keys move to the softmax part
        key_valid = allowed.any(dim=-2).any(dim=1)  # (B or 1, kv): the keys some row attends (not padding)
        ranks = reference_scores(normalization.score, key, value, key_valid).repeat_interleave(groups, dim=1)
        chosen = sparse_split(older, ranks.expand(scores.shape[0], -1, -1), normalization.sparse)
        in_window, older = in_window | chosen, older & ~chosen
    logits = torch.where(in_window, scores, float("-inf"))
    if normalization.clusters:
        soft, shares = _with_clusters(logits, scores, older, key, codebook, groups)
    else:
        soft, shares = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0), 0.0
    base = normalization.without_window
    if base.pointwise is not None:
        poly = base.pointwise.reference(scores, older)
    else:
        poly = base.weights(scores, older, per_head(params, compute))
    part = poly @ v  # (B, H_q, q, D): the polynomial part before its row normalization
    factor = torch.rsqrt(part.pow(2).mean(dim=-1, keepdim=True) + ROW_EPS)  # 1 / RMS of each row (window_parts.row_scale)
    if mix is not None:
        factor = factor * mix.to(compute)[None, :, None, None]
    weights = soft + shares + poly * factor
    output = (weights @ v).transpose(1, 2).to(query.dtype)
    return output, weights


def _with_clusters(logits, scores, older, key, codebook, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over ``logits`` ``(B, H_q, q, kv)`` and one logit per non-empty cluster of each row's ``older``
    keys: ``(the keys' weights, the clusters' weights shared among their keys)``, a loop over the clusters."""
    directions = torch.nn.functional.normalize(key.to(scores.dtype), dim=-1)
    cluster_of = torch.einsum("bhkd,hcd->bhkc", directions, codebook.to(scores.dtype)).argmax(dim=-1)
    cluster_of = cluster_of.repeat_interleave(groups, dim=1)[:, :, None, :]  # (B, H_q, 1, kv)
    members, extra = [], []
    for c in range(codebook.shape[1]):
        member = older & (cluster_of == c)
        size = member.sum(dim=-1, keepdim=True).to(scores.dtype)
        mean_score = torch.where(member, scores, 0.0).sum(dim=-1, keepdim=True) / size.clamp_min(1)
        extra.append(torch.where(size > 0, mean_score + size.clamp_min(1).log(), float("-inf")))
        members.append(member.to(scores.dtype) / size.clamp_min(1))
    weights = torch.nan_to_num(torch.softmax(torch.cat([logits, *extra], dim=-1), dim=-1), nan=0.0)
    kv_len = logits.shape[-1]
    shares = sum(weights[..., kv_len + c, None] * member for c, member in enumerate(members))
    return weights[..., :kv_len], shares


def window_split(allowed: torch.Tensor, window: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of each row's softmax part and of its polynomial part: two bool tensors of ``allowed``'s shape
    ``(..., q, kv)``, decided one row at a time from the positions of the keys the row may attend.

    A row's position is the last key it may attend (its own, under a causal mask). Its sequence is the keys it may
    attend: each sequence's first ``sinks`` of them are its sinks, and ``window`` keys up to its position (the
    position and the ``window - 1`` before it) its window, both weighted by softmax; the others are older, weighted
    by the polynomial. A row with no key has neither.

    The sinks are the sequence's first tokens only if every row attends its sequence from the start. A mask in which
    one does not (a sliding window: a row leaves keys behind that the row before it attended, while it attends that
    row's own key, so the two are one sequence) is refused when ``sinks > 0``.
    """
    kv_len = allowed.shape[-1]
    soft, older = [], []  # per row, the flags of its kv keys
    for matrix, queries in enumerate(allowed.reshape(-1, *allowed.shape[-2:]).tolist()):  # (batch x heads) x q x kv
        previous = None  # the keys the row before attends
        for row, mask in enumerate(queries):
            keys = [j for j, attends in enumerate(mask) if attends]
            soft.append([False] * kv_len)
            older.append([False] * kv_len)
            if not keys:
                previous = None
                continue
            position = keys[-1]
            if sinks and previous and previous[-1] in keys and previous != [j for j in keys if j <= previous[-1]]:
                raise ValueError(f"Row {row} of mask {matrix} does not attend the first keys of its sequence, which "
                                 f"the row before it attends (a sliding window): its first {sinks} keys are not its "
                                 "sequence's sinks.")
            for j in keys:
                if j in keys[:sinks] or j > position - window:
                    soft[-1][j] = True
                else:
                    older[-1][j] = True
            previous = keys
    return tuple(torch.tensor(flags, dtype=torch.bool, device=allowed.device).view(allowed.shape)
                 for flags in (soft, older))


def sparse_split(older: torch.Tensor, score: torch.Tensor, sparse: int) -> torch.Tensor:
    """The keys of each row's sparse cache: a bool tensor of ``older``'s shape ``(B, H, q, kv)``, decided one row at
    a time: the row's older keys sorted by ``score`` ``(B, H, kv)`` (highest first, ties to the lower position), the
    first ``sparse`` of them (a plain loop, written apart from the exit positions of :mod:`.sparse`)."""
    flags, scores = older.tolist(), score.tolist()
    chosen = [[[[False] * len(row) for row in rows] for rows in heads] for heads in flags]
    for b, heads in enumerate(flags):
        for h, rows in enumerate(heads):
            for i, row in enumerate(rows):
                keys = [j for j, flag in enumerate(row) if flag]
                for j in sorted(keys, key=lambda j: (-scores[b][h][j], j))[:sparse]:
                    chosen[b][h][i][j] = True
    return torch.tensor(chosen, dtype=torch.bool, device=older.device)


def reference_scores(score: str, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """A sparse cache's rank of each pair ``(B, H_kv, kv)``, as the implementation ranks it: a per-token score rounded
    (:func:`~hf_knorm.normalizations.sparse_choice.ranked`), a prefix score by :func:`reference_prefix_kv_diff`;
    ties go to the lower position (:func:`sparse_split`)."""
    if score in PREFIX_SCORES:
        return reference_prefix_kv_diff(key, value, key_valid)
    return ranked(token_scores(score, key, value))


def reference_prefix_kv_diff(key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """``prefix_kv_diff`` (:mod:`hf_knorm.normalizations.prefix_kv_diff`) token by token, a loop over each sequence's
    real tokens (``key_valid`` ``(B or 1, kv)``), in fp64: for token ``j``, ``-cos`` of its key (value) with the mean of
    the unit keys (values) up to it, standardized by the mean and population std of those up to it (0 for the
    first), summed, then averaged over the real tokens among ``j - 2 .. j + 2``. ``(B, H_kv, kv)``, 0 where padded,
    in float32 (fp64 for fp64 keys)."""
    batch, heads, kv_len = max(key.shape[0], key_valid.shape[0]), key.shape[1], key.shape[2]
    out = torch.zeros(batch, heads, kv_len, dtype=torch.float64)
    for b in range(batch):
        real = [j for j in range(kv_len) if key_valid[min(b, key_valid.shape[0] - 1), j]]
        for h in range(heads):
            raw = {}
            for kind in (key, value):
                states = kind[min(b, kind.shape[0] - 1), h].double()
                directions, series = [], []
                for j in real:
                    directions.append(states[j] / states[j].norm())
                    mean_direction = torch.stack(directions).mean(dim=0)
                    series.append(-(states[j] @ mean_direction / (states[j].norm() * mean_direction.norm())).item())
                    history = torch.tensor(series, dtype=torch.float64)
                    spread = max(history.var(correction=0).item(), 1e-12) ** 0.5
                    raw[j] = raw.get(j, 0.0) + (series[-1] - history.mean().item()) / spread
            for j in real:
                neighbours = [raw[i] for i in range(j - 2, j + 3) if i in raw]
                out[b, h, j] = sum(neighbours) / len(neighbours)
    return out.to(torch.promote_types(key.dtype, torch.float32)).to(key.device)


def per_head(params: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{name: (H_q,)}`` -> ``{name: (H_q, 1, 1)}`` in ``dtype``: broadcast against ``(B, H_q, q, kv)`` scores."""
    return {name: value.to(dtype)[:, None, None] for name, value in (params or {}).items()}
