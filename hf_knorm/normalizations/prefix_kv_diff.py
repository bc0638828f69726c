"""``prefix_kv_diff``: the eviction's ``kv_diff`` relative to each token's prefix, a sparse-cache score that a bounded
decoder can run.

Why. A per-token score (``value_over_key``, ``key_norm``) is a property of the token: a filler sentence repeated a
hundred times at 4,000 tokens repeats its high scores into every slot of the cache, and the converted default model
finds 0 of 8 passkeys there with 256 pairs a head, 1 of 8 with 768, though its weights find 8 of 8 with every pair kept
(docs/results/conversion.md, "Why 4,000 tokens fail"). The eviction's ``kv_diff`` (:class:`hf_knorm.eviction.scores.
KVDiff`: KeyDiff, arXiv 2504.15364, on keys and values, standardized, pooled over 5 tokens as SnapKV, arXiv
2404.14469) scores a token against the others; taken over the tokens up to each one it becomes a score a decoder can
fix once and for all.

Definition, per sequence (its real tokens ``1..n``, padding excluded) and KV head, for token ``j``::

    d^k_j = -cos(k_j, a^k_j),   a^k_j = mean_{i <= j} k_i / ||k_i||         (the same with the values: d^v_j)
    z^k_j = (d^k_j - mean_{i <= j} d^k_i) / std_{i <= j} d^k_i              (population std; 0 for j = 1)
    s_j   = z^k_j + z^v_j
    r_j   = mean of s_i over the real tokens i of {j-2, ..., j+2} that exist (SnapKV's pooling, cut at the ends)

``s_j`` depends on tokens ``1..j`` only, so ``r_j`` is final two tokens after ``j``: long before the pair leaves a
window of ``W >= 3`` and its score is read (:mod:`hf_knorm.attention.sparse` ranks only pairs older than the window).

Bounded state (:class:`PrefixStatistics`), per sequence and KV head: the sums of the unit keys and of the unit values
(``D + D_v`` numbers), the count of real tokens, the sums and sums of squares of ``d^k`` and ``d^v`` (4 numbers), and
``s`` of the last ``W + 2`` positions for the pooling. A call continues it from its first key that the state has not
seen; its keys before that (the window's kept pairs) are scored from the stored ``s``. The statistics are kept in
fp64, so the full forward (one running sum over the context), the chunked forward and token-by-token decoding give the
same float32 scores except at roundings of about ``1e-16``.

The plain reference, a loop over the tokens, is :func:`hf_knorm.attention.reference.reference_prefix_kv_diff`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

POOL = 5
"""Tokens averaged per score, centred (``kv_diff``'s default, as measured in docs/results/knorm.md)."""

REACH = POOL // 2
"""Tokens after ``j`` that ``r_j`` waits for."""

VARIANCE_FLOOR = 1e-12
"""The running variance's floor: the first token (variance 0) standardizes to 0."""


class PrefixStatistics(NamedTuple):
    """What a call hands the next one, fp64. ``B`` sequences, ``H`` KV heads, ``T = W + REACH`` tail positions.

    Attributes:
        key_sum: ``(B, H, D)`` the sum of the unit keys of the real tokens seen.
        value_sum: ``(B, H, D_v)`` the same for the values.
        count: ``(B, 1)`` the real tokens seen.
        moments: ``(B, H, 4)`` the sums of ``d^k``, ``d^k ** 2``, ``d^v``, ``d^v ** 2`` over them.
        tail: ``(B, H, T)`` ``s`` of positions ``seen - T .. seen - 1`` (0 where padded or before the first token).
        tail_valid: ``(B, T)`` bool, which of those are real tokens.
        seen: ``(1,)`` long, the positions handed over so far (padded ones included): the next call's first new key.
    """

    key_sum: torch.Tensor
    value_sum: torch.Tensor
    count: torch.Tensor
    moments: torch.Tensor
    tail: torch.Tensor
    tail_valid: torch.Tensor
    seen: torch.Tensor

    def select(self, fn) -> PrefixStatistics:
        """The statistics with ``fn`` (a selection along the batch, as a cache's beam reorder) applied to each
        sequence's tensors."""
        return PrefixStatistics(*(fn(tensor) for tensor in self[:-1]), self.seen)


def prefix_kv_diff(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, first: int = 0,
                   carried: PrefixStatistics | None = None, window: int = 0
                   ) -> tuple[torch.Tensor, PrefixStatistics]:
    """Score a call's keys, continuing ``carried``.

    Args:
        keys, values: ``(B or 1, H, n, D)`` the call's pairs, at absolute positions ``first .. first + n - 1``.
        valid: ``(B, n)`` bool, the real tokens (``None``: all of them).
        first: the absolute position of the call's key 0.
        carried: the statistics of positions ``0 .. seen - 1`` (``None``: nothing seen, ``first`` must be 0); the
            call's keys before ``seen`` are scored from its tail, so ``first >= seen - window``.
        window: ``W``, how many positions before ``seen`` a later call may start at.

    Returns:
        ``(r (B, H, n) in float32, or fp64 for fp64 keys, the statistics of positions 0 .. first + n - 1)``. The
        last ``REACH`` keys' scores are not final yet (their later neighbours are unseen); a padded key scores 0.
    """
    batch = max(keys.shape[0], values.shape[0], 1 if valid is None else valid.shape[0])
    heads, length = keys.shape[1], keys.shape[2]
    device, full = keys.device, torch.float64
    valid = (torch.ones(batch, length, dtype=torch.bool, device=device) if valid is None
             else valid.expand(batch, length))
    if carried is None:
        if first:
            raise ValueError(f"prefix_kv_diff: a call starting at position {first} needs the statistics of the "
                             "positions before it.")
        carried = _empty(batch, heads, keys.shape[-1], values.shape[-1], window + REACH, device)
    seen, tail_length = int(carried.seen), carried.tail.shape[-1]
    new = seen - first  # the call's first key that the statistics have not seen
    if not 0 <= new < length or first - REACH < seen - tail_length:
        raise ValueError(f"prefix_kv_diff: a call over positions {first}..{first + length - 1} cannot continue "
                         f"statistics of positions 0..{seen - 1} that keep the last {tail_length}.")
    fresh_valid = valid[:, new:]  # (B, m)
    real = fresh_valid[:, None, :]
    count = carried.count[:, :, None] + fresh_valid.cumsum(dim=-1, dtype=full)[:, None, :]  # (B, 1, m)
    key_sum = _running_sum_of_directions(keys[:, :, new:], real, carried.key_sum)  # (B, H, m, D)
    value_sum = _running_sum_of_directions(values[:, :, new:], real, carried.value_sum)
    # -cos(x_j, a_j): the mean a_j = sum / count points where the sum does
    of_keys = -F.cosine_similarity(keys[:, :, new:].to(full), key_sum, dim=-1)  # (B, H, m)
    of_values = -F.cosine_similarity(values[:, :, new:].to(full), value_sum, dim=-1)
    z_keys, key_moments = _running_standardized(of_keys, real, count, carried.moments[..., :2])
    z_values, value_moments = _running_standardized(of_values, real, count, carried.moments[..., 2:])
    raw = torch.where(real, z_keys + z_values, 0.0)  # (B, H, m): s of the new positions
    # s of positions seen - T .. first + n - 1, then each call key's mean over its centred POOL
    history = torch.cat([carried.tail.expand(batch, heads, -1), raw], dim=-1)
    history_valid = torch.cat([carried.tail_valid.expand(batch, -1), fresh_valid], dim=-1)
    start = first - REACH - (seen - tail_length)  # the index of position first - REACH
    around = F.pad(history[..., start:], (0, REACH))  # (B, H, n + 2 * REACH)
    around_valid = F.pad(history_valid[:, start:], (0, REACH)).to(full)[:, None, :]
    total = (around * around_valid).unfold(-1, POOL, 1).sum(dim=-1)  # (B, H, n)
    number = around_valid.unfold(-1, POOL, 1).sum(dim=-1)
    score = torch.where(valid[:, None, :], total / number.clamp_min(1.0), 0.0)
    statistics = PrefixStatistics(
        key_sum=key_sum[:, :, -1], value_sum=value_sum[:, :, -1], count=count[:, :, -1],
        moments=torch.cat([key_moments, value_moments], dim=-1),
        tail=history[..., -tail_length:], tail_valid=history_valid[:, -tail_length:],
        seen=torch.tensor([first + length], device=device))
    return score.to(torch.promote_types(keys.dtype, torch.float32)), statistics


def _empty(batch, heads, key_dim, value_dim, tail_length, device) -> PrefixStatistics:
    zeros = lambda *shape, dtype=torch.float64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    return PrefixStatistics(zeros(batch, heads, key_dim), zeros(batch, heads, value_dim), zeros(batch, 1),
                            zeros(batch, heads, 4), zeros(batch, heads, tail_length),
                            zeros(batch, tail_length, dtype=torch.bool), zeros(1, dtype=torch.long))


def _running_sum_of_directions(states, real, carried_sum) -> torch.Tensor:
    """Per position of ``states`` ``(B, H, m, D)``, the sum of the unit vectors of the real tokens (``real``
    ``(B, 1, m)``) up to it, ``carried_sum`` ``(B, H, D)`` included: ``(B, H, m, D)`` fp64."""
    unit = F.normalize(states.to(torch.float64), dim=-1) * real[..., None]
    return carried_sum[:, :, None, :] + unit.cumsum(dim=2)


def _running_standardized(series, real, count, carried) -> tuple[torch.Tensor, torch.Tensor]:
    """``series`` ``(B, H, m)`` standardized by the mean and population std of its real values up to each position
    (``count`` ``(B, 1, m)`` of them; ``carried`` ``(B, H, 2)``: the sums of it and its square before the call);
    returns it and those two sums after the call's last position ``(B, H, 2)``."""
    series = torch.where(real, series, 0.0)
    sums = carried[..., 0:1] + series.cumsum(dim=-1)
    squares = carried[..., 1:2] + series.square().cumsum(dim=-1)
    mean = sums / count.clamp_min(1.0)
    variance = squares / count.clamp_min(1.0) - mean.square()
    standardized = (series - mean) / variance.clamp_min(VARIANCE_FLOOR).sqrt()
    return standardized, torch.stack([sums[..., -1], squares[..., -1]], dim=-1)


__all__ = ["POOL", "PrefixStatistics", "prefix_kv_diff"]
