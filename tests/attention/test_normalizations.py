"""Spellings, errors and the elementwise definition of each normalization."""

import math

import pytest
import torch

from hf_knorm.normalizations import PAPER_NORMALIZATIONS, Polynomial, Softmax, parse_normalization


@pytest.mark.parametrize(
    "spelling, power, constant, sqrt_n, canonical",
    [
        ("softmax", None, None, False, "softmax"),
        ("x/1", 1, 1.0, False, "x/1"),
        ("x/16", 1, 16.0, False, "x/16"),
        ("x^3/1", 3, 1.0, False, "x^3/1"),
        ("x^3/16", 3, 16.0, False, "x^3/16"),
        ("x³/16", 3, 16.0, False, "x^3/16"),
        ("x^3/sqrtN", 3, None, True, "x^3/sqrtN"),
        ("x^3/sqrt(N)", 3, None, True, "x^3/sqrtN"),
        ("x^2/0.5", 2, 0.5, False, "x^2/0.5"),
        (" x^5 / 14 ", 5, 14.0, False, "x^5/14"),
    ],
)
def test_spellings(spelling, power, constant, sqrt_n, canonical):
    parsed = parse_normalization(spelling)
    assert tuple(getattr(parsed, name, None) for name in ("power", "constant")) == (power, constant)
    assert getattr(parsed, "sqrt_n", False) == sqrt_n
    assert parsed.name == canonical
    assert parse_normalization(parsed.name) == parsed


@pytest.mark.parametrize(
    "spelling, message",
    [
        ("relu", "Unknown normalization"),
        ("x^0/1", "power p must be an integer >= 1"),
        ("x^-1/1", "power p must be an integer >= 1"),
        ("x^1.5/2", "Unknown normalization"),
        ("x/0", "constant c must be a finite number > 0"),
        ("x^3/-16", "constant c must be a finite number > 0"),
        ("x^3/inf", "constant c must be a finite number > 0"),
        ("x^3/abc", "positive number or sqrtN"),
        ("", "Unknown normalization"),
    ],
)
def test_bad_spellings_raise_with_the_accepted_forms(spelling, message):
    with pytest.raises(ValueError, match=message):
        parse_normalization(spelling)


def test_non_string_is_rejected():
    with pytest.raises(ValueError, match="is a string"):
        parse_normalization(3)


def test_paper_legend_parses():
    assert [parse_normalization(s).name for s in PAPER_NORMALIZATIONS] == list(PAPER_NORMALIZATIONS)


def test_polynomial_weights_keep_sign_zero_masked_and_use_row_counts():
    scores = torch.tensor([[2.0, -3.0, 100.0]])
    allowed = torch.tensor([[True, True, False]])
    weights = Polynomial(power=3, sqrt_n=True).weights(scores, allowed)
    expected = torch.tensor([[8.0, -27.0, 0.0]]) / math.sqrt(2)
    torch.testing.assert_close(weights, expected)
    assert Polynomial(power=2, constant=4.0).weights(scores, allowed).tolist() == [[1.0, 2.25, 0.0]]


def test_softmax_row_without_keys_is_zero_not_nan():
    scores = torch.randn(2, 3)
    allowed = torch.tensor([[True, True, False], [False, False, False]])
    weights = Softmax().weights(scores, allowed)
    assert torch.isfinite(weights).all()
    assert weights[1].abs().sum() == 0
    torch.testing.assert_close(weights[0].sum(), torch.tensor(1.0))
