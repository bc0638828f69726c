"""Training ``x^p/c`` as its twin ``x^p/1`` and folding the constant into the queries computes the same function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import DECODER_TYPES, tiny_inputs, tiny_model  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.conversion.twin import fold_constant, training_normalization  # noqa: E402

FOLDABLE = {"llama", "mistral", "qwen2"}
"""Tiny decoders whose queries are a plain projection; the rest fuse QKV, normalize q or softcap the scores."""


@pytest.mark.parametrize("model_type", DECODER_TYPES)
@pytest.mark.parametrize("normalization", ["x^3/16", "x/16", "x^2/0.5"])
def test_the_folded_twin_computes_the_twins_logits_under_the_constant(model_type, normalization):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model_type, length=12)
    twin_name = normalization.split("/")[0] + "/1"
    trained = training_normalization(model, normalization)
    if model_type not in FOLDABLE:
        assert trained.name == normalization  # nothing to fold into: trained as it is
        hf_knorm.patch(model, twin_name)
        with pytest.raises(ValueError, match="cannot be folded"):
            fold_constant(model, normalization)
        return
    assert trained.name == twin_name
    hf_knorm.patch(model, trained)
    with torch.no_grad():
        twin = model(**inputs).logits
        unpatched_weights = {name: value.clone() for name, value in model.named_parameters()}
        fold_constant(model, normalization)
        folded = model(**inputs).logits
        hf_knorm.unpatch(model)
        for name, value in unpatched_weights.items():  # the constant goes into the queries, nowhere else
            if ".q_proj." not in name:
                torch.testing.assert_close(dict(model.named_parameters())[name], value, rtol=0, atol=0)
        hf_knorm.patch(model, trained)
        differs = model(**inputs).logits  # the scaled queries under x^p/1: the fold is not a no-op
    hf_knorm.unpatch(model)
    hf_knorm.patch(model, normalization)
    assert hf_knorm.patched_normalization(model) == normalization
    torch.testing.assert_close(folded, twin, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(differs, twin, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("normalization", "trained"), [
    ("x^3/16", "x^3/1"), ("x/16", "x/1"), ("x^2/0.5", "x^2/1"),
    ("x/1", "x/1"), ("x^3/1", "x^3/1"), ("x^3/sqrtN", "x^3/sqrtN"), ("softmax", "softmax"),
])
def test_only_a_constant_other_than_one_has_a_twin(normalization, trained):
    assert training_normalization(tiny_model("llama"), normalization).name == trained


def test_folding_needs_a_model_patched_with_the_twin():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs a model patched with x\\^3/1, not None"):
        fold_constant(model, "x^3/16")
    hf_knorm.patch(model, "x^3/16")
    with pytest.raises(ValueError, match="needs a model patched with x\\^3/1, not x\\^3/16"):
        fold_constant(model, "x^3/16")
    with pytest.raises(ValueError, match="x\\^3/sqrtN: only the constant c of x\\^p/c folds"):  # no constant to fold
        fold_constant(model, "x^3/sqrtN")


def test_a_softmax_window_is_trained_as_it_is():
    """Folding c^(1/p) into the queries would scale the window's softmax scores too: no twin with a window."""
    model = tiny_model("llama")
    windowed = "x^3/16 + softmax window 4"
    assert training_normalization(model, windowed).name == windowed
    hf_knorm.patch(model, "x^3/1", softmax_window=4)
    with pytest.raises(ValueError, match="softmax window"):
        fold_constant(model, windowed)
