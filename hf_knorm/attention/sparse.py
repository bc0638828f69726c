"""The sparse global cache of the composition (:mod:`.window`): ``base + softmax window W + sinks S + sparse K
(score)``, and the clusters of :mod:`.distant_clusters` beside it.

Why. A window finds nothing older than itself (BENCHMARKS.md: 0 of 16 passkeys at 1k-2k tokens on the converted
default model); LoLA (McDermott et al., arXiv 2505.23666) keeps a small sparse global cache of exact key/value pairs
beside the window and the linear state, and lifts RULER passkey retrieval at 4k from 0.6% to 97.4% with no training.

Definition (ours; the reference is :func:`.reference.reference_window_attention`). The window and the sinks as
:mod:`.window` defines them; for query ``i`` and KV head ``h``, the keys older than its window are ranked by a score
``r_hj`` (:mod:`hf_knorm.normalizations.sparse_choice`: fixed before the token leaves the window, higher first, ties
to the older key); the first ``K`` of them, ``sparse_h(i)``, are weighted by softmax **jointly** with the window and
the sinks, and only the others by the base family (RMS-normalized per row, times the mix ``m_h``)::

    o_i = sum_{j in window(i) + sinks + sparse_h(i)} softmax(s_i)_j v_j  +  m_h * u_i / RMS(u_i),
    u_i = sum_{j older, not in sparse_h(i)} w(s_ij) v_j

For ``p = 1`` ``u_i`` is ``q_i^T S / c`` with ``S`` the sum of ``k_j v_j^T`` over those pairs: the linear state.

The online rule. As ``r_hj`` does not change, the best ``K`` older keys of query ``i + 1`` are the best of those of
query ``i`` and the key that left the window: a pair leaving the window enters the cache if it beats the weakest
(which is displaced) and otherwise goes to the distant part; a displaced pair never comes back. So every pair ``c``
has an *exit position* ``e_c`` (:func:`exit_positions`): it is in the sparse cache of the rows with
``pos_c <= a_i - W < e_c`` and in the distant part of those with ``a_i - W >= e_c`` (``e_c = pos_c``: it never
entered). The full forward builds its masks from these positions, and a bounded decoding cache
(:class:`hf_knorm.recurrent.sparse_cache.SparseWindowStateLayer`) runs the same rule one pair at a time, from its
``W + S + K`` pairs and its state, given the same ranks (a per-token score is ranked at 8 significant bits, ties to
the older pair: :func:`hf_knorm.normalizations.sparse_choice.ranked`).

Paths. ``p = 1`` (a full forward, or a prompt given to the bounded cache): :func:`_chunked`, as the bounded cache
decodes, ``ROWS`` queries at a time on the sinks, the sparse cache, the window's keys before them and their own, the
other older pairs in the state: time ``O(N * (ROWS + W + S + K) * D + N * D * D_v)``, memory linear in ``N`` (one
layer of the default model's shape, ``W = K = 64``, one CPU thread: 0.26 s at 2k tokens, 0.35 s at 4k). Every other
call (another base family, a softcap, returned weights or recorded norms, queries after an uncached prefix: a
``DynamicCache``) computes every row on dense masks in blocks of ``ROWS`` rows against every key (:func:`_attend`:
memory ``O(ROWS * N)`` per head, time ``O(N^2 * D)``; 1.2 s at 2k on the same layer), the exit positions in chunks of
``ROWS`` pairs with the cache carried (``O(N * (K + ROWS))`` comparisons per KV head). A decoded token against the
bounded cache costs ``O((W + S + K) * D + D * D_v)``. With clusters each block's rows have ``C`` more columns.

Masks. Key padding (left-padded batches) and bottom-right causal calls, as a model's forward and its cache give them;
an explicit 4-D mask that is exactly causal with padded keys is read as such. Anything else (a model's own sliding
window, packed sequences, an additive bias) is refused: the cache's pairs are chosen along one sequence's positions.
No attention dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..normalizations import Normalization
from ..normalizations.sparse_choice import call_scores
from .distant_clusters import ClusterRows, add_leaving, assignments, check_codebook
from .linear_kernel import is_linear
from .masks import KeyPadding, Mask
from .paths import Path, causal_key_validity
from .window_parts import part_factor, sink_columns, sink_keys, window_columns, without_sinks

ROWS = 256
"""Queries (and pairs, for the exit positions) per block: a block's scores are ``ROWS x N`` per head."""

NEVER = torch.iinfo(torch.long).max
"""The exit position of a pair that is still in the sparse cache after the call's last query."""


class SparsePairs(NamedTuple):
    """The sparse cache a decoding layer keeps: ``K`` slots per KV head.

    Attributes:
        keys, values: ``(B, H_kv, K, D)``.
        score: ``(B, H_kv, K)`` float32 (fp64 for fp64 keys), each pair's score (:func:`hf_knorm.normalizations.sparse_choice.token_scores`).
        position: ``(B, H_kv, K)`` long, each pair's absolute position.
        filled: ``(B, H_kv, K)`` bool, the slots in use (fewer than ``K`` while fewer keys left the window).
    """

    keys: torch.Tensor
    values: torch.Tensor
    score: torch.Tensor
    position: torch.Tensor
    filled: torch.Tensor


def sparse_path(normalization: Normalization, q_len: int, kv_len: int, has_state: bool, *,
                softcap: float | None = None, return_weights: bool = False, recording: bool = False) -> Path:
    """What ``attention_paths()`` counts for a call with a sparse cache: ``"sparse"``; linear in the length where
    :func:`in_blocks` (``p = 1``: a full forward, or a step from a state), else masked attention over every row at
    once, quadratic, which is a fallback for ``p = 1`` (warned on long inputs, an error under ``linear="require"``)."""
    if in_blocks(normalization, q_len, kv_len, has_state, softcap, return_weights, recording) or q_len <= ROWS:
        return Path(linear=True, kernel="sparse")
    return Path(linear=False, kernel="sparse", fallback=is_linear(normalization.without_window),
                reason="a sparse cache beside the window with a softcap, returned weights, recorded norms, another "
                       "base family than p = 1, or queries after uncached keys: masked attention, quadratic")


def in_blocks(normalization: Normalization, q_len: int, kv_len: int, has_state: bool, softcap, return_weights: bool,
              recording: bool) -> bool:
    """Whether a call runs in blocks of :data:`ROWS` queries carrying a state (:func:`_chunked`): a ``p = 1`` base,
    more than ``ROWS`` queries, every key of the sequences in the call or a state handed over, no softcap, no
    returned weights or recorded norms (their rows are normalized one by one over every key)."""
    return (q_len > ROWS and (has_state or q_len == kv_len) and softcap is None and not return_weights
            and not recording and is_linear(normalization.without_window))


def sparse_attention(query, key, value, mask, normalization, *, scaling, softcap, return_weights, frobenius_sq, mix,
                     params, handover, codebook) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`.window.window_attention` for ``sparse > 0`` once the call is checked: in blocks carrying a state
    (:func:`_chunked`) where :func:`in_blocks`, else every row on dense masks (:func:`_attend`)."""
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads.")
    if normalization.clusters:
        check_codebook(codebook, normalization.clusters, key.shape[1], key.shape[-1], normalization.name)
    key_valid = _key_valid(mask, query, key)
    q_len = query.shape[2]
    if mask is None and handover is None and q_len > 1:  # sdpa's top-left causal mask: as many keys as queries
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    options = dict(scaling=scaling, softcap=softcap, return_weights=return_weights, frobenius_sq=frobenius_sq,
                   mix=mix, params=params, codebook=codebook if normalization.clusters else None)
    if in_blocks(normalization, q_len, key.shape[2], handover is not None, softcap, return_weights,
                 frobenius_sq is not None):
        return _chunked(query, key, value, key_valid, normalization, options, handover), None
    source = mask.source if isinstance(mask, KeyPadding) else None
    return _attend(query, key, value, key_valid, source, normalization, handover, **options)


def _chunked(query, key, value, key_valid, normalization, options, handover=None) -> torch.Tensor:
    """A ``p = 1`` call as the bounded cache decodes it in chunks of :data:`ROWS` tokens: each chunk's queries on the
    sinks, the sparse cache, the window's ``W`` keys before the chunk and the chunk's own, the older pairs carried in
    the state (:class:`_Carry`; with ``handover``, a decoding layer's, continued and handed back). Time
    ``O(N * (ROWS + W + S + K) * D + N * D * D_v)``, memory ``O(ROWS * (ROWS + W + S + K))`` per head: linear in
    ``N``. Returns ``(B, q, H_q, D_v)``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len  # the key index of query 0
    carry, before = _Carry(), 0  # before: the tokens before the call's key 0
    if handover is not None:
        before = handover.cumulative_length - kv_len
        carry = _Carry(0, *handover.read(), *(getattr(handover, name) for name in _Carry.KEPT))
    outputs = []
    for start in range(0, q_len, ROWS):
        stop = min(q_len, start + ROWS)
        begin, end = max(0, offset + start - normalization.window), offset + stop  # the window's keys before it too
        carry.cumulative_length = before + end
        valid = None if key_valid is None else key_valid[:, begin:end]
        output, _ = _attend(query[:, :, start:stop], key[:, :, begin:end], value[:, :, begin:end], valid, None,
                            normalization, carry, **options)
        outputs.append(output)
    if handover is not None:
        handover.keep_sinks(carry.sinks, carry.sinks_complete)
        handover.keep_sparse(carry.sparse_pairs)
        handover.keep_score_statistics(carry.score_statistics)
        handover.keep_clusters(carry.cluster_state)
        handover.write(carry.state, carry.count)
    return torch.cat(outputs, dim=1)


@dataclass
class _Carry:
    """What :func:`_chunked` carries from one chunk to the next, with the members a decoding layer has
    (:class:`~.taps.SparseWindowStateHandover`; the window's keys are sliced from the call's, not kept)."""

    KEPT: ClassVar = ("sinks", "sinks_complete", "sparse_pairs", "score_statistics", "cluster_state")
    cumulative_length: int = 0
    state: Any = None
    count: Any = None
    sinks: Any = None
    sinks_complete: bool = False
    sparse_pairs: Any = None
    score_statistics: Any = None
    cluster_state: Any = None

    def read(self):
        return self.state, self.count

    def write(self, state, count) -> None:
        self.state, self.count = state, count

    def keep_sinks(self, sinks, complete: bool = False) -> None:
        self.sinks, self.sinks_complete = sinks, complete

    def keep_sparse(self, pairs) -> None:
        self.sparse_pairs = pairs

    def keep_score_statistics(self, statistics) -> None:
        self.score_statistics = statistics

    def keep_clusters(self, state) -> None:
        self.cluster_state = state


def _attend(query, key, value, key_valid, source, normalization, handover, *, scaling, softcap, return_weights,
            frobenius_sq, mix, params, codebook) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call on the dense masks of its rows (in blocks of :data:`ROWS`), continuing ``handover``'s state and cache
    if any: ``(output (B, q, H_q, D_v), weights or None)``."""
    dtype = query.dtype
    compute = torch.promote_types(dtype, torch.float32)
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    kv_len = key.shape[2]
    first = 0 if handover is None else handover.cumulative_length - kv_len  # absolute position of the call's key 0
    device = query.device

    # the sinks (each sequence's first S real keys) and the pairs older than a window that may enter the cache
    sinks = None
    if normalization.sinks:
        sinks = sink_keys(key, value, key_valid, normalization.sinks, q_len, handover, source=source)
    valid = key.new_ones(batch, kv_len, dtype=torch.bool) if key_valid is None else key_valid.expand(batch, kv_len)
    eligible = without_sinks(valid, sinks, batch, kv_len)  # (B, kv)
    position = first + torch.arange(kv_len, device=device)
    carried = None if handover is None else handover.score_statistics  # a prefix score's running statistics
    score, carried = call_scores(normalization.score, key.detach(), value.detach(), valid, first=first,
                                 carried=carried, window=normalization.window)  # (B, H_kv, kv), ranks only
    if handover is not None:
        handover.keep_score_statistics(carried)
    cached = None if handover is None else handover.sparse_pairs
    pairs = _candidates(key, value, score, position, valid, eligible, cached)
    exits = exit_positions(pairs.score, pairs.position, pairs.filled, normalization.sparse, len_prior=pairs.prior)

    # every key a row may weight by softmax: the sinks, then the candidates (the cache's pairs, then the call's keys)
    sink_count = 0 if sinks is None else sinks.position.shape[-1]
    if sinks is not None:
        keys = torch.cat([sinks.keys.expand(batch, -1, -1, -1), pairs.keys], dim=2)
        values = torch.cat([sinks.values.expand(batch, -1, -1, -1), pairs.values], dim=2)
    else:
        keys, values = pairs.keys, pairs.values
    keys = keys.to(compute)
    values = values.to(compute)
    base = normalization.without_window
    state, count = (None, None) if handover is None else handover.read()
    scale = dim ** -0.5 if scaling is None else scaling
    group_params = {name: value.to(compute).view(kv_heads, groups, 1, 1) for name, value in (params or {}).items()}
    is_call_key = torch.arange(pairs.position.shape[-1], device=device) >= pairs.prior  # (M,)
    last_newest_older = first + kv_len - 1 - normalization.window  # the last row's a_i - W
    clusters = None  # the clusters' pseudo-pairs, where some cluster holds a pair for some row (else all weights 0)
    prior_clusters = None if handover is None else handover.cluster_state
    if codebook is not None:  # the candidates some row's distant part holds (with a state: those handed to it)
        reaching = (pairs.filled & (exits <= last_newest_older)).flatten(0, 1).any(dim=0).nonzero().squeeze(-1)
        if reaching.numel() or prior_clusters is not None:
            clusters = ClusterRows(assignments(pairs.keys[:, :, reaching], codebook, compute),  # (B, H_kv, R, C)
                                   keys[:, :, sink_count:][:, :, reaching], values[:, :, sink_count:][:, :, reaching],
                                   reaching, prior_clusters, fold=frobenius_sq is None and not return_weights)
    outputs, weight_rows = [], []
    for start in range(0, q_len, ROWS):
        stop = min(q_len, start + ROWS)
        q = query[:, :, start:stop].to(compute).view(batch, kv_heads, groups, stop - start, dim)
        row_position = first + kv_len - q_len + torch.arange(start, stop, device=device)[:, None]  # a_i, (r, 1)
        newest_older = row_position - normalization.window  # a_i - W
        p = pairs.position[:, :, None, :]
        in_sparse = pairs.filled[:, :, None, :] & (p <= newest_older) & (exits[:, :, None, :] > newest_older)
        in_base = pairs.filled[:, :, None, :] & (exits[:, :, None, :] <= newest_older)  # (B, H_kv, r, M)
        in_window = (is_call_key & pairs.valid)[:, None, None, :] & window_columns(p, row_position,
                                                                                   normalization.window)
        soft_allowed = in_sparse | in_window
        if sinks is not None:  # the sinks' positions are the call's key indices
            older_sinks = sink_columns(sinks, batch, row_position - first, normalization.window)
            soft_allowed = torch.cat([older_sinks.expand(-1, kv_heads, -1, -1), soft_allowed], dim=-1)
        scores = (q * scale) @ keys[:, :, None].transpose(-1, -2)  # (B, H_kv, G, r, S' + M); scaled on the r x D side
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        logits = torch.where(soft_allowed[:, :, None], scores, float("-inf"))  # (one pass: masked_fill clones first)
        # split, not sliced: a split's gradient is one cat, a slice's fills a zero tensor of the scores' size
        candidate_scores = scores.split([sink_count, scores.shape[-1] - sink_count], dim=-1)[1]
        if clusters is not None:  # the clusters' pseudo-pairs, weighted by softmax with the pairs
            logits = torch.cat([logits, clusters.logits(q, candidate_scores, in_base, scale)], dim=-1)
        soft = torch.softmax(logits, dim=-1)
        if key_valid is not None:  # a padded query may see no key (NaN): 0; a real one always sees its own key
            soft = torch.nan_to_num(soft, nan=0.0)
        if clusters is not None:
            soft, cluster_weights = soft.split([soft.shape[-1] - codebook.shape[1], codebook.shape[1]], dim=-1)
            clustered, shared, shares = clusters.output(cluster_weights)
        allowed_base = in_base[:, :, None]  # (B, H_kv, 1, r, M): the same pairs for every query head of a KV head
        if handover is None:
            base_weights = base.weights(candidate_scores, allowed_base.expand_as(candidate_scores), group_params)
            part = base_weights @ values[:, :, None, sink_count:]
        else:  # p = 1: the state's pairs, then the call's, over c (the constant, or sqrt of the count they add up to)
            base_weights = torch.where(allowed_base, candidate_scores, 0.0)  # (no float copy of the mask)
            part = base_weights @ values[:, :, None, sink_count:]
            if state is not None:
                part = part + (q @ state[:, :, None].to(compute)) * scale
            by_count = _row_scale(base, allowed_base, count, compute)
            part = part * by_count
            if frobenius_sq is not None or return_weights:  # the weights themselves: only where they are read
                base_weights = base_weights * by_count
        factor = part_factor(part, mix, (1, kv_heads, groups, 1, 1))  # (B, H_kv, G, r, 1)
        output = soft @ values[:, :, None] + part * factor  # (B, H_kv, G, r, D_v)
        if clusters is not None:
            output = output + clustered
        outputs.append(output)
        if frobenius_sq is not None or return_weights:
            weighted = base_weights * factor
            if clusters is not None:  # each distant pair's share of its cluster's weight
                weighted = weighted.index_add(-1, shared, shares)
            if frobenius_sq is not None:
                frobenius_sq += (soft.detach().square().sum(dim=(-2, -1))
                                 + weighted.detach().square().sum(dim=(-2, -1))).to(frobenius_sq.dtype)
            if return_weights:
                weight_rows.append(_call_weights(soft, weighted, sinks, sink_count, kv_len))
    output = torch.cat(outputs, dim=-2).reshape(batch, q_heads, q_len, -1).transpose(1, 2)
    if handover is not None:
        _hand_back(handover, pairs, exits, normalization.sparse, state, count, last_newest_older, clusters)
    weights = torch.cat(weight_rows, dim=-2).reshape(batch, q_heads, q_len, kv_len) if return_weights else None
    return output.to(dtype), weights


def exit_positions(score: torch.Tensor, position: torch.Tensor, eligible: torch.Tensor, sparse: int,
                   len_prior: int = 0) -> torch.Tensor:
    """Each pair's exit position from the sparse cache of ``sparse`` pairs (see the module docstring), computed in
    chunks of :data:`ROWS` pairs in position order, the cache's ``K`` pairs carried from one chunk to the next (each
    chunk by :func:`exits_at_once` on ``K + ROWS`` pairs): ``O(M * (K + ROWS))`` comparisons per head, not ``M^2``.
    Arguments and result as :func:`exits_at_once`.
    """
    batch, heads, pairs = score.shape
    if pairs - len_prior <= ROWS:
        return exits_at_once(score, position, eligible, sparse, len_prior)
    device = score.device
    exits = torch.full_like(position, NEVER)
    cache = torch.arange(len_prior, device=device).expand(batch, heads, -1)  # the cache's pairs, by index
    filled = eligible[..., :len_prior]
    for start in range(len_prior, pairs, ROWS):
        chunk = torch.arange(start, min(pairs, start + ROWS), device=device).expand(batch, heads, -1)
        index = torch.cat([cache, chunk], dim=-1)
        local_eligible = torch.cat([filled, eligible.gather(-1, chunk)], dim=-1)
        local_position = position.gather(-1, index)
        local = exits_at_once(score.gather(-1, index), local_position, local_eligible, sparse, cache.shape[-1])
        # a pair of the cache gets its exit from the last chunk that held it (NEVER while it stays)
        exits.scatter_(-1, index, torch.where(local_eligible, local, exits.gather(-1, index)))
        staying = local_eligible & (local == NEVER)  # at most K per head
        order = torch.where(staying, local_position, NEVER).topk(min(sparse, index.shape[-1]), dim=-1,
                                                                  largest=False).indices
        cache, filled = index.gather(-1, order), staying.gather(-1, order)
    return exits


def exits_at_once(score: torch.Tensor, position: torch.Tensor, eligible: torch.Tensor, sparse: int,
                  len_prior: int = 0) -> torch.Tensor:
    """Each pair's exit position from the sparse cache of ``sparse`` pairs, every pair against every other (in
    blocks of :data:`ROWS` rows: ``O(M^2)`` comparisons per head).

    Args:
        score: ``(B, H, M)`` the pairs' scores, higher kept; ties go to the lower position.
        position: ``(B, H, M)`` long absolute positions: the first ``len_prior`` pairs are the cache's (all older
            than the others, in any order), the others in increasing position.
        eligible: ``(B, H, M)`` bool: the pairs that may enter the cache (real, not sinks; the cache's filled slots).
        sparse: ``K``.
        len_prior: how many of the pairs are in the cache already (they entered it before the others).

    Returns:
        ``(B, H, M)`` long: the position of the pair whose arrival displaces each pair from the cache (the
        ``(K - b)``-th later pair that beats it, ``b`` the earlier ones that do); its own position when ``b >= K``
        (it never enters); :data:`NEVER` when it is still there after the last pair, or it is not eligible.
    """
    pairs = score.shape[-1]
    index = torch.arange(pairs, device=score.device)
    exits = []
    for start in range(0, pairs, ROWS):
        stop = min(pairs, start + ROWS)
        own = index[start:stop, None]  # (blk, 1)
        # for a pair of the cache, every other pair of the cache came before it; for a call's pair, those before it
        before = torch.where(own >= len_prior, index[None, :] < own, index[None, :] < len_prior)  # (blk, M)
        after = (index[None, :] > own) & (index[None, :] >= len_prior)
        mine, theirs = score[..., start:stop, None], score[..., None, :]
        my_position = position[..., start:stop, None]
        beats = eligible[..., None, :] & ((theirs > mine) | ((theirs == mine) & (position[..., None, :] < my_position)))
        need = sparse - (beats & before).sum(dim=-1)  # (B, H, blk): later beaters that displace the pair
        # the index of the later beater that reaches ``need`` (the count only grows: where it is below), M if none
        reach = ((beats & after).cumsum(dim=-1, dtype=torch.int32) < need[..., None].clamp_min(1)).sum(dim=-1)
        found = reach < pairs
        displaced_at = position.gather(-1, reach.clamp_max(pairs - 1))
        exit_ = torch.where(found, displaced_at, NEVER)
        exit_ = torch.where(need <= 0, position[..., start:stop], exit_)
        exits.append(torch.where(eligible[..., start:stop], exit_, NEVER))
    return torch.cat(exits, dim=-1)


class _Candidates(NamedTuple):
    """The pairs of one call that may be in a sparse cache: the cache's (``prior`` of them), then the call's keys.
    ``keys``, ``values`` ``(B, H_kv, M, D)``; ``score``, ``position`` ``(B, H_kv, M)``; ``filled`` ``(B, H_kv, M)``
    (eligible); ``valid`` ``(B, M)`` (a real key: the window's)."""

    keys: torch.Tensor
    values: torch.Tensor
    score: torch.Tensor
    position: torch.Tensor
    filled: torch.Tensor
    valid: torch.Tensor
    prior: int


def _candidates(key, value, score, position, valid, eligible, cached: SparsePairs | None) -> _Candidates:
    """The call's keys (``valid`` ``(B, kv)``: real; ``eligible``: real and not sinks) after the cache's pairs."""
    batch, kv_heads, kv_len = score.shape
    shape = (batch, kv_heads, kv_len)
    call = _Candidates(key.expand(batch, -1, -1, -1), value.expand(batch, -1, -1, -1), score,
                       position.expand(*shape), eligible[:, None, :].expand(*shape), valid, 0)
    if cached is None:
        return call
    prior = cached.position.shape[-1]
    cat = lambda old, new: torch.cat([old.to(new.dtype), new], dim=2)  # noqa: E731
    return _Candidates(cat(cached.keys, call.keys), cat(cached.values, call.values), cat(cached.score, score),
                       cat(cached.position, call.position), cat(cached.filled, call.filled),
                       torch.cat([valid.new_zeros(batch, prior), valid], dim=1), prior)


def _row_scale(base, allowed_base, count, compute) -> torch.Tensor:
    """``1 / c`` of each row of a ``p = 1`` base part continued from a state: of the constant, or of ``sqrt`` of the
    count of the pairs it sums (the state's and the call's, at least 1): the base's element-wise row factor."""
    rows = allowed_base.sum(dim=-1, keepdim=True, dtype=compute)  # (B, H_kv, 1, r, 1)
    if count is not None:
        rows = rows + count.to(compute)[:, None, None, None, None]
    return base.pointwise.row_factor(rows.clamp_min(1.0))


def _hand_back(handover, pairs: _Candidates, exits, sparse, state, count, newest_older: int,
               clusters: ClusterRows | None = None) -> None:
    """After a call with a state: add the pairs that went to the distant part to the state (and to their clusters'
    sums, with ``clusters`` the call's :class:`.distant_clusters.ClusterRows`), keep the ``K`` that are in the cache
    after the call's last query, and let the layer keep the window's ``W`` last pairs."""
    leaving = pairs.filled & (exits <= newest_older)  # (B, H_kv, M): in the distant part now, not before the call
    full = torch.promote_types(pairs.keys.dtype, torch.float32)  # the state in fp32 (fp64 for fp64 keys)
    keys, values = pairs.keys.to(full), pairs.values.to(full)
    added = (keys * leaving[..., None]).transpose(-1, -2) @ values  # (B, H_kv, D, D_v)
    state = added if state is None else state + added
    added_count = leaving[:, 0].sum(dim=-1)  # every head holds the same number of pairs (its K best): head 0's
    count = added_count.to(torch.float32) if count is None else count + added_count.to(count.dtype)
    if clusters is not None:  # the pairs that reach the distant part are the ones leaving: clusters' candidates
        reaching = clusters.candidates
        handover.keep_clusters(add_leaving(handover.cluster_state, clusters.onehot, leaving[..., reaching],
                                           keys[:, :, reaching], values[:, :, reaching]))
    staying = pairs.filled & (pairs.position <= newest_older) & (exits > newest_older)  # at most K per head
    slots = min(sparse, staying.shape[-1])
    order = torch.where(staying, pairs.position, NEVER).topk(slots, dim=-1, largest=False).indices  # (B, H_kv, K)
    gather = lambda tensor: tensor.gather(2, order[..., None].expand(-1, -1, -1, tensor.shape[-1]))  # noqa: E731
    kept = SparsePairs(gather(pairs.keys), gather(pairs.values), pairs.score.gather(2, order),
                       pairs.position.gather(2, order), staying.gather(2, order))
    handover.keep_sparse(kept)
    handover.write(state, count)


def _call_weights(soft, weighted, sinks, sink_count, kv_len) -> torch.Tensor:
    """The ``(B, H_kv, G, r, kv)`` weights of a call without a state on its own keys: the candidates are the call's
    keys; the sinks' columns are added at their positions."""
    weights = soft[..., sink_count:] + weighted
    if sink_count:
        index = sinks.position.expand(weights.shape[0], -1)[:, None, None, None, :].expand(*soft.shape[:-1], -1)
        weights = weights.scatter_add(-1, index, soft[..., :sink_count])
    return weights


def _key_valid(mask, query, key) -> torch.Tensor | None:
    if mask is None:
        return None
    if isinstance(mask, KeyPadding):  # None: every key real (read once per forward)
        return None if mask.all_real else mask.key_valid
    causal, key_valid = causal_key_validity(mask, query.shape[2], key.shape[2])
    if not causal:
        raise ValueError("A sparse cache chooses its pairs along each sequence's positions, and this call's mask is "
                         "not causal with padded keys (a model's own sliding window, packed sequences, a static cache "
                         "or a custom mask). Patch without the sparse cache for such calls.")
    return key_valid


__all__ = ["NEVER", "ROWS", "SparsePairs", "exit_positions", "exits_at_once", "in_blocks", "sparse_attention",
           "sparse_path"]
