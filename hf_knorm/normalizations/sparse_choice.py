"""Which older key/value pairs a sparse global cache keeps: a score per token, fixed before the token leaves the window.

A windowed normalization with ``+ sparse K (score)`` (:class:`.windowed.Windowed`) keeps, for each query and KV head,
the ``K`` best keys older than its window (LoLA, McDermott et al., arXiv 2505.23666: a sparse global cache beside a
sliding window and a linear state). "Best" is the highest rank (a per-token score rounded to 8 significant bits,
:func:`ranked`, so that decoding and the full forward see the same ties), ties going to the older key, so the choice
is a total order. Because each token's score is fixed before the token leaves the window, the best ``K`` of a growing
prefix change by at most one pair per new older key: a pair leaving the window either enters the cache (displacing
the weakest, which then goes to the distant part for good) or goes to the distant part itself. That online rule,
what a decoding cache can run in bounded memory, picks exactly the set the full forward picks for every query
(:func:`hf_knorm.attention.sparse.exit_positions` computes it; the plain reference sorts each row's older keys).

Two per-token scores, those of :mod:`hf_knorm.eviction.scores` (that module sits above the attention, so they are
restated here; ``tests/attention/test_sparse_window.py`` checks them equal to the eviction's), and one relative to the
context before the token:

- ``key_norm``: ``-||k||``, KNorm (Devoto et al., arXiv 2406.11430): keep the lowest-norm keys;
- ``value_over_key``: ``||v|| / ||k||`` (VATP-style, arXiv 2406.12335, with KNorm's proxy for the attention);
- ``prefix_kv_diff``: the eviction's ``kv_diff`` with its mean directions and its standardization taken over each
  token's prefix, final two tokens after it (:mod:`.prefix_kv_diff`): a call carries its running statistics to the
  next, so it needs a window of at least 3.

Not offered, because they cannot be replayed exactly by a prefix rule: ``key_diff`` and ``kv_diff`` compare each key
with the mean direction of the keys being scored (it changes as the context grows: ``prefix_kv_diff`` is the version
that does not), and LoLA's self-recall error ``||v - S^T phi(k)||`` depends on the state at the time the pair is
scored; ``random`` draws per call, not per token.
"""

from __future__ import annotations

import torch

from .prefix_kv_diff import REACH, prefix_kv_diff

DEFAULT_SCORE = "prefix_kv_diff"
"""The one default score (the parser's for ``+ sparse K`` without a score, ``hf-knorm convert``'s, the recurrent
cache's): ``prefix_kv_diff``. Why: it is the score measured best for retrieval beyond the window
(docs/results/conversion.md, 'The default conversion': at 4,000 tokens it keeps 6 of 8 passkeys on each of three
seeds where ``value_over_key`` keeps 0, 0 and 2, and ``key_norm`` 1 of 8 at 64 pairs), and it ranks pairs by their
directions in context, so the keys of a QK-norm model (Qwen3, Gemma3), which share one norm, do not all tie as they
do under ``key_norm``. It needs a window of at least ``REACH + 1 = 3`` keys; a shorter window names another score."""

LEGACY_DEFAULT_SCORE = "key_norm"
"""What ``+ sparse K`` without a score meant before :data:`DEFAULT_SCORE` was ``prefix_kv_diff`` (the parser's
default until then): a saved record without a ``score`` reads as this (:meth:`.windowed.Windowed.from_record`), so a
model saved then means what it meant. The canonical name and the record have always spelled the score."""


def _key_norm(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return -_full(keys).norm(dim=-1)


def _value_over_key(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _full(values).norm(dim=-1) / _full(keys).norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))  # fp32 (as the eviction), fp64 kept


PER_TOKEN_SCORES = {"key_norm": _key_norm, "value_over_key": _value_over_key}
"""Each per-token score by name: ``fn(keys, values)`` on ``(B, H_kv, N, D)`` -> ``(B, H_kv, N)`` float32 (fp64 for
fp64 inputs), higher = kept.

Ties. Such a score ties exactly in two common cases: at the first layer a repeated token's keys differ only by their
rotation (the same norm, the same value), and under QK-norm (Qwen3, Gemma3) every key has the norm its RMSNorm weight
sets (``value_over_key`` is then about ``||v||``). A decoded token's key is rounded differently from the full
forward's, so the cache ranks :func:`ranked` scores: the ties are equal ranks in both, decided by position (the older
pair kept)."""

PREFIX_SCORES = ("prefix_kv_diff",)
"""The scores relative to each token's prefix (:mod:`.prefix_kv_diff`), carried from one call to the next."""

SPARSE_SCORES = (*PER_TOKEN_SCORES, *PREFIX_SCORES)
"""Every score a sparse cache accepts."""

CONTEXT_DEPENDENT = ("key_diff", "kv_diff", "random", "self_recall")


def check_sparse_score(score: str, window: int | None = None) -> None:
    """Raise ``ValueError`` unless ``score`` names a score of :data:`SPARSE_SCORES` that a window of ``window``
    tokens (``None``: not known yet) lets be final before its token leaves the window."""
    if score in PREFIX_SCORES:
        if window is not None and window <= REACH:
            raise ValueError(f"{score} is final {REACH} tokens after its token, so it needs a softmax window of at "
                             f"least {REACH + 1} (the window's pairs are not ranked); got {window}"
                             + (" (it is the default score: spell a per-token one, e.g. 'sparse K (key_norm)')."
                                if score == DEFAULT_SCORE else "."))
        return
    if score in SPARSE_SCORES:
        return
    why = (f" {score} scores a token against the others being scored (or the state), so the pairs it keeps cannot be "
           "chosen the same way in the full forward and in bounded decoding; prefix_kv_diff is kv_diff over each "
           "token's prefix, which can." if score in CONTEXT_DEPENDENT else "")
    raise ValueError(f"Unknown score {score!r} for a sparse cache; accepted: {', '.join(SPARSE_SCORES)}.{why}")


def token_scores(score: str, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A per-token score of each pair: ``keys``, ``values`` ``(B, H_kv, N, D)`` -> ``(B, H_kv, N)`` float32 (fp64
    for fp64)."""
    return PER_TOKEN_SCORES[score](keys, values)


RANK_DTYPE = torch.bfloat16
"""The precision at which a sparse cache ranks a per-token score: bfloat16, 8 significant bits (:func:`ranked`)."""


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """Per-token ``scores`` rounded to the nearest :data:`RANK_DTYPE` value (8 significant bits, 2^-8 of their
    size), in their dtype: what the sparse cache ranks, equal ranks going to the older pair.

    Why. A per-token score ties exactly where two keys differ by a rotation or a scale that the score ignores: a
    repeated token's keys at the first layer under ``key_norm`` or ``value_over_key``, every key of a QK-norm model
    (Qwen3, Gemma3) under ``key_norm``. A decoded key is computed by another sequence of floating-point operations
    than the full forward's (on the default model ~3e-7 of its norm apart at the first layer, ~1e-6 deeper), so
    those ties came out ordered by rounding, differently in the two. Rounded to 8 bits, they are equal ranks in both,
    and the position decides: decoding keeps the pairs the full forward keeps
    (``tests/recurrent/test_sparse_ties.py``). Scores within 2^-8 of each other are ranked by position too (no
    measurable loss: they are the same key norm to 0.4%).

    What remains. A score within rounding (~1e-6 of its size) of the midpoint between two 8-bit values can round
    either way: for a tied pair about 2^9 times that relative rounding, ~1e-4 at the first layer; keys rounded more
    coarsely (a bf16 model's own keys) are not covered. ``prefix_kv_diff`` is not rounded: its scores are standardized
    differences of directions that do not tie by construction, and rounding them to a grid would turn their decoding
    noise (~5e-6 on the default model, against gaps of 3e-5 and more between distinct scores) into rank changes at
    the grid's steps."""
    return scores.to(RANK_DTYPE).to(scores.dtype)


def call_scores(score: str, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, *, first: int = 0,
                carried=None, window: int = 0):
    """The ranks of a call's pairs (a per-token score :func:`ranked`, a prefix score as it is) and what the next call
    continues: ``(ranks (B, H_kv, N), carried)``.

    Args:
        keys, values: ``(B, H_kv, N, D)`` at absolute positions ``first .. first + N - 1``.
        valid: ``(B, N)`` bool, the real tokens (``None``: all).
        carried: what the call before handed over (``None``: the call starts its sequences); always ``None`` for a
            per-token score.
        window: ``W``, how far before the carried positions a later call may start (its window's kept pairs).
    """
    if score in PREFIX_SCORES:
        return prefix_kv_diff(keys, values, valid, first, carried, window)
    return ranked(token_scores(score, keys, values)), None
