"""Every registered family through the chunked kernel against the plain reference, and each family's weights against
a definition written here element by element.

- The kernel (:func:`hf_knorm.attention.kernel.chunked_attention`, a few query rows per chunk) against
  :func:`hf_knorm.attention.reference.reference_attention` (the whole score matrix at once): outputs, and the
  gradients of the query, key, value and every learnable value (random values, not their inits) under a random
  upstream gradient; GQA (4 query heads over 2 KV heads) throughout; causal (implicit), padded (an explicit bool mask
  with padded keys and fully masked rows), a sliding window, decoding rows (3 queries at the end of 9 keys), softcap,
  an additive bias. Also: the inference path (no autograd), the returned weights (on the padded mask), and the
  custom ops compiled models run (``hf_knorm::attention`` and its backward).
- A softmax window beside a family (:func:`hf_knorm.attention.window.window_attention`) against
  :func:`~hf_knorm.attention.reference.reference_window_attention`, the window mix and the base family's values
  included.
- The reference itself computes most families with their own ``weights``; so each family's ``weights`` is checked
  against a plain element-by-element definition here (:data:`DEFINITIONS`, one per family: a new family fails until
  it has one).

Tolerance: fp64, 1e-10 absolute (values of size ~1-10; the paths sum the same terms in another order).
"""

from __future__ import annotations

import math

import pytest
import torch
from family_cases import ALL_EXAMPLES, LEARNABLE, NOT_WINDOWED, SPELLINGS, random_values

from hf_knorm.attention import kernel
from hf_knorm.attention.compiled import attention_backward_op, attention_op
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.masks import KeyPadding
from hf_knorm.attention.reference import reference_attention, reference_window_attention
from hf_knorm.attention.window import window_attention
from hf_knorm.normalizations import FAMILIES, parse_normalization
from hf_knorm.normalizations.windowed import MIX

ATOL = 1e-10
BATCH, Q_HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 9, 8
CHUNK_ELEMENTS = 150  # 2 * 4 * 9 = 72 scores per query row: 2 rows per chunk, 5 chunks
CASES = ("causal", "padded", "sliding", "decode", "softcap", "bias")
WINDOWED = tuple(spelling for spelling in SPELLINGS if spelling not in NOT_WINDOWED)


def _tensors(q_len=LENGTH, kv_len=LENGTH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    return (make(BATCH, Q_HEADS, q_len, DIM).requires_grad_(), make(BATCH, KV_HEADS, kv_len, DIM).requires_grad_(),
            make(BATCH, KV_HEADS, kv_len, DIM).requires_grad_())


def _causal(q_len, kv_len):
    """Bottom-right causal ``(1, 1, q, kv)``: query ``i`` at position ``kv - q + i``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]


def _case(name, sliding=3):
    """``(q_len, allowed or None, options)`` of a mask case: options for both the kernel and the reference;
    ``sliding``: the width of the sliding window case."""
    causal = _causal(LENGTH, LENGTH)
    if name == "causal":  # no mask: the kernel's implicit top-left causal mask
        return LENGTH, None, dict(causal=True)
    if name == "padded":
        valid = torch.ones(BATCH, LENGTH, dtype=torch.bool)
        valid[1, :3] = False  # left padding: batch 1's first three queries attend nothing
        valid[0, 5] = False  # a hole
        allowed = causal & valid[:, None, None, :]
        allowed = allowed.clone()
        allowed[0, :, 6] = False  # a fully masked row in the middle of batch 0
        return LENGTH, allowed, {}
    if name == "sliding":  # rows leave their first keys behind
        return LENGTH, causal & ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(-sliding), {}
    if name == "decode":
        return 3, _causal(3, LENGTH), {}
    if name == "softcap":
        return LENGTH, causal, dict(softcap=2.0, scaling=1.0)  # scores of size ~3: the cap bends them
    if name == "bias":
        bias = torch.randn(BATCH, 1, LENGTH, LENGTH, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        return LENGTH, causal, dict(bias=bias)
    raise ValueError(name)


def _params(normalization, seed=1):
    return {name: value.requires_grad_() for name, value in random_values(normalization, Q_HEADS, seed).items()}


def _compare(got, want, inputs, names):
    """Outputs within ATOL, and the gradients of ``inputs`` under one random upstream gradient."""
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=want.dtype)
    expected = torch.autograd.grad(want, inputs, upstream, allow_unused=True, materialize_grads=True, retain_graph=True)
    actual = torch.autograd.grad(got, inputs, upstream, allow_unused=True, materialize_grads=True, retain_graph=True)
    for name, a, b in zip(names, actual, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda message, name=name: f"d{name}: {message}")
    return actual


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spelling", NOT_WINDOWED)
def test_the_chunked_kernel_equals_the_reference_with_gradients(spelling, case):
    normalization = parse_normalization(spelling)
    q_len, allowed, options = _case(case)
    query, key, value = _tensors(q_len=q_len)
    params = _params(normalization)
    inputs, names = (query, key, value, *params.values()), ("query", "key", "value", *params)
    want, want_weights = reference_attention(query, key, value, allowed, normalization, params=params, **options)
    assert torch.isfinite(want).all()
    got, _ = chunked_attention(query, key, value, allowed, normalization, params=params,
                               chunk_elements=CHUNK_ELEMENTS, **options)
    grads = _compare(got, want, inputs, names)
    for name, grad in zip(names[3:], grads[3:]):  # the learnable values are really used
        assert grad.abs().min() > 0, f"{name} gets no gradient: {grad}"
    if case == "padded":  # fully masked rows: exactly 0
        assert not got[1, :3].any() and not got[0, 6].any()

    with torch.no_grad():  # inference: in-place normalization, no autograd
        inference, _ = chunked_attention(query, key, value, allowed, normalization, params=params,
                                         chunk_elements=CHUNK_ELEMENTS, **options)
    torch.testing.assert_close(inference, want, rtol=0, atol=ATOL)

    if case != "padded":
        return
    # the returned weights (autograd through the chunks), on the padded mask
    got, weights = chunked_attention(query, key, value, allowed, normalization, params=params, return_weights=True,
                                     chunk_elements=CHUNK_ELEMENTS, **options)
    kv_len = weights.shape[-1]
    torch.testing.assert_close(weights, want_weights[..., :kv_len], rtol=0, atol=ATOL)
    _compare(got, want, inputs, names)


@pytest.mark.parametrize("case", ["causal", "padded", "bias"])
@pytest.mark.parametrize("spelling", NOT_WINDOWED)
def test_the_custom_ops_give_the_autograd_gradients(spelling, case):
    """The custom ops a compiled model runs (``hf_knorm::attention`` and ``hf_knorm::attention_backward``, called
    through the dispatcher, which runs their bodies below autograd, as a compiled graph does) against
    ``chunked_attention`` under autograd: output, and the gradients of the query, key, value and then each learnable
    value in its order."""
    normalization = parse_normalization(spelling)
    q_len, allowed, options = _case(case)
    query, key, value = _tensors(q_len=q_len, seed=2)
    params = _params(normalization, seed=4)
    reference, _ = chunked_attention(query, key, value, allowed, normalization, params=params, **options)
    upstream = torch.randn(reference.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    expected = torch.autograd.grad(reference, (query, key, value, *params.values()), upstream)
    tensors = [tensor.detach() for tensor in (query, key, value)]
    values = [value.detach() for value in params.values()]
    settings = (normalization.name, options.get("scaling", DIM**-0.5), options.get("softcap"),
                options.get("causal", False))
    output = attention_op(*tensors, allowed, options.get("bias"), values, *settings, False)
    grads = attention_backward_op(upstream, output, *tensors, allowed, options.get("bias"), values, *settings)
    torch.testing.assert_close(output, reference, rtol=0, atol=ATOL)
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spelling", LEARNABLE[:1])  # ~1 s each: the ops of every family are run above
def test_the_custom_op_with_learnable_values_passes_opcheck(spelling):
    """torch.library.opcheck with the learnable values as the op's tensor list: schema, fake shapes, autograd."""
    normalization = parse_normalization(spelling)
    query, key, value = _tensors(q_len=6, kv_len=6, seed=13)
    values = list(_params(normalization, seed=14).values())
    allowed = _causal(6, 6).expand(BATCH, 1, 6, 6).clone()
    allowed[0, :, :, :2] = False
    torch.library.opcheck(attention_op, (query, key, value, allowed, None, values, normalization.name, 0.35, None,
                                         True, False))


def test_a_missing_learnable_value_is_refused():
    normalization = parse_normalization("sigmoid(bias=learned)")
    query, key, value = _tensors()
    with pytest.raises(ValueError, match=r"learns 'bias', one value per query head \(4,\); got nothing"):
        chunked_attention(query, key, value, None, normalization, causal=True)
    with pytest.raises(ValueError, match=r"got shape \(2,\)"):
        chunked_attention(query, key, value, None, normalization, causal=True, params={"bias": torch.zeros(2)})


# --- a softmax window beside a family ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["causal", "padded", "sliding", "decode", "softcap", "bias"])
@pytest.mark.parametrize("spelling", WINDOWED)
def test_a_window_beside_a_family_equals_its_reference(spelling, case, monkeypatch):
    monkeypatch.setattr(kernel, "DEFAULT_CHUNK_ELEMENTS", CHUNK_ELEMENTS)  # several chunks in every part
    normalization = parse_normalization(spelling)
    q_len, allowed, options = _case(case, sliding=6)  # wider than the softmax window: older keys in it too
    options.pop("causal", None)
    query, key, value = _tensors(q_len=q_len, seed=7)
    params = _params(normalization, seed=8)
    mix = params[MIX]
    inputs, names = (query, key, value, *params.values()), ("query", "key", "value", *params)
    if case == "sliding" and normalization.sinks:  # the sinks are the sequence's first tokens: a sliding window
        with pytest.raises(ValueError, match="sliding window"):  # leaves them behind
            reference_window_attention(query, key, value, allowed, normalization, mix=mix, params=params, **options)
        with pytest.raises(ValueError, match="own sliding window of 6 positions"):
            window_attention(query, key, value, allowed, normalization, mix=mix, params=params, sliding_window=6,
                             **options)
        return
    want, _ = reference_window_attention(query, key, value, allowed, normalization, mix=mix, params=params, **options)
    got, _ = window_attention(query, key, value, allowed, normalization, mix=mix, params=params, **options)
    grads = _compare(got, want, inputs, names)
    for name, grad in zip(names[3:], grads[3:]):
        assert grad.abs().min() > 0, f"{name} gets no gradient: {grad}"


@pytest.mark.parametrize("spelling", WINDOWED)
def test_a_window_beside_a_family_on_key_padding_equals_its_reference(spelling, monkeypatch):
    """The fast path (the softmax band, the family on the keys older than the window): left padding and a hole,
    compared on the rows whose own key is real (a padded query has no position)."""
    monkeypatch.setattr(kernel, "DEFAULT_CHUNK_ELEMENTS", CHUNK_ELEMENTS)
    normalization = parse_normalization(spelling)
    query, key, value = _tensors(seed=9)
    params = _params(normalization, seed=10)
    valid = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    valid[1, :3] = False
    valid[0, 2] = False
    padding = KeyPadding(valid, LENGTH, causal=True)
    want, _ = reference_window_attention(query, key, value, padding.dense(), normalization, mix=params[MIX],
                                         params=params)
    got, _ = window_attention(query, key, value, padding, normalization, mix=params[MIX], params=params)
    rows = valid[:, :, None, None]
    _compare(got * rows, want * rows, (query, key, value, *params.values()), ("query", "key", "value", *params))


# --- each family's weights against a plain definition -------------------------------------------------------------

def _sigma(x):
    return 1 / (1 + math.exp(-x))


def _softmax(scores, keys):
    top = max(scores[j] for j in keys)
    total = sum(math.exp(scores[j] - top) for j in keys)
    return {j: math.exp(scores[j] - top) / total for j in keys}


def _divisor(rule, n):
    return {"n": n, "sqrtN": math.sqrt(n)}.get(rule, rule)


def _polynomial(f, scores, keys, value):
    return {j: scores[j] ** f.power / (math.sqrt(len(keys)) if f.sqrt_n else f.constant) for j in keys}


def _rectified(f, scores, keys, value):
    return {j: max(scores[j], 0.0) ** f.power / _divisor(f.divisor, len(keys)) for j in keys}


def _sigmoid(f, scores, keys, value):
    bias = value["bias"] if "bias" in value else -math.log(len(keys)) if f.bias == "-log n" else f.bias
    return {j: _sigma(scores[j] + bias) for j in keys}


def _sink_softmax(f, scores, keys, value):
    sink = value.get("sink", f.sink)
    total = math.exp(sink) + sum(math.exp(scores[j]) for j in keys)
    return {j: math.exp(scores[j]) / total for j in keys}


def _softpick(f, scores, keys, value):  # the paper's kernel: shifted by m = max(0, max s), eps added after the shift
    m = max(0.0, *(scores[j] for j in keys))
    moved = {j: math.exp(scores[j] - m) - math.exp(-m) for j in keys}
    total = sum(abs(x) for x in moved.values()) + f.eps
    return {j: max(x, 0.0) / total for j, x in moved.items()}


def _ssmax(f, scores, keys, value):
    factor = value.get("scale", f.scale) * math.log(len(keys))
    return _softmax([s * factor for s in scores], keys)


def _stick_breaking(f, scores, keys, value):
    return {j: _sigma(scores[j]) * math.prod(1 - _sigma(scores[k]) for k in keys if k > j) for j in keys}


DEFINITIONS = {
    "softmax": lambda f, scores, keys, value: _softmax(scores, keys),
    "polynomial": _polynomial,
    "rectified": _rectified,
    "sigmoid": _sigmoid,
    "sink-softmax": _sink_softmax,
    "softpick": _softpick,
    "ssmax": _ssmax,
    "stick-breaking": _stick_breaking,
}
"""Each family's weights of one row, ``(normalization, scores, allowed key indices, {name: this head's value}) ->
{key index: weight}``, written from its paper's formula (the family's module docstring)."""


def test_every_registered_family_has_a_definition_here():
    assert set(DEFINITIONS) == set(FAMILIES), "a family without a plain definition in DEFINITIONS (test_kernel.py)"


@pytest.mark.parametrize("spelling", [s for s in ALL_EXAMPLES if not parse_normalization(s).window]
                         + ["relu(x)^2/sqrtN", "softpick(eps=0.01)", "softmax(sink=-1.5)", "x^2/sqrtN"])
def test_a_familys_weights_follow_its_definition(spelling):
    """Scores ``(B=2, H=3, q=4, kv=6)`` of size ~2, a mask with a fully masked row, a hole and a padded key: every
    weight against the definition; masked pairs exactly 0."""
    normalization = parse_normalization(spelling)
    generator = torch.Generator().manual_seed(11)
    scores = 2 * torch.randn(2, 3, 4, 6, generator=generator, dtype=torch.float64)
    allowed = torch.ones(2, 1, 4, 6, dtype=torch.bool).tril(2)
    allowed[0, :, 1] = False  # a row with no key
    allowed[1, :, :, 0] = False  # a padded key
    allowed[1, :, 3, 2] = False  # a hole
    values = random_values(normalization, 3, seed=12)
    got = normalization.weights(scores.clone(), allowed, {name: v[:, None, None] for name, v in values.items()})
    assert got.shape == scores.shape
    want = torch.zeros_like(scores)
    for b, h, i in [(b, h, i) for b in range(2) for h in range(3) for i in range(4)]:
        keys = [j for j in range(6) if allowed[b, 0, i, j]]
        if not keys:  # a row with no key: zero weights (want stays 0)
            continue
        value = {name: v[h].item() for name, v in values.items()}
        for j, weight in DEFINITIONS[normalization.family](normalization, scores[b, h, i].tolist(), keys,
                                                           value).items():
            want[b, h, i, j] = weight
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not got.masked_select(~allowed.expand_as(got)).any()
    if normalization.row_normalizer == "max+sum" and normalization.family == "softmax":
        torch.testing.assert_close(got.sum(-1)[allowed.any(-1).expand(2, 3, 4)],
                                   torch.ones(2 * 3 * 4 - 3, dtype=torch.float64))


def test_a_windowed_normalization_has_no_weights_of_its_own():
    with pytest.raises(ValueError, match="window_attention"):
        parse_normalization("relu(x)^3/16 + softmax window 4").weights(torch.zeros(1, 2), None)
