"""A sparse global cache in a windowed normalization's spelling and record: ``... + sparse K (score)`` parses to the
typed object and back, saves and reloads, and what cannot be a sparse cache is refused with the fix."""

import pytest

from hf_knorm.conversion.settings import DEFAULT_SPARSE_SCORE, ConvertSettings
from hf_knorm.normalizations import Polynomial, Windowed, from_record, parse_normalization, with_sparse, with_window
from hf_knorm.normalizations.sparse_choice import DEFAULT_SCORE, LEGACY_DEFAULT_SCORE
from hf_knorm.recurrent.sparse_cache import SparseWindowStateLayer


@pytest.mark.parametrize("spelling, canonical", [
    ("x/1 + softmax window 64 + sinks 4 + sparse 64 (key_norm)", None),
    ("x/1 + softmax window 64 + sparse 8", "x/1 + softmax window 64 + sparse 8 (prefix_kv_diff)"),
    ("x^3/16+softmax window 4+sparse 2(value_over_key)", "x^3/16 + softmax window 4 + sparse 2 (value_over_key)"),
    ("relu(x)^3/16 + softmax window 8 + sinks 2 + sparse 16 (value_over_key)", None),
    ("x/1 + softmax window 4 + sparse 0", "x/1 + softmax window 4"),
])
def test_the_spelling_parses_to_the_object_and_back(spelling, canonical):
    normalization = parse_normalization(spelling)
    assert normalization.name == (canonical or spelling)
    assert parse_normalization(normalization.name) == normalization
    assert from_record(normalization.to_record()) == normalization


def test_the_object_and_its_record():
    normalization = parse_normalization("x/sqrtN + softmax window 64 + sinks 4 + sparse 32")
    assert normalization == Windowed(parse_normalization("x/sqrtN"), 64, 4, sparse=32,
                                     score="prefix_kv_diff")
    assert (normalization.window, normalization.sinks, normalization.sparse) == (64, 4, 32)
    assert normalization.to_record()["sparse"] == 32 and normalization.to_record()["score"] == "prefix_kv_diff"
    plain = parse_normalization("x/1 + softmax window 4 + sinks 2")
    assert plain.sparse == 0 and "sparse" not in plain.to_record()  # records written before the cache read the same
    assert parse_normalization("x/1").sparse == 0


def test_a_window_set_again_keeps_the_sparse_cache():
    sparse = parse_normalization("x/1 + softmax window 4 + sparse 3")
    assert with_window(sparse, 4, 2) == parse_normalization(
        "x/1 + softmax window 4 + sinks 2 + sparse 3 (prefix_kv_diff)")
    assert with_sparse(parse_normalization("x/1 + softmax window 4"), 3) == sparse
    assert with_sparse(sparse, 0) == parse_normalization("x/1 + softmax window 4")


def test_what_is_not_a_sparse_cache_is_refused():
    with pytest.raises(ValueError, match="integer >= 0, got '-1'"):
        parse_normalization("x/1 + softmax window 4 + sparse -1")
    with pytest.raises(ValueError, match="integer >= 0"):
        with_sparse(parse_normalization("x/1 + softmax window 4"), -2)
    with pytest.raises(ValueError, match="integer >= 0"):
        Windowed(Polynomial(power=1, constant=1.0), 4, sparse=-1)
    with pytest.raises(ValueError, match="has none before it"):
        parse_normalization("x/1 + sparse 8")
    with pytest.raises(ValueError, match="without a softmax window"):
        with_sparse(parse_normalization("x/1"), 8)
    with pytest.raises(ValueError, match="softmax_window=0 contradicts it"):
        with_window(parse_normalization("x/1 + softmax window 4 + sparse 3"), 0)
    with pytest.raises(ValueError, match="Unknown score 'foo'.*accepted: key_norm, value_over_key"):
        parse_normalization("x/1 + softmax window 4 + sparse 3 (foo)")
    with pytest.raises(ValueError, match="kv_diff scores a token against the others"):
        parse_normalization("x/1 + softmax window 4 + sparse 3 (kv_diff)")
    with pytest.raises(ValueError, match="Unknown score"):
        from_record({**parse_normalization("x/1 + softmax window 4 + sparse 3").to_record(), "score": "random"})


def test_one_default_score_for_the_parser_the_conversion_and_the_recurrent_cache():
    """``+ sparse K`` without a score, ``hf-knorm convert``'s cache and a recurrent cache layer built without one all
    read :data:`DEFAULT_SCORE`, ``prefix_kv_diff``."""
    assert DEFAULT_SCORE == "prefix_kv_diff"
    assert parse_normalization("x/1 + softmax window 4 + sparse 3").score == DEFAULT_SCORE
    assert with_sparse(parse_normalization("x/1 + softmax window 4"), 3).score == DEFAULT_SCORE
    assert ConvertSettings(normalization="x/1").target().score == DEFAULT_SPARSE_SCORE == DEFAULT_SCORE
    assert SparseWindowStateLayer(0, window=4, sparse=3).score == DEFAULT_SCORE
    # the canonical name and the record always spell it, the default included
    named = parse_normalization("x/1 + softmax window 4 + sparse 3")
    assert named.name.endswith("sparse 3 (prefix_kv_diff)") and named.to_record()["score"] == "prefix_kv_diff"


def test_a_record_without_a_score_reads_as_the_old_default():
    """A record has always spelled the score; one without it (hand-written, or from before the score was a field) means
    what ``+ sparse K`` meant then, ``key_norm``, not today's default."""
    record = parse_normalization("x/1 + softmax window 4 + sinks 1 + sparse 3 (key_norm)").to_record()
    del record["score"]
    assert LEGACY_DEFAULT_SCORE == "key_norm" != DEFAULT_SCORE
    assert from_record(record) == parse_normalization("x/1 + softmax window 4 + sinks 1 + sparse 3 (key_norm)")
    # without a cache the score means nothing: one object whichever a record carried
    assert from_record({**parse_normalization("x/1 + softmax window 4").to_record(), "score": "key_norm"}) == \
        parse_normalization("x/1 + softmax window 4")


def test_the_default_score_on_a_short_window_says_to_spell_another():
    with pytest.raises(ValueError, match=r"at least 3 .*got 2 \(it is the default score: spell a per-token one"):
        parse_normalization("x/16 + softmax window 2 + sparse 1")
    assert parse_normalization("x/16 + softmax window 2 + sparse 1 (key_norm)").score == "key_norm"
