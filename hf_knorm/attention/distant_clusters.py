"""Clusters beside the sparse cache: the older pairs neither the window, the sinks nor the sparse cache keep, summarized
for softmax by ``C`` pseudo-pairs per KV head (``... + sparse K (score) + clusters C``).

Why. A model converted to a softmax window beside a sparse cache weights nothing else by softmax: its ``x/1`` part
earns ~0% beyond the window (docs/results/conversion.md), and issue 47 asks the part beside the window to earn 10%.
A bounded summary that softmax can weigh beside the exact pairs measured 11% on the worst domain at 4,096 tokens,
untrained (``research/2026-12/clustered_distant_part.py``).

Definition (ours; the plain reference is :func:`.reference.reference_window_attention`). Per layer and KV head, a
fixed codebook of ``C`` unit directions (``(H_kv, C, D)``, fitted on the model's keys by spherical k-means and saved
with the weights: :mod:`hf_knorm.models.cluster_codebook`) puts each key in the cluster of the direction of highest
cosine. For query ``i``, the older pairs of its distant part (:mod:`.sparse`: older than the window, not sinks, not in
the sparse cache) form, per cluster ``c`` that holds ``n_c > 0`` of them, one pseudo-pair: the mean key ``k_c`` and
the mean value ``v_c`` of those pairs, with the logit ``q_i . k_c * scaling + log n_c`` (the mean of the pairs' exact
scores plus ``log n_c``: Jensen's lower bound of ``log sum_j exp(s_ij)`` over the cluster). The pseudo-pairs are
weighted by softmax **jointly** with the window, the sinks and the sparse cache; the base family's part (``x/1``,
scaled by its mix) still weights the same distant pairs beside it.

Bounded state. The pseudo-pairs are computed from per-cluster sums, which a pair leaving the window (or the cache)
joins once: :class:`ClusterState`, ``C`` key sums, ``C`` value sums and ``C`` counts per KV head, whatever the length.
A decoded key is rounded differently from the full forward's: a key whose two best directions tie up to rounding may
join another cluster (as a sparse cache's score may choose another pair).

Cost (:class:`ClusterRows`). A pair stays in a row's distant part for every later row, so a call folds the pairs every
row of a block of :data:`SUB_ROWS` rows holds into the sums once, and only the pairs that join during the block are
counted row by row: ``O(C * (D + SUB_ROWS))`` per query and KV head instead of ``O(C * N)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SUB_ROWS = 32
"""Rows per block whose pseudo-pairs share one folded sum (:class:`ClusterRows`): the pairs that join a row's distant
part inside a block, at most about ``2 * SUB_ROWS`` (the window's and the sparse cache's leavers), are counted row by
row."""


class ClusterState(NamedTuple):
    """The per-cluster sums of the pairs in the distant part, in fp32 (fp64 for fp64 keys).

    Attributes:
        key_sum: ``(B, H_kv, C, D)``; value_sum: ``(B, H_kv, C, D_v)``; count: ``(B, H_kv, C)``.
    """

    key_sum: torch.Tensor
    value_sum: torch.Tensor
    count: torch.Tensor


def check_codebook(codebook: torch.Tensor | None, clusters: int, kv_heads: int, dim: int, name: str) -> None:
    """Raise a ValueError unless ``codebook`` is a fitted ``(H_kv, C, D)`` codebook (no zero row: a row never
    fitted)."""
    if codebook is None:
        raise ValueError(f"{name}: the attention module has no cluster codebook. Patch the model with hf_knorm.patch "
                         "and fit one with hf_knorm.models.cluster_codebook.fit_cluster_codebook(model, input_ids).")
    if tuple(codebook.shape) != (kv_heads, clusters, dim):
        raise ValueError(f"{name}: the cluster codebook is {tuple(codebook.shape)}, and this call needs "
                         f"({kv_heads}, {clusters}, {dim}) (KV heads, clusters, head dimension).")
    if not bool((codebook != 0).any(dim=-1).all()):
        raise ValueError(f"{name}: the cluster codebook has rows that were never fitted (zeros). Fit it with "
                         "hf_knorm.models.cluster_codebook.fit_cluster_codebook(model, input_ids) before running the "
                         "model.")


def assignments(keys: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each key's cluster as a one-hot ``(B, H_kv, M, C)`` in ``dtype``: the codebook direction of highest cosine
    (``keys`` ``(B, H_kv, M, D)``, ``codebook`` ``(H_kv, C, D)``)."""
    directions = torch.nn.functional.normalize(keys.detach().to(dtype), dim=-1)
    cosine = directions @ codebook.detach().to(dtype).transpose(-1, -2)
    return torch.nn.functional.one_hot(cosine.argmax(dim=-1), codebook.shape[1]).to(dtype)


def pseudo_logits(query: torch.Tensor, scores: torch.Tensor, distant: torch.Tensor, onehot: torch.Tensor,
                  prior: ClusterState | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pseudo-pairs' logits of a block of rows, and their sizes.

    Args:
        query: ``(B, H_kv, G, r, D)``; scores: ``(B, H_kv, G, r, M)`` the rows' scores of the call's candidates
            (scaled); distant: ``(B, H_kv, r, M)`` bool, the candidates in each row's distant part; onehot:
            ``(B, H_kv, M, C)`` (:func:`assignments`); prior: the sums of the pairs that were in the distant part
            before the call (a decoding state), or ``None``; scale: the score scale.

    Returns:
        ``(logits (B, H_kv, G, r, C), -inf for an empty cluster; sizes (B, H_kv, 1, r, C))``.
    """
    member = distant.to(onehot.dtype)
    sizes = (member @ onehot)[:, :, None]  # (B, H_kv, 1, r, C)
    summed = (scores * member[:, :, None]) @ onehot[:, :, None]  # (B, H_kv, G, r, C)
    if prior is not None:
        sizes = sizes + prior.count.to(sizes.dtype)[:, :, None, None, :]
        summed = summed + _per_kv_head(query, prior.key_sum.to(query.dtype).transpose(-1, -2)) * scale
    size = sizes.clamp_min(1.0)
    logits = torch.where(sizes > 0, summed / size + size.log(), float("-inf"))
    return logits, sizes


def cluster_part(weights: torch.Tensor, sizes: torch.Tensor, distant: torch.Tensor, onehot: torch.Tensor,
                 prior: ClusterState | None, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the pseudo-pairs add to a block of rows: ``sum_c p_c v_c``.

    Args:
        weights: ``(B, H_kv, G, r, C)`` the pseudo-pairs' softmax weights; sizes: from :func:`pseudo_logits`;
            distant, onehot, prior: as :func:`pseudo_logits`; values: ``(B, H_kv, M, D_v)`` the candidates'.

    Returns:
        ``(output (B, H_kv, G, r, D_v), per_pair (B, H_kv, G, r, M))``: each candidate's share ``p_c / n_c`` of its
        cluster's weight (0 outside the row's distant part).
    """
    share = weights / sizes.clamp_min(1.0)
    per_pair = (share @ onehot[:, :, None].transpose(-1, -2)) * distant[:, :, None].to(share.dtype)
    output = per_pair @ values[:, :, None]
    if prior is not None:
        output = output + _per_kv_head(share, prior.value_sum.to(share.dtype))
    return output, per_pair


def add_leaving(prior: ClusterState | None, onehot: torch.Tensor, leaving: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> ClusterState:
    """The sums after the pairs ``leaving`` ``(B, H_kv, M)`` joined the distant part (``keys`` / ``values``
    ``(B, H_kv, M, D)`` in the state's dtype, ``onehot`` :func:`assignments`)."""
    member = onehot.to(keys.dtype) * leaving[..., None].to(keys.dtype)  # (B, H_kv, M, C)
    added = ClusterState(member.transpose(-1, -2) @ keys, member.transpose(-1, -2) @ values, member.sum(dim=-2))
    if prior is None:
        return added
    return ClusterState(*(old + new for old, new in zip(prior, added)))


def _per_kv_head(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix`` for ``rows`` ``(B, H_kv, G, r, X)`` and one ``(B, H_kv, X, Y)`` matrix per KV head, as one
    product of ``G r`` rows (broadcasting the matrix over ``G`` would copy it ``G`` times): ``(B, H_kv, G, r, Y)``."""
    batch, heads, groups, count, _ = rows.shape
    return (rows.reshape(batch, heads, groups * count, -1) @ matrix).view(batch, heads, groups, count, -1)


class _Block(NamedTuple):
    """One block of rows as :meth:`ClusterRows.logits` left it for :meth:`ClusterRows.output`."""

    start: int
    stop: int
    columns: torch.Tensor  # (m,) the call's candidates some row of the block counts row by row
    distant: torch.Tensor  # (B, H_kv, s, m) bool
    sizes: torch.Tensor  # (B, H_kv, 1, s, C)
    folded: ClusterState | None  # the sums of the pairs in every row's distant part (and the state's)


class ClusterRows:
    """The pseudo-pairs of one call's rows, block by block, as :func:`pseudo_logits` and :func:`cluster_part` define
    them: the pairs already in the distant part of a block's first row are folded into sums once (a pair stays
    there for every later row), the others counted row by row.

    Args:
        onehot: ``(B, H_kv, R, C)`` the assignments (:func:`assignments`) of ``candidates``; keys, values:
            ``(B, H_kv, R, D)`` / ``(B, H_kv, R, D_v)`` theirs, in the compute dtype; candidates: ``(R,)`` their
            indices among the call's ``M`` candidates, the ones that reach some row's distant part; prior: the
            state's sums (a decoding state) or ``None``; fold: fold into sums (``False``: every row on every
            candidate, as :meth:`output` must to return each pair's share).
    """

    def __init__(self, onehot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, candidates: torch.Tensor,
                 prior: ClusterState | None, fold: bool):
        self.onehot, self.keys, self.values, self.candidates, self.fold = onehot, keys, values, candidates, fold
        self.folded = None if prior is None else ClusterState(*(t.to(keys.dtype) for t in prior))
        self.in_folded = onehot.new_zeros(onehot.shape[:-1], dtype=torch.bool)  # (B, H_kv, R)
        self.blocks: list[_Block] = []

    def logits(self, query: torch.Tensor, scores: torch.Tensor, distant: torch.Tensor, scale: float) -> torch.Tensor:
        """The pseudo-pairs' ``(B, H_kv, G, r, C)`` logits of the next ``r`` rows (in order, each call's rows once).

        Args:
            query: ``(B, H_kv, G, r, D)``; scores: ``(B, H_kv, G, r, M)`` the rows' scaled scores of every
                candidate; distant: ``(B, H_kv, r, M)`` bool, the candidates in each row's distant part.
        """
        rows = query.shape[-2]
        distant = distant[..., self.candidates]  # (B, H_kv, r, R)
        step = SUB_ROWS if self.fold else rows
        # split, not sliced: the gradient of a split is one cat, a slice's fills a zero tensor of the whole rows
        queries, row_scores = query.split(step, dim=-2), scores.split(step, dim=-2)
        self.blocks, logits = [], []
        for start, block_query, block_scores in zip(range(0, rows, step), queries, row_scores):
            stop = min(rows, start + step)
            block = distant[:, :, start:stop]
            if self.fold:
                self._fold(block[:, :, 0])
                block = block & ~self.in_folded[:, :, None]
            columns = block.flatten(0, 2).any(dim=0).nonzero().squeeze(-1)
            block_logits, sizes = pseudo_logits(block_query, block_scores[..., self.candidates[columns]],
                                                block[..., columns], self.onehot[:, :, columns], self.folded, scale)
            self.blocks.append(_Block(start, stop, columns, block[..., columns], sizes, self.folded))
            logits.append(block_logits)
        return torch.cat(logits, dim=-2)

    def output(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the pseudo-pairs add to the rows of the last :meth:`logits`, given their ``(B, H_kv, G, r, C)``
        softmax weights: ``(output (B, H_kv, G, r, D_v), columns (m,), shares (B, H_kv, G, r, m))``; without
        ``fold``, ``shares`` are each pair's share of its cluster's weight (:func:`cluster_part`) for the call's
        candidates ``columns`` (of ``M``), else both ``None``."""
        outputs, shares = [], []
        blocks = weights.split([block.stop - block.start for block in self.blocks], dim=-2)
        for block, block_weights in zip(self.blocks, blocks):
            output, share = cluster_part(block_weights, block.sizes, block.distant,
                                         self.onehot[:, :, block.columns], block.folded,
                                         self.values[:, :, block.columns])
            outputs.append(output)
            shares.append(share)
        output = torch.cat(outputs, dim=-2)
        if self.fold:
            return output, None, None
        return output, self.candidates[self.blocks[0].columns], shares[0]

    def _fold(self, held: torch.Tensor) -> None:
        """Add the pairs of ``held`` ``(B, H_kv, R)`` (a block's first row's distant part) not folded yet."""
        new = held & ~self.in_folded
        columns = new.flatten(0, 1).any(dim=0).nonzero().squeeze(-1)
        if columns.numel():
            self.folded = add_leaving(self.folded, self.onehot[:, :, columns], new[..., columns],
                                      self.keys[:, :, columns], self.values[:, :, columns])
            self.in_folded = self.in_folded | held


__all__ = ["SUB_ROWS", "ClusterRows", "ClusterState", "add_leaving", "assignments", "check_codebook", "cluster_part",
           "pseudo_logits"]
