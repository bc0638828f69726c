"""The registry (:mod:`hf_knorm.normalizations.registry`): every registered family's spellings and saved records come
back as equal objects, the listing names every family, errors name the families or the bad value, and ``patch``
takes a spelling or an object alike. The cases come from the registry itself (``family_cases.py``)."""

import json
import math
import re

import pytest
from family_cases import ALL_EXAMPLES, SPELLINGS
from tiny_models import tiny_model

import hf_knorm
from hf_knorm.normalizations import (FAMILIES, Learnable, Normalization, Sigmoid, SinkSoftmax, SSMax, Windowed,
                                     from_record, list_normalizations, parse_normalization)

EXTRA_SPELLINGS = ("sigmoid(bias=learned(-2))", "softmax(sink=learned(-2))", "ssmax(scale=learned(0.3))",
                   "softpick(eps=0.001)", "relu(x)^2/sqrtN", "relu(x)^3/2.5", "x^2/0.5", "x/sqrtN",
                   "sigmoid(bias=learned) + softmax window 8", "ssmax(scale=0.5) + softmax window 3 + sinks 2")


def _family_of(normalization: Normalization) -> type[Normalization]:
    return type(normalization.without_window)


@pytest.mark.parametrize("spelling", ALL_EXAMPLES + EXTRA_SPELLINGS)
def test_a_spelling_parses_to_its_family_and_back(spelling):
    normalization = parse_normalization(spelling)
    assert isinstance(normalization, Normalization)
    assert _family_of(normalization) in FAMILIES.values()
    assert isinstance(normalization, Windowed) == (" window " in spelling)
    assert parse_normalization(normalization.name) == normalization
    assert parse_normalization(normalization) is normalization
    assert str(normalization) == normalization.name
    assert parse_normalization(f"  {spelling} ") == normalization  # surrounding spaces are not part of it
    hash(normalization)  # frozen: usable as a key


@pytest.mark.parametrize("spelling", ALL_EXAMPLES + EXTRA_SPELLINGS)
def test_a_saved_record_comes_back_equal(spelling):
    normalization = parse_normalization(spelling)
    record = normalization.to_record()
    assert record["family"] == normalization.family
    assert from_record(record) == normalization
    assert from_record(json.loads(json.dumps(record))) == normalization  # JSON types only (config.json)


@pytest.mark.parametrize("key", FAMILIES)
def test_every_family_has_examples_of_itself_and_says_what_it_is(key):
    family = FAMILIES[key]
    assert family.family == key
    assert family.examples and family.source and family.formula
    for example in family.examples:
        assert type(parse_normalization(example)) is family, example
    assert family.row_normalizer in ("none", "max+sum", "sum", "row")


def test_the_listing_names_every_registered_family_with_a_parsing_example():
    listed = list_normalizations()
    assert list(listed) == list(FAMILIES)
    for key, entry in listed.items():
        normalization = parse_normalization(entry["example"])
        assert type(normalization) is FAMILIES[key]
        assert entry["example"] == FAMILIES[key].examples[0]
        assert entry["source"] == FAMILIES[key].source
        assert entry["fast_paths"] == ", ".join(normalization.fast_paths)
        assert "chunked" in normalization.fast_paths  # the chunked kernel computes every family
    assert hf_knorm.list_normalizations is list_normalizations and hf_knorm.normalizations.FAMILIES is FAMILIES


def test_learnable_values_are_named_and_start_at_their_init():
    assert parse_normalization("sigmoid(bias=learned)") == Sigmoid(bias=Learnable(-math.log(1024)))
    assert parse_normalization("sigmoid(bias=learned(-2))").learnable() == {"bias": -2.0}
    assert parse_normalization("softmax(sink=learned)") == SinkSoftmax(sink=Learnable(0.0))
    assert parse_normalization("ssmax(scale=learned(0.3))") == SSMax(scale=Learnable(0.3))
    assert parse_normalization("sigmoid(bias=-log n)") == Sigmoid()
    assert parse_normalization("sigmoid(bias=-log n)").learnable() == {}
    windowed = parse_normalization("sigmoid(bias=learned(-2)) + softmax window 4")
    assert windowed.learnable() == {"bias": -2.0, "window_mix": 1.0}
    for spelling in SPELLINGS:  # the learnable variants are spelled "learned", every other value is fixed
        normalization = parse_normalization(spelling)
        assert bool(normalization.without_window.learnable()) == ("learned" in spelling), spelling


@pytest.mark.parametrize("spelling", ["relu", "softmax2", "x^1.5/2", "", "tanh(x)", "sigmoid bias", "sinks 4",
                                      "stick-breaking(eps=1", "softmax(sink=1"])
def test_an_unknown_spelling_lists_every_family(spelling):
    with pytest.raises(ValueError, match="Unknown normalization") as error:
        parse_normalization(spelling)
    for key, family in FAMILIES.items():
        assert key in str(error.value) and family.examples[0] in str(error.value)


@pytest.mark.parametrize("spelling, message", [
    ("sigmoid(bias=abc)", "sigmoid: bias must be a finite number or learned, got 'abc'"),
    ("sigmoid(bias=learned(x))", "sigmoid: bias must be a finite number"),
    ("sigmoid(temperature=2)", "sigmoid takes bias; unknown: temperature"),
    ("sigmoid(bias)", "arguments are key=value"),
    ("softmax(sink=nan)", "sink must be a finite number"),
    ("softmax(sink=1,scale=2)", "softmax takes sink; unknown: scale"),
    ("ssmax(scale=inf)", "ssmax: scale must be a finite number"),
    ("softpick(eps=0)", "softpick: eps must be > 0"),
    ("softpick(eps=-1)", "softpick: eps must be > 0"),
    ("stick-breaking(eps=1)", "stick-breaking takes no arguments; unknown: eps"),
    ("relu(x)^0/n", "the power p must be an integer >= 1"),
    ("relu(x)^2/0", "the divisor is a finite number > 0, n or sqrtN"),
    ("relu(x)^2/m", "the divisor is a finite number > 0, n or sqrtN"),
    ("x^3/0", "constant c must be a finite number > 0"),
    ("x^0/1", "the power p must be an integer >= 1"),
    ("x^3/16 + softmax window four", "the softmax window is a number of keys"),
    ("x^3/16 + softmax window 4 + sinks -1", "the sinks are a number of keys"),
    ("softmax + softmax window 4", "every key is already weighted by softmax"),
    ("softmax(sink=0) + softmax window 4", "no effect and no gradient"),
    ("x^3/16 + softmax window 0 + sinks 2", "without a softmax window"),
])
def test_a_bad_value_names_the_family_and_what_it_takes(spelling, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_normalization(spelling)


def test_not_a_spelling_lists_the_families():
    with pytest.raises(ValueError, match="is a string or a hf_knorm normalization object") as error:
        parse_normalization(3)
    assert all(key in str(error.value) for key in FAMILIES)


def test_an_unknown_or_bad_record_is_refused_naming_the_families():
    with pytest.raises(ValueError, match="not one this hf_knorm knows") as error:
        from_record({"family": "cosine", "power": 2})
    assert all(key in str(error.value) for key in FAMILIES)
    with pytest.raises(ValueError, match="does not fit this hf_knorm"):
        from_record({"family": "sigmoid", "bias": -1.0, "temperature": 2.0})
    with pytest.raises(ValueError, match="not one this hf_knorm knows"):
        from_record({"family": "windowed", "base": {"family": "cosine"}, "window": 4, "sinks": 0})


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_patch_takes_the_object_or_its_spelling_alike(spelling):
    normalization = parse_normalization(spelling)
    by_object = hf_knorm.patch(tiny_model("llama"), normalization)
    by_spelling = hf_knorm.patch(tiny_model("llama"), spelling)
    assert by_object.config.to_dict() == by_spelling.config.to_dict()
    section = by_object.config.hf_knorm
    assert section["normalization"] == normalization.name
    assert section["normalization_record"] == normalization.to_record()
    assert from_record(section["normalization_record"]) == normalization
    assert hf_knorm.patched_normalization(by_object) == normalization.name
    learned = {name for name, _ in by_object.named_parameters() if "hf_knorm_" in name}
    assert learned == {name for name, _ in by_spelling.named_parameters() if "hf_knorm_" in name}
    expected = {f"model.layers.{layer}.self_attn.hf_knorm_{name}"
                for layer in range(2) for name in normalization.learnable()}
    assert learned == expected
    for name, parameter in by_object.named_parameters():
        if "hf_knorm_" in name:  # one value per query head, at the family's initial value
            init = normalization.learnable()[name.rsplit("hf_knorm_", 1)[1]]
            assert parameter.shape == (4,) and parameter.tolist() == pytest.approx([init] * 4)
    hf_knorm.unpatch(by_object)
    assert not [name for name, _ in by_object.named_parameters() if "hf_knorm_" in name]


def test_the_representative_spellings_cover_every_family_and_every_learnable_example():
    from hf_knorm.normalizations import representative_spellings

    spellings = representative_spellings()
    assert len(spellings) == len(set(spellings))
    assert {type(parse_normalization(spelling)) for spelling in spellings} == set(FAMILIES.values())
    learned = {example for family in FAMILIES.values() for example in family.examples if "learned" in example}
    assert learned <= set(spellings)
