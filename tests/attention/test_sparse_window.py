"""A sparse global cache beside the softmax window (``hf_knorm/attention/sparse.py``): its choice of pairs against an
online cache simulated pair by pair, the attention against the plain reference (which sorts each row's older keys),
and what it refuses.

Tolerances: fp64 throughout, outputs and gradients (query, key, value, the mix, a family's learned values) within
1e-10 absolute (values of size ~1-10; the paths sum the same terms in another order). Rows compared: every query
whose own key is real (a padded query has no position, as for the window alone).
"""

import pytest
import torch

from hf_knorm.attention import sparse
from hf_knorm.attention.masks import KeyPadding
from hf_knorm.attention.reference import (reference_attention, reference_scores, reference_window_attention,
                                         sparse_split, window_split)
from hf_knorm.attention.sparse import NEVER, exit_positions
from hf_knorm.attention.window import window_attention, window_path
from hf_knorm.eviction.scores import KeyNorm, ValueOverKey
from hf_knorm.normalizations import Softmax, parse_normalization
from hf_knorm.normalizations.sparse_choice import SPARSE_SCORES, ranked, token_scores

ATOL = 1e-10


def _inputs(batch=2, q_heads=6, kv_heads=2, length=37, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes]


def _valid(kind, batch, length):
    if kind == "none":
        return None
    valid = torch.ones(batch, length, dtype=torch.bool)
    if kind in ("left", "holes"):
        valid[1, :5] = False
    if kind == "holes":
        valid[0, [3, 11, length - 4]] = False
    return valid


def _online_exits(score, eligible, sparse_count):
    """The cache run pair by pair, as a decoding layer would: each eligible pair enters; when the cache holds more
    than ``K``, the weakest (lowest score, ties: the newest) leaves at that pair's position. ``score`` ``(M,)``,
    ``eligible`` ``(M,)`` lists. Returns each pair's exit position (``NEVER``: still in the cache, or not eligible)."""
    exits, cache = [NEVER] * len(score), []
    for t, (value, ok) in enumerate(zip(score, eligible)):
        if not ok:
            continue
        cache.append(t)
        if len(cache) > sparse_count:
            weakest = min(cache, key=lambda j: (score[j], -j))
            cache.remove(weakest)
            exits[weakest] = t
    return exits


@pytest.mark.parametrize("rows", [256, 4])  # 4: in chunks of 4 pairs, the cache carried between them
@pytest.mark.parametrize("sparse_count", [1, 3, 8, 40])
@pytest.mark.parametrize("ties", [False, True])
def test_the_exit_positions_are_those_of_a_cache_run_pair_by_pair(sparse_count, ties, rows, monkeypatch):
    monkeypatch.setattr(sparse, "ROWS", rows)
    generator = torch.Generator().manual_seed(sparse_count)
    score = torch.randn(2, 3, 30, generator=generator)
    if ties:  # few distinct values: the older pair must win each tie
        score = score.mul(2).round()
    eligible = torch.rand(2, 1, 30, generator=generator) > 0.2
    position = torch.arange(30).expand(2, 3, 30)
    got = exit_positions(score, position, eligible.expand(2, 3, 30), sparse_count)
    for b in range(2):
        for h in range(3):
            want = _online_exits(score[b, h].tolist(), eligible[b, 0].tolist(), sparse_count)
            assert got[b, h].tolist() == want


@pytest.mark.parametrize("rows", [256, 3])
def test_a_cache_continued_from_its_pairs_exits_as_the_whole_run(rows, monkeypatch):
    """The first 17 pairs run, the cache's pairs kept (in shuffled slots, empty ones among them), then the next 13
    given after them: the same exits as one run over the 30, so a decoding cache continues the full forward."""
    monkeypatch.setattr(sparse, "ROWS", rows)
    sparse_count, split = 4, 17
    generator = torch.Generator().manual_seed(1)
    score = torch.randn(1, 2, 30, generator=generator).mul(2).round()
    eligible = torch.ones(1, 2, 30, dtype=torch.bool)
    eligible[..., 5] = False
    position = torch.arange(30).expand(1, 2, 30)
    whole = exit_positions(score, position, eligible, sparse_count)
    head = exit_positions(score[..., :split], position[..., :split], eligible[..., :split], sparse_count)
    staying = (head == NEVER) & eligible[..., :split]  # (1, 2, 17): K per head
    slots = [torch.nonzero(staying[0, h]).flatten() for h in range(2)]
    assert all(len(s) == sparse_count for s in slots)
    order = torch.stack([s[torch.randperm(sparse_count, generator=generator)] for s in slots])[None]  # (1, 2, K)
    order = torch.cat([order, torch.zeros(1, 2, 1, dtype=torch.long)], dim=-1)  # an empty slot
    filled = torch.cat([torch.ones(1, 2, sparse_count, dtype=torch.bool), torch.zeros(1, 2, 1, dtype=torch.bool)], -1)
    prior = order.shape[-1]
    cat = lambda cached, rest: torch.cat([cached, rest], dim=-1)  # noqa: E731
    continued = exit_positions(cat(score.gather(2, order), score[..., split:]),
                               cat(position.gather(2, order), position[..., split:]),
                               cat(filled, eligible[..., split:]), sparse_count, len_prior=prior)
    assert torch.equal(continued[..., prior:], whole[..., split:])
    kept = continued[..., :sparse_count]
    assert torch.equal(kept, whole.gather(2, order[..., :sparse_count]))
    assert (continued[..., sparse_count] == NEVER).all()  # the empty slot


@pytest.mark.parametrize("name, cls", [("key_norm", KeyNorm), ("value_over_key", ValueOverKey)])
def test_the_scores_are_the_eviction_scores(name, cls):
    keys, values = torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
    positions = torch.arange(11).expand(2, 3, 11)
    assert torch.equal(token_scores(name, keys, values), cls()(keys, values, positions, 0))
    assert set(SPARSE_SCORES) == {"key_norm", "value_over_key", "prefix_kv_diff"}


CASES = [
    # spelling, key validity, q_heads, softcap
    ("x/1 + softmax window 4 + sparse 3", "none", 6, None),
    ("x/1 + softmax window 4 + sinks 2 + sparse 3", "left", 6, None),
    ("x/sqrtN + softmax window 3 + sinks 1 + sparse 5 (value_over_key)", "holes", 2, None),
    ("x/16 + softmax window 1 + sparse 1 (key_norm)", "left", 6, None),
    ("x^3/16 + softmax window 5 + sinks 2 + sparse 4", "holes", 6, None),
    ("x^3/sqrtN + softmax window 2 + sparse 2 (key_norm)", "left", 6, 3.0),
    ("relu(x)^3/16 + softmax window 4 + sinks 1 + sparse 3", "left", 6, None),
    ("sigmoid(bias=learned) + softmax window 4 + sparse 3", "holes", 6, None),
    ("x/1 + softmax window 3 + sinks 1 + sparse 4 (prefix_kv_diff)", "holes", 6, None),
    ("x/sqrtN + softmax window 5 + sparse 3 (prefix_kv_diff)", "left", 2, None),
    ("relu(x)^2/16 + softmax window 4 + sinks 2 + sparse 2 (prefix_kv_diff)", "none", 6, None),
]


@pytest.mark.parametrize("rows", [256, 5])  # 5: the queries and the exit positions in several blocks
@pytest.mark.parametrize("spelling, kind, q_heads, softcap", CASES)
def test_the_attention_equals_the_plain_reference(spelling, kind, q_heads, softcap, rows, monkeypatch):
    monkeypatch.setattr(sparse, "ROWS", rows)
    normalization = parse_normalization(spelling)
    query, key, value = _inputs(q_heads=q_heads)
    mix = torch.linspace(-2.0, 3.0, q_heads, dtype=torch.float64).requires_grad_()
    params = {name: torch.full((q_heads,), -1.5, dtype=torch.float64, requires_grad=True)
              for name in normalization.without_window.learnable()}
    valid = _valid(kind, 2, 37)
    mask = None if valid is None else KeyPadding(valid, 37, causal=True)
    allowed = None if valid is None else mask.dense()
    got, _ = window_attention(query, key, value, mask, normalization, mix=mix, params=params, softcap=softcap)
    want, _ = reference_window_attention(query, key, value, allowed, normalization, mix=mix, params=params,
                                         softcap=softcap)
    rows_real = torch.ones(2, 37, dtype=torch.bool) if valid is None else valid
    weight = torch.randn_like(want) * rows_real[:, :, None, None]
    torch.testing.assert_close(got * weight.ne(0), want * weight.ne(0), rtol=0, atol=ATOL)
    inputs = (query, key, value, mix, *params.values())
    expected = torch.autograd.grad((want * weight).sum(), inputs)
    actual = torch.autograd.grad((got * weight).sum(), inputs)
    for name, a, b in zip(["query", "key", "value", "window_mix", *params], actual, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"d{name}")


@pytest.mark.parametrize("kind", ["none", "left", "holes"])
def test_a_p1_call_runs_in_blocks_that_do_not_grow_with_the_length(kind, monkeypatch):
    """``p = 1``: the full forward runs as the bounded cache decodes, ``ROWS`` queries at a time on the window's keys
    before them and their own (the sinks and the sparse cache beside them, the older pairs in a state), so no block
    grows with the length; it equals the masked computation of every row at once (the recorded norms take that)."""
    monkeypatch.setattr(sparse, "ROWS", 6)
    normalization = parse_normalization("x/sqrtN + softmax window 4 + sinks 2 + sparse 3")
    query, key, value = (t.detach() for t in _inputs(length=60))
    valid = _valid(kind, 2, 60)
    mask = None if valid is None else KeyPadding(valid, 60, causal=True)
    blocks, attend = [], sparse._attend
    monkeypatch.setattr(sparse, "_attend", lambda q, k, *args, **kw: blocks.append(k.shape[2]) or attend(q, k, *args, **kw))
    got, _ = window_attention(query, key, value, mask, normalization)
    assert len(blocks) == 10 and max(blocks) == 6 + 4
    blocks.clear()
    frobenius_sq = torch.zeros(2, 2, 3, dtype=torch.float64)
    every_row, _ = window_attention(query, key, value, mask, normalization, frobenius_sq=frobenius_sq)
    assert blocks == [60]
    rows = torch.ones(2, 60, dtype=torch.bool) if valid is None else valid
    torch.testing.assert_close(got[rows], every_row[rows], rtol=0, atol=ATOL)


@pytest.mark.parametrize("score", sorted(SPARSE_SCORES))
def test_the_sparse_cache_changes_the_output_and_holds_what_the_window_leaves(score):
    """With ``K`` at least the older keys, every key is weighted by softmax: the model's own attention, whatever the
    score and the mix (what a conversion trains on blocks no longer than ``W + S + K`` does not depend on the score);
    with ``K`` below, the output is neither that nor the window alone's."""
    query, key, value = (t.detach() for t in _inputs())
    everything, _ = window_attention(query, key, value, None, parse_normalization(
        f"x/1 + softmax window 4 + sparse 40 ({score})"), mix=torch.linspace(-2.0, 3.0, 6, dtype=torch.float64))
    softmax, _ = reference_attention(query, key, value, None, Softmax(), causal=True)
    torch.testing.assert_close(everything, softmax, rtol=0, atol=ATOL)
    some, _ = window_attention(query, key, value, None, parse_normalization(
        "x/1 + softmax window 4 + sparse 3"))
    window_alone, _ = reference_window_attention(query, key, value, None, parse_normalization(
        "x/1 + softmax window 4"))
    assert (some - window_alone).abs().amax() > 1e-2 and (some - softmax).abs().amax() > 1e-2


def test_each_row_reads_its_best_older_keys_in_the_softmax_part():
    """The reference's choice for x/1 + softmax window 3 + sinks 1 + sparse 2, row by row, for one head: the 2 older
    keys of lowest key norm."""
    _, key, value = (t.detach() for t in _inputs(batch=1, kv_heads=1, length=12))
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    _, older = window_split(allowed, 3, 1)
    chosen = sparse_split(older, reference_scores("key_norm", key, value, None), 2)[0, 0]
    norms = ranked(key[0, 0].norm(dim=-1))  # ranked at 8 bits, ties to the older key
    for i in range(12):
        candidates = list(range(1, i - 2))  # older than the window, not the sink
        want = sorted(candidates, key=lambda j: (norms[j].item(), j))[:2]
        assert torch.nonzero(chosen[i]).flatten().tolist() == sorted(want)


@pytest.mark.parametrize("spelling", ["x/1 + softmax window 3 + sinks 2 + sparse 3", "x^3/16 + softmax window 4 + sparse 2"])
def test_the_returned_weights_and_the_recorded_norms_are_the_references(spelling):
    normalization = parse_normalization(spelling)
    query, key, value = (t.detach() for t in _inputs())
    valid = _valid("left", 2, 37)
    mask = KeyPadding(valid, 37, causal=True)
    mix = torch.linspace(-2.0, 3.0, 6, dtype=torch.float64)
    frobenius_sq = torch.zeros(2, 2, 3, dtype=torch.float64)
    _, got = window_attention(query, key, value, mask, normalization, mix=mix, return_weights=True,
                              frobenius_sq=frobenius_sq)
    _, want = reference_window_attention(query, key, value, mask.dense(), normalization, mix=mix)
    rows = valid[:, None, :, None]
    torch.testing.assert_close(got * rows, want * rows, rtol=0, atol=ATOL)
    torch.testing.assert_close(frobenius_sq.view(2, 6), want.square().sum(dim=(-2, -1)), rtol=1e-10, atol=ATOL)


def test_calls_the_definition_does_not_cover_are_refused():
    normalization = parse_normalization("x/1 + softmax window 3 + sparse 2")
    query, key, value = (t.detach() for t in _inputs(length=9))
    call = lambda mask=None, **options: window_attention(query, key, value, mask, normalization, **options)  # noqa: E731
    with pytest.raises(ValueError, match="own sliding window of 5 positions"):
        call(sliding_window=5)
    with pytest.raises(ValueError, match="bias"):
        call(bias=torch.zeros(1, 1, 9, 9, dtype=torch.float64))
    with pytest.raises(ValueError, match="dropout"):
        call(dropout=0.1)
    with pytest.raises(ValueError, match="bidirectional"):
        call(causal=False)
    banded = torch.ones(9, 9, dtype=torch.bool).tril() & ~torch.ones(9, 9, dtype=torch.bool).tril(-4)
    with pytest.raises(ValueError, match="not causal with padded keys"):
        call(banded[None, None])
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]  # an explicit mask that is exactly causal: read
    torch.testing.assert_close(call(causal)[0], call()[0], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        call(mix=torch.ones(3, dtype=torch.float64))


def test_window_attention_is_the_one_composition_and_computes_the_sparse_cache():
    """``window_attention`` with ``sparse > 0`` is the sparse cache's computation (``sparse = 0`` its special case),
    and ``window_path`` counts it as the attention function does (``"sparse"``)."""

    normalization = parse_normalization("x/1 + softmax window 4 + sinks 2 + sparse 3")
    query, key, value = (t.detach() for t in _inputs())
    mask = KeyPadding(_valid("left", 2, 37), 37, causal=True)
    got, _ = window_attention(query, key, value, mask, normalization)
    want, _ = window_attention(query, key, value, mask, normalization)
    assert torch.equal(got, want)
    reference, _ = reference_window_attention(query, key, value, mask.dense(), normalization)
    rows = _valid("left", 2, 37)[:, :, None, None]
    torch.testing.assert_close(got * rows, reference * rows, rtol=0, atol=ATOL)
    path = window_path(normalization, 37, 37, mask, None, causal=True, softcap=None, dropout=0.0,
                       return_weights=False, has_state=False)
    assert path.name == "sparse" and path.linear
