"""Clusters beside the sparse cache (``hf_knorm/attention/distant_clusters.py``): the attention against the plain
reference (a loop over the clusters, each a logit and equal shares of its weight), the bounded state against the
whole computation, and what is refused.

Tolerances: fp64 throughout, outputs and gradients (query, key, value, the mix) within 1e-10 absolute (values of size
~1-10; the paths sum the same terms in another order: per-cluster sums, then one product with the query). Rows
compared: every query whose own key is real.
"""

import math

import pytest
import torch

from hf_knorm.attention import distant_clusters, sparse
from hf_knorm.attention.distant_clusters import assignments
from hf_knorm.attention.masks import KeyPadding
from hf_knorm.attention.reference import reference_window_attention
from hf_knorm.attention.window import window_attention
from hf_knorm.normalizations import parse_normalization

ATOL = 1e-10


def _inputs(batch=2, q_heads=6, kv_heads=2, length=41, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes]


def _codebook(kv_heads=2, clusters=5, dim=8, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(kv_heads, clusters, dim, generator=generator,
                                                     dtype=torch.float64), dim=-1)


def _valid(kind, batch, length):
    if kind == "none":
        return None
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :5] = False
    if kind == "holes":
        valid[0, [3, 11, length - 4]] = False
    return valid


CASES = [  # spelling, padding, query heads
    ("x/1 + softmax window 4 + sinks 1 + sparse 3 (key_norm) + clusters 5", "none", 6),
    ("x/1 + softmax window 3 + sinks 2 + sparse 2 (prefix_kv_diff) + clusters 5", "left", 6),
    ("x/sqrtN + softmax window 5 + sparse 4 (value_over_key) + clusters 5", "holes", 2),
    ("relu(x)^2/16 + softmax window 4 + sinks 1 + sparse 2 (key_norm) + clusters 5", "left", 6),
]


@pytest.mark.parametrize("sub_rows", [32, 3])  # 3: the pairs every row of 3 holds folded into sums, block by block
@pytest.mark.parametrize("rows", [256, 5])  # 5: in blocks, the clusters' sums carried from one to the next
@pytest.mark.parametrize("spelling, kind, q_heads", CASES)
def test_the_attention_equals_the_plain_reference(spelling, kind, q_heads, rows, sub_rows, monkeypatch):
    monkeypatch.setattr(sparse, "ROWS", rows)
    monkeypatch.setattr(distant_clusters, "SUB_ROWS", sub_rows)
    normalization = parse_normalization(spelling)
    query, key, value = _inputs(q_heads=q_heads)
    codebook = _codebook()
    mix = torch.linspace(-2.0, 3.0, q_heads, dtype=torch.float64).requires_grad_()
    valid = _valid(kind, 2, 41)
    mask = None if valid is None else KeyPadding(valid, 41, causal=True)
    allowed = None if valid is None else mask.dense()
    got, _ = window_attention(query, key, value, mask, normalization, mix=mix, codebook=codebook)
    want, _ = reference_window_attention(query, key, value, allowed, normalization, mix=mix, codebook=codebook)
    real = torch.ones(2, 41, dtype=torch.bool) if valid is None else valid
    weight = torch.randn_like(want) * real[:, :, None, None]
    torch.testing.assert_close(got * weight.ne(0), want * weight.ne(0), rtol=0, atol=ATOL)
    inputs = (query, key, value, mix)
    expected = torch.autograd.grad((want * weight).sum(), inputs)
    actual = torch.autograd.grad((got * weight).sum(), inputs)
    for name, a, b in zip(["query", "key", "value", "window_mix"], actual, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"d{name}")


def test_the_clusters_change_the_output_and_one_cluster_per_pair_is_softmax_over_every_key():
    """A codebook that puts each distant key alone in its cluster (the keys' own directions) makes every pseudo-pair
    an exact pair (mean = the key, ``log 1 = 0``): softmax over every key, whatever the cache; a codebook of a few
    directions gives neither that nor the cache without clusters."""
    query, key, value = (t.detach() for t in _inputs(batch=1, kv_heads=2, length=30))
    own = torch.nn.functional.normalize(key[0], dim=-1)  # (H_kv, 30, D): 30 clusters, key j's direction j
    every, _ = window_attention(query, key, value, None, parse_normalization(
        "x/1 + softmax window 4 + sinks 1 + sparse 2 + clusters 30"), mix=torch.zeros(6, dtype=torch.float64),
        codebook=own)
    full = torch.softmax(query @ key.repeat_interleave(3, 1).transpose(-1, -2) / math.sqrt(8)
                         + torch.full((30, 30), -math.inf, dtype=torch.float64).triu(1), dim=-1)
    torch.testing.assert_close(every, (full @ value.repeat_interleave(3, 1)).transpose(1, 2), rtol=0, atol=ATOL)
    few, _ = window_attention(query, key, value, None, parse_normalization(
        "x/1 + softmax window 4 + sinks 1 + sparse 2 + clusters 5"), codebook=_codebook())
    without, _ = window_attention(query, key, value, None, parse_normalization(
        "x/1 + softmax window 4 + sinks 1 + sparse 2"))
    assert (few - without).abs().amax() > 1e-2 and (few - every).abs().amax() > 1e-2


def test_each_key_joins_the_direction_of_highest_cosine():
    codebook = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    keys = torch.tensor([[[[5.0, 1.0], [0.1, 0.2], [-3.0, 2.0], [1.0, -9.0]]]])
    onehot = assignments(keys, codebook, torch.float32)
    assert onehot.argmax(-1).tolist() == [[[0, 1, 2, 0]]] and onehot.sum(-1).eq(1).all()


def test_the_returned_weights_are_the_references():
    normalization = parse_normalization("x/1 + softmax window 3 + sinks 1 + sparse 2 + clusters 5")
    query, key, value = (t.detach() for t in _inputs())
    valid = _valid("holes", 2, 41)
    mask = KeyPadding(valid, 41, causal=True)
    mix = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)
    _, got = window_attention(query, key, value, mask, normalization, mix=mix, codebook=_codebook(),
                              return_weights=True)
    _, want = reference_window_attention(query, key, value, mask.dense(), normalization, mix=mix, codebook=_codebook())
    real = valid[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=ATOL)


def test_an_unfitted_or_misshapen_codebook_and_a_softcap_are_refused():
    normalization = parse_normalization("x/1 + softmax window 3 + sparse 2 + clusters 5")
    query, key, value = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match="no cluster codebook"):
        window_attention(query, key, value, None, normalization)
    with pytest.raises(ValueError, match="never fitted"):
        window_attention(query, key, value, None, normalization, codebook=torch.zeros(2, 5, 8))
    with pytest.raises(ValueError, match=r"\(2, 5, 8\)"):
        window_attention(query, key, value, None, normalization, codebook=_codebook(clusters=4))
    with pytest.raises(ValueError, match="softcap"):
        window_attention(query, key, value, None, normalization, codebook=_codebook(), softcap=5.0)
