"""A spelling that does not parse names the part that failed, suggests the nearest valid spelling and shows the grammar
(:mod:`hf_knorm.normalizations.grammar`); valid spellings parse to the same objects as before the grammar was written
down. The checks are on the part named and the suggestion (``SpellingError.part``, ``.suggestion``, and both quoted
in the message), not on the prose around them."""

import pickle

import pytest
from family_cases import ALL_EXAMPLES

from hf_knorm.normalizations import (FAMILIES, Polynomial, Sigmoid, SpellingError, Windowed, normalization_grammar,
                                     parse_normalization)
from hf_knorm.normalizations.grammar import PARTS, parts_usage
from hf_knorm.normalizations.sparse_choice import SPARSE_SCORES

WRONG = [  # (spelling, the part named as typed, the suggestion)
    ("sigmod", "sigmod", "sigmoid(bias=-log n)"),
    ("x^3/16 + window 64", "+ window 64", "x^3/16 + softmax window 64"),
    ("x^3/16 + softmax window sixty", "+ softmax window sixty", "x^3/16 + softmax window 64"),
    ("x^3/16 + softmax window 64 + sink 4", "+ sink 4", "x^3/16 + softmax window 64 + sinks 4"),
    ("x/1 + sparse 64", "+ sparse 64", "x/1 + softmax window 64 + sparse 64 (prefix_kv_diff)"),
    ("relu(x)^2/m", "relu(x)^2/m", "relu(x)^2/n"),
    ("softmax(sink=lots)", "softmax(sink=lots)", "softmax(sink=0)"),
    ("ssmax(scael=learned)", "ssmax(scael=learned)", "ssmax(scale=learned)"),
    ("x^0/16", "x^0/16", "x^3/16"),
    ("stick_breaking", "stick_breaking", "stick-breaking"),
    ("x/1 + softmax window 64 + sparse 64 (kv_dif)", "kv_dif", "x/1 + softmax window 64 + sparse 64 (prefix_kv_diff)"),
    ("x/1 + softmax window 4 + sparse 3 (kv_diff)", "kv_diff", "x/1 + softmax window 4 + sparse 3 (prefix_kv_diff)"),
    ("x/1 + softmax window 64 + sparse 64 key_norm", "key_norm", "x/1 + softmax window 64 + sparse 64 (key_norm)"),
    ("", "", None),
    ("+ softmax window 64", "", None),
    ("x^3/16 +", "+", "x^3/16"),
    ("x^3/16 + sinks 4", "+ sinks 4", "x^3/16 + softmax window 64 + sinks 4"),
    ("x^3/sqrtN + sinks 4", "+ sinks 4", "x^3/sqrtN + softmax window 64 + sinks 4"),  # was x^3/sqrtN, sinks dropped
    ("x^3/16 + sinks 4 + softmax window 64", "+ sinks 4", "x^3/16 + softmax window 64 + sinks 4"),
    ("x^3/16 + softmax window 4 + sinks -1", "+ sinks -1", "x^3/16 + softmax window 4 + sinks 1"),
    ("x/1 + softmax window 4 + softmax window 8", "+ softmax window 8", "x/1 + softmax window 4"),
    ("x/1 + clusters 8", "+ clusters 8", "x/1 + softmax window 64 + sparse 64 (prefix_kv_diff) + clusters 8"),
    ("sigmod + window 64", "sigmod", "sigmoid(bias=-log n) + softmax window 64"),
    ("x^3/16 + Window 64", "+ Window 64", "x^3/16 + softmax window 64"),  # the part as typed
]


@pytest.mark.parametrize("spelling, part, suggestion", WRONG, ids=[case[0] or "empty" for case in WRONG])
def test_a_wrong_spelling_names_its_part_and_the_nearest_valid_spelling(spelling, part, suggestion):
    with pytest.raises(SpellingError) as caught:
        parse_normalization(spelling)
    error = caught.value
    assert isinstance(error, ValueError)  # what callers catch
    assert (error.part, error.suggestion) == (part, suggestion)
    message = str(error)
    assert message.startswith(("Normalization ", "Unknown normalization ")) and repr(spelling) in message
    assert not part or repr(part) in message.splitlines()[0]
    if suggestion is not None:
        assert f"Did you mean {suggestion!r}?" in message
        assert parse_normalization(suggestion).name == suggestion  # the suggestion parses, canonical
    else:
        assert "Did you mean" not in message
    assert message.endswith("\n" + normalization_grammar())


@pytest.mark.parametrize("spelling", ["x^3/16 + window 64", "x^3/16 + 4", "x/1 + softmax window 4 + cluster"])
def test_an_unknown_part_is_named_with_the_parts_accepted(spelling):
    with pytest.raises(SpellingError) as caught:
        parse_normalization(spelling)
    first_line = str(caught.value).splitlines()[0]
    assert caught.value.part == "+ " + spelling.rsplit("+ ", 1)[1]
    positions = [first_line.index(f"'+ {part.form}'") for part in PARTS]
    assert positions == sorted(positions)  # every part, in its order


def test_an_unknown_score_lists_the_scores_the_sparse_cache_takes():
    with pytest.raises(SpellingError) as caught:
        parse_normalization("x/1 + softmax window 64 + sparse 64 (kv_dif)")
    first_line = str(caught.value).splitlines()[0]
    assert all(score in first_line for score in SPARSE_SCORES)


def test_a_bad_value_keeps_the_family_s_reason():
    with pytest.raises(SpellingError) as caught:
        parse_normalization("x^0/16 + softmax window 4")
    assert caught.value.part == "x^0/16" and "got 0" in str(caught.value)
    assert caught.value.suggestion == "x^3/16 + softmax window 4"


def test_parts_that_parse_but_do_not_go_together_stay_a_plain_value_error():
    for spelling in ("softmax + softmax window 4", "x^3/16 + softmax window 0 + sinks 2"):
        with pytest.raises(ValueError) as caught:
            parse_normalization(spelling)
        assert not isinstance(caught.value, SpellingError), spelling


def test_the_error_survives_pickling():
    """A job's worker process hands its error to the parent pickled."""
    with pytest.raises(SpellingError) as caught:
        parse_normalization("sigmod")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (str(copy), copy.part, copy.suggestion) == (str(caught.value), "sigmod", "sigmoid(bias=-log n)")


def test_the_grammar_lists_every_family_every_part_in_order_and_every_score():
    grammar = normalization_grammar()
    assert parts_usage() == "BASE [+ softmax window W [+ sinks S] [+ sparse K (SCORE) [+ clusters C]]]"
    assert parts_usage() in grammar
    for key, family in FAMILIES.items():
        line = next(line for line in grammar.splitlines() if line.split()[:1] == [key])
        assert all(example in line for example in family.examples), key
    positions = [grammar.index(f"\n  + {part.form} ") for part in PARTS]  # a line each, in their order
    assert positions == sorted(positions)
    assert all(score in grammar for score in SPARSE_SCORES)
    examples = grammar.split("\ne.g. ", 1)[1].split("'")[1::2]
    assert len(examples) == 2 and all(parse_normalization(example).name == example for example in examples)


def test_the_cli_help_shows_the_grammar():
    from hf_knorm.cli import _build_parser

    assert normalization_grammar() in _build_parser().format_help()


@pytest.mark.parametrize("spelling", ALL_EXAMPLES)
def test_every_example_spelling_still_parses_to_its_name(spelling):
    assert parse_normalization(parse_normalization(spelling).name) == parse_normalization(spelling)


@pytest.mark.parametrize("spelling, expected", [
    ("x^3/16+softmax window 4+sinks 2", Windowed(Polynomial(power=3, constant=16.0), 4, 2)),
    ("x^+3/1e+3 + softmax window 8", Windowed(Polynomial(power=3, constant=1000.0), 8)),  # a sign, not a part
    ("sigmoid(bias=+1) + Softmax Window 8 + Sinks 1", Windowed(Sigmoid(bias=1.0), 8, 1)),
    ("x³/16 + softmax window64", Windowed(Polynomial(power=3, constant=16.0), 64)),
    ("x/1 + softmax window 64 + sparse 2(value_over_key) + clusters 8",
     Windowed(Polynomial(power=1, constant=1.0), 64, sparse=2, score="value_over_key", clusters=8)),
    ("x/1 + softmax window 4 + sparse 3 ( key_norm )", Windowed(Polynomial(power=1, constant=1.0), 4, sparse=3,
                                                                                score="key_norm")),
    ("x^3/16 + softmax window 0", Polynomial(power=3, constant=16.0)),
    ("x/1 + softmax window 4 + sparse 0", Windowed(Polynomial(power=1, constant=1.0), 4)),
])
def test_the_forms_the_old_parser_took_parse_to_the_same_objects(spelling, expected):
    assert parse_normalization(spelling) == expected
