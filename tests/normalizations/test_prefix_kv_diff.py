"""``prefix_kv_diff`` (``hf_knorm/normalizations/prefix_kv_diff.py``): against the plain reference (a loop over the
tokens), continued from call to call as the chunked forward and a decoding cache run it, and what it refuses.

Tolerances: fp64 inputs, scores within 1e-12 (values of size ~1; running sums against a loop's means).
"""

import pytest
import torch

from hf_knorm.attention.reference import reference_prefix_kv_diff
from hf_knorm.normalizations.prefix_kv_diff import REACH, prefix_kv_diff

ATOL = 1e-12


def _pairs(batch=2, heads=3, length=30, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, 8, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, heads, length, 6, generator=generator, dtype=torch.float64)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    valid[0, [3, 11, length - 4]] = False  # holes
    return keys, values, valid


def test_one_call_equals_the_plain_reference():
    keys, values, valid = _pairs()
    got, _ = prefix_kv_diff(keys, values, valid)
    torch.testing.assert_close(got, reference_prefix_kv_diff(keys, values, valid), rtol=0, atol=ATOL)
    assert (got[~valid[:, None, :].expand_as(got)] == 0).all()
    unpadded, _ = prefix_kv_diff(keys, values, None)
    torch.testing.assert_close(unpadded, reference_prefix_kv_diff(keys, values, torch.ones(2, 30, dtype=torch.bool)),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("window", [3, 4, 9])
@pytest.mark.parametrize("sizes", [(5, 4) + (1,) * 21, (7, 7, 7, 9), (30,)])
def test_calls_continued_from_the_statistics_give_the_scores_of_one_call(window, sizes):
    """Each call holds the window's last ``W`` keys before its own (as a decoding layer hands them over, and the
    chunked forward slices them): every score that is final by the call's end (its token at least ``REACH`` before
    it) is the one call's, and so is every later score of the window's keys."""
    keys, values, valid = _pairs()
    whole, _ = prefix_kv_diff(keys, values, valid)
    carried, seen = None, 0
    for size in sizes:
        first, end = max(0, seen - window), seen + size
        got, carried = prefix_kv_diff(keys[:, :, first:end], values[:, :, first:end], valid[:, first:end], first,
                                      carried, window)
        final = end - REACH - first
        torch.testing.assert_close(got[..., :final], whole[..., first:end - REACH], rtol=0, atol=ATOL)
        assert int(carried.seen) == end and carried.tail.shape[-1] == window + REACH
        seen = end
    assert int(carried.count[1]) == valid[1].sum()


def test_a_key_unlike_those_before_it_scores_highest():
    """A filler of one repeated pair scores 0 throughout (no spread yet); the one distinct pair in it, and its
    neighbours through the pooling, score above every filler pair that is not their neighbour."""
    keys = torch.ones(1, 1, 40, 4, dtype=torch.float64)
    values = torch.ones(1, 1, 40, 4, dtype=torch.float64)
    keys[0, 0, 20] = torch.tensor([1.0, -1.0, 2.0, 0.0], dtype=torch.float64)
    values[0, 0, 20] = torch.tensor([-1.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    score, _ = prefix_kv_diff(keys, values, None)
    assert (score[0, 0, :18] == 0).all()
    assert score[0, 0, 18:23].min() > score[0, 0, 23:].max()
    assert score[0, 0].argmax() in range(18, 23)


def test_calls_it_cannot_continue_are_refused():
    keys, values, valid = _pairs()
    _, carried = prefix_kv_diff(keys[:, :, :10], values[:, :, :10], valid[:, :10], 0, None, window=3)
    with pytest.raises(ValueError, match="starting at position 4 needs the statistics"):
        prefix_kv_diff(keys[:, :, 4:12], values[:, :, 4:12], valid[:, 4:12], 4, None, window=3)
    with pytest.raises(ValueError, match="positions 12..15 cannot continue statistics of positions 0..9"):
        prefix_kv_diff(keys[:, :, 12:16], values[:, :, 12:16], valid[:, 12:16], 12, carried, window=3)  # a gap
    with pytest.raises(ValueError, match="keep the last 5"):
        prefix_kv_diff(keys[:, :, 5:12], values[:, :, 5:12], valid[:, 5:12], 5, carried, window=3)  # 5 old keys
    with pytest.raises(ValueError, match="cannot continue"):
        prefix_kv_diff(keys[:, :, 7:10], values[:, :, 7:10], valid[:, 7:10], 7, carried, window=3)  # nothing new
