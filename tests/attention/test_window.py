"""A softmax window beside the polynomial attention (``hf_knorm/attention/window.py``): the spelling, the plain
reference, and the fast paths against the reference.

Tolerances: fp64 throughout, outputs and gradients within 1e-10 absolute (values of size ~1-10; the paths sum the same
terms in another order). Rows compared: every query whose own key is real (a padded query has no position, see the
module docstring); left padding, where a padded query attends nothing, is compared on every row.
"""


import pytest
import torch

from hf_knorm.attention import paths, window
from hf_knorm.attention.masks import KeyPadding
from hf_knorm.normalizations import Softmax, parse_normalization, with_window
from hf_knorm.attention.reference import reference_attention, reference_window_attention, window_split
from hf_knorm.attention.window import ROW_EPS, window_attention, window_path

ATOL = 1e-10
SPELLINGS = ("x^3/16", "x^3/sqrtN", "x/1", "x/16", "x/sqrtN", "x^2/0.5")


def _inputs(batch=2, q_heads=6, kv_heads=2, q_len=37, kv_len=37, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes]


def _valid(kind: str, batch: int, kv_len: int) -> torch.Tensor | None:
    """Key validity ``(B, kv)``: ``"all"`` real, ``"left"`` left padding in row 1, ``"holes"`` a hole in row 0 too."""
    if kind == "none":
        return None
    valid = torch.ones(batch, kv_len, dtype=torch.bool)
    if kind in ("left", "holes"):
        valid[1, :5] = False
    if kind == "holes":
        valid[0, kv_len - 4] = False
        valid[0, 3] = False
    return valid


def _compare(got, want, tensors, real_rows, extra=()):
    """Outputs ``(B, q, H, D)`` on the real rows, and the gradients of a loss that reads only those rows."""
    rows = real_rows[:, :, None, None]
    torch.testing.assert_close(got * rows, want * rows, rtol=0, atol=ATOL)
    grad = torch.randn_like(want) * rows
    inputs = tuple(tensors) + tuple(extra)
    expected = torch.autograd.grad((want * grad).sum(), inputs, allow_unused=True, materialize_grads=True)
    actual = torch.autograd.grad((got * grad).sum(), inputs, allow_unused=True, materialize_grads=True)
    for name, a, b in zip("qkvm", actual, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"d{name}")


def _real_rows(valid, batch, q_len, kv_len):
    """``(B, q)``: the queries whose own key (at ``kv - q + i``) is real."""
    if valid is None:
        return torch.ones(batch, q_len, dtype=torch.bool)
    return valid[:, kv_len - q_len:]


# --- the spelling ---------------------------------------------------------------------------------------------------

def test_the_window_is_part_of_the_normalization_and_its_name():
    windowed = parse_normalization("x^3/16 + softmax window 64")
    assert (windowed.base.power, windowed.base.constant, windowed.window) == (3, 16.0, 64)
    assert windowed.name == str(windowed) == "x^3/16 + softmax window 64"
    assert parse_normalization(windowed.name) == windowed == with_window(parse_normalization("x^3/16"), 64)
    assert parse_normalization(" x/sqrtN+Softmax Window 8 ").name == "x/sqrtN + softmax window 8"
    assert windowed.without_window == parse_normalization("x^3/16")
    pure = parse_normalization("x^3/16")
    assert with_window(pure, 0) == pure and with_window(pure, 0).name == "x^3/16"
    assert parse_normalization("x^3/16 + softmax window 0") == pure  # W = 0 is the pure normalization


def test_the_sinks_are_part_of_the_name_and_need_a_window():
    sunk = parse_normalization("x^3/16 + softmax window 64 + sinks 4")
    assert (sunk.window, sunk.sinks, sunk.name) == (64, 4, "x^3/16 + softmax window 64 + sinks 4")
    assert parse_normalization(sunk.name) == sunk == with_window(parse_normalization("x^3/16"), 64, sinks=4)
    assert sunk.without_window == parse_normalization("x^3/16")
    assert with_window(sunk, 64) == sunk  # the sinks it has are kept
    assert parse_normalization("x/1 + softmax window 8 + sinks 0").name == "x/1 + softmax window 8"
    for bad, message in [(dict(window=0, sinks=2), "without a softmax window"), (dict(window=64, sinks=-1), ">= 0"),
                         (dict(window=64, sinks=True), ">= 0")]:
        with pytest.raises(ValueError, match=message):
            with_window(parse_normalization("x^3/16"), **bad)
    with pytest.raises(ValueError, match="contradicts"):
        with_window(sunk, 64, sinks=2)
    with pytest.raises(ValueError, match="sinks are a number"):
        parse_normalization("x^3/16 + softmax window 64 + sinks four")


@pytest.mark.parametrize("spelling, window, message", [
    ("x^3/16", -1, "integer >= 0"),
    ("x^3/16", 2.5, "integer >= 0"),
    ("x^3/16", True, "integer >= 0"),
    ("softmax", 4, "already weighted by softmax"),
    ("softmax(sink=learned)", 4, "cancels a sink"),  # the part beside the window is RMS-normalized per row
    ("x^3/16 + softmax window 8", 4, "contradicts"),
])
def test_bad_windows_raise_saying_what_to_do(spelling, window, message):
    with pytest.raises(ValueError, match=message):
        with_window(parse_normalization(spelling), window)


@pytest.mark.parametrize("spelling", ["x^3/16 + softmax window -3", "x^3/16 + softmax window", "x/1 + softmax window x",
                                      "softmax + softmax window 4", "relu + softmax window 4"])
def test_bad_window_spellings_raise(spelling):
    with pytest.raises(ValueError):
        parse_normalization(spelling)


def test_the_elementwise_weights_refuse_a_window():
    with pytest.raises(ValueError, match="window_attention"):
        parse_normalization("x/1 + softmax window 4").weights(torch.zeros(2, 2), None)


# --- the reference --------------------------------------------------------------------------------------------------

def test_reference_by_hand_with_a_window_of_one():
    """W = 1: each query's own value by softmax (weight 1), the keys before by s^p / c, that row brought to RMS 1."""
    q, k, v = (torch.randn(1, 1, 3, 4, dtype=torch.float64) for _ in range(3))
    normalization = parse_normalization("x^3/16 + softmax window 1")
    output, weights = reference_window_attention(q, k, v, None, normalization)
    s = (q @ k.transpose(-1, -2) / 2.0)[0, 0]
    unit = lambda u: u / (u.pow(2).mean() + ROW_EPS).sqrt()  # noqa: E731
    expected = torch.stack([v[0, 0, 0], v[0, 0, 1] + unit(s[1, 0] ** 3 / 16 * v[0, 0, 0]),
                            v[0, 0, 2] + unit((s[2, 0] ** 3 * v[0, 0, 0] + s[2, 1] ** 3 * v[0, 0, 1]) / 16)])
    torch.testing.assert_close(output[0, :, 0], expected, rtol=0, atol=1e-12)
    assert torch.equal(torch.diagonal(weights[0, 0]), torch.ones(3, dtype=torch.float64))


def test_reference_by_hand_with_a_window_of_one_and_a_sink():
    """W = 1, S = 1: query 2 weights keys 0 (the sink) and 2 by softmax over the two, key 1 alone by s^3 / 16."""
    q, k, v = (torch.randn(1, 1, 3, 4, dtype=torch.float64) for _ in range(3))
    sunk = parse_normalization("x^3/16 + softmax window 1 + sinks 1")
    output, weights = reference_window_attention(q, k, v, None, sunk)
    s = (q @ k.transpose(-1, -2) / 2.0)[0, 0]
    unit = lambda u: u / (u.pow(2).mean() + ROW_EPS).sqrt()  # noqa: E731
    sink, own = torch.softmax(torch.stack([s[2, 0], s[2, 2]]), dim=0)
    expected = sink * v[0, 0, 0] + own * v[0, 0, 2] + unit(s[2, 1] ** 3 / 16 * v[0, 0, 1])
    torch.testing.assert_close(output[0, 2, 0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(output[0, 1, 0], torch.softmax(s[1, :2], dim=0) @ v[0, 0, :2], rtol=0, atol=1e-12)
    assert weights[0, 0, 2, 0] == sink


def test_reference_by_hand_on_packed_sequences_with_a_sink():
    """Two sequences packed at tokens 0 and 3, W = 2, S = 1: each row's sink is its own sequence's first token (3 for
    the second one), fixed while the row moves; row 6 weights keys 3, 5, 6 by softmax and key 4 alone by s^3 / 16."""
    allowed = _packed(7, [3])[None, None]
    soft, older = window_split(allowed, 2, 1)
    drawn = ["".join("s" if s else "o" if o else "." for s, o in zip(*rows)) for rows in zip(soft[0, 0], older[0, 0])]
    assert drawn == ["s......", "ss.....", "sss....", "...s...", "...ss..", "...sss.", "...soss"]
    q, k, v = (torch.randn(1, 1, 7, 4, dtype=torch.float64) for _ in range(3))
    output, _ = reference_window_attention(q, k, v, allowed, parse_normalization("x^3/16 + softmax window 2 + sinks 1"))
    s = (q @ k.transpose(-1, -2) / 2.0)[0, 0]
    unit = lambda u: u / (u.pow(2).mean() + ROW_EPS).sqrt()  # noqa: E731
    expected = torch.softmax(s[6, [3, 5, 6]], dim=0) @ v[0, 0, [3, 5, 6]] + unit(s[6, 4] ** 3 / 16 * v[0, 0, 4])
    torch.testing.assert_close(output[0, 6, 0], expected, rtol=0, atol=1e-12)


def test_reference_with_a_window_longer_than_the_keys_is_softmax_and_the_older_part_has_rms_one():
    q, k, v = _inputs(q_len=9, kv_len=9)
    softmax, _ = reference_attention(q, k, v, None, Softmax(), causal=True)
    windowed, _ = reference_window_attention(q, k, v, None, parse_normalization("x^3/sqrtN + softmax window 9"))
    torch.testing.assert_close(windowed, softmax, rtol=0, atol=1e-12)
    _, weights = reference_window_attention(q, k, v, None, parse_normalization("x/sqrtN + softmax window 3"))
    scores = (q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 8 ** -0.5)
    row = 8  # keys 0..5 are older than its window (6, 7, 8)
    ratio = weights[..., row, :6] / scores[..., row, :6]  # the paper's weights, one factor per row and head
    torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-10, atol=0)
    part = weights[..., row, None, :6] @ v.repeat_interleave(3, dim=1)[..., :6, :]  # (B, H_q, 1, D)
    # RMS 1 and the constant cancelling hold up to ROW_EPS's share of a row's mean square (1e-12 against ~1e-3 here)
    torch.testing.assert_close(part.pow(2).mean(dim=-1), torch.ones_like(part[..., 0]), rtol=1e-8, atol=0)
    _, plain = reference_window_attention(q, k, v, None, parse_normalization("x/1 + softmax window 3"))
    torch.testing.assert_close(plain, weights, rtol=1e-8, atol=1e-12)


# --- the fast paths against the reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("window_size", [1, 4, 9, 60])
@pytest.mark.parametrize("q_len, kv_len, padding", [
    (q_len, kv_len, padding) for q_len, kv_len in [(37, 37), (13, 45), (1, 45), (3, 7)]
    for padding in ["none", "all", "holes"]
    if padding != "none" or q_len in (1, kv_len)  # no mask means sdpa's top-left causal mask: keys cut to the queries
])
@pytest.mark.parametrize("sinks", [0, 3])
def test_key_padding_paths_equal_the_reference(spelling, window_size, q_len, kv_len, padding, sinks, monkeypatch):
    """Bottom-right causal calls: a prefill, a chunk after a cache, a decoded token, fewer keys than the window;
    with and without attention sinks (3: more than the "holes" padding's first real keys, fewer than some windows).
    Blocks of 8 queries for the softmax part; for p = 1 the linear kernel (LINEAR_MIN_QUERIES = 1)."""
    monkeypatch.setattr(window, "BAND_ROWS", 8)
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)
    normalization = with_window(parse_normalization(spelling), window_size, sinks=sinks)
    q, k, v = _inputs(q_len=q_len, kv_len=kv_len)
    valid = _valid(padding, 2, kv_len)
    mask = None if valid is None else KeyPadding(valid, q_len, causal=True)
    mix = torch.linspace(0.5, 2.0, 6, dtype=torch.float64).requires_grad_()
    got, weights = window_attention(q, k, v, mask, normalization, mix=mix)
    assert weights is None
    want, _ = reference_window_attention(q, k, v, None if mask is None else mask.dense(), normalization, mix=mix)
    _compare(got, want, (q, k, v), _real_rows(valid, 2, q_len, kv_len), extra=(mix,))
    path = window_path(normalization, q_len, kv_len, mask, None, causal=True, softcap=None, dropout=0.0,
                       return_weights=False, has_state=False)
    assert path.linear == (normalization.base.power == 1 and kv_len > window_size)


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_left_padding_gives_every_row_the_reference(spelling, sinks):
    """Row 1's sinks are its first real keys (5 and 6), not the padding before them."""
    normalization = with_window(parse_normalization(spelling), 4, sinks=sinks)
    q, k, v = _inputs()
    valid = _valid("left", 2, 37)
    mask = KeyPadding(valid, 37, causal=True)
    got, _ = window_attention(q, k, v, mask, normalization)
    want, _ = reference_window_attention(q, k, v, mask.dense(), normalization)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert got[1, :5].abs().max() == 0  # padded queries attend nothing


@pytest.mark.parametrize("kv_len", [2, 37])
def test_leading_sinks_are_what_the_general_search_finds_without_padding(kv_len):
    """The shortcut of unpadded calls (slicing the first S keys) against the search any padding needs."""
    _, k, v = _inputs(kv_len=kv_len)
    fast = window.leading_sinks(k, v, 4)
    general = window.sink_keys(k, v, None, 4, q_len=kv_len)
    for got, want in zip(fast, general, strict=True):
        torch.testing.assert_close(got, want.expand_as(got), rtol=0, atol=0)
    assert fast.position.shape[-1] == min(4, kv_len)


def _sliding(q_len, kv_len, size):
    positions = torch.arange(kv_len)
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    return (positions <= rows) & (positions > rows - size)


def _packed(length, starts):
    """Block-diagonal causal mask of sequences packed at ``starts``."""
    document = torch.zeros(length, dtype=torch.long)
    for start in starts:
        document[start:] += 1
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal & (document[:, None] == document[None, :])


def _explicit_case(case):
    """``(q, k, v, allowed)`` of an explicit-mask case."""
    if case.startswith("model window"):
        q, k, v = _inputs(q_len=13, kv_len=20)
        allowed = _sliding(13, 20, int(case.split()[-1]))[None, None]
    elif case == "packed":
        q, k, v = _inputs(q_len=20, kv_len=20)
        allowed = _packed(20, [7, 9, 15])[None, None]
    elif case == "static cache":
        q, k, v = _inputs(q_len=3, kv_len=16)
        allowed = (torch.arange(16)[None, :] <= torch.arange(6, 9)[:, None])[None, None]
    else:
        q, k, v = _inputs(q_len=20, kv_len=20)
        allowed = (_sliding(20, 20, 7)[None] & _valid("left", 2, 20)[:, None, :])[:, None]
    return q, k, v, allowed


SLIDING = ("model window 6", "model window 3", "padded sliding")


@pytest.mark.parametrize("spelling", ["x^3/16", "x/sqrtN", "x^3/sqrtN"])
@pytest.mark.parametrize("case, sinks", [(case, sinks) for case in SLIDING + ("packed", "static cache")
                                         for sinks in (0, 2) if not (sinks and case in SLIDING)])
def test_explicit_masks_equal_the_reference(spelling, case, sinks):
    """A model's own sliding window (longer and shorter than the softmax window of 4), packed sequences, a static
    cache's top-left layout (keys past the query not yet written), with the weights returned. Sinks: each
    sequence's first tokens (a packed sequence's; a sliding window's are refused, below)."""
    normalization = with_window(parse_normalization(spelling), 4, sinks=sinks)
    q, k, v, allowed = _explicit_case(case)
    mix = torch.linspace(2.0, 0.5, 6, dtype=torch.float64).requires_grad_()
    got, weights = window_attention(q, k, v, allowed, normalization, return_weights=True, mix=mix)
    want, want_weights = reference_window_attention(q, k, v, allowed, normalization, mix=mix)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=ATOL)
    _compare(got, want, (q, k, v), torch.ones(2, q.shape[2], dtype=torch.bool), extra=(mix,))
    explicit, _ = window_attention(q, k, v, allowed, normalization, mix=mix)
    torch.testing.assert_close(explicit, got, rtol=0, atol=0)


@pytest.mark.parametrize("case", SLIDING)
def test_sinks_on_a_sliding_window_are_refused(case):
    """A layer's own sliding window leaves its sequence's first tokens behind: the sinks are refused, by the layer's
    ``sliding_window`` (what a model passes) and, in the reference, by the mask itself; the window alone runs."""
    q, k, v, allowed = _explicit_case(case)
    size = 7 if case == "padded sliding" else int(case.split()[-1])
    sunk = parse_normalization("x^3/16 + softmax window 4 + sinks 2")
    with pytest.raises(ValueError, match=f"own sliding window of {size} positions.*without attention_sinks"):
        window_attention(q, k, v, allowed, sunk, sliding_window=size)
    with pytest.raises(ValueError, match="does not attend the first keys of its sequence"):
        reference_window_attention(q, k, v, allowed, sunk)
    alone = parse_normalization("x^3/16 + softmax window 4")
    got, _ = window_attention(q, k, v, allowed, alone, sliding_window=size)
    want, _ = reference_window_attention(q, k, v, allowed, alone)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_key_padding_and_its_explicit_mask_agree_on_every_real_query(spelling, sinks):
    normalization = with_window(parse_normalization(spelling), 5, sinks=sinks)
    q, k, v = _inputs(q_len=13, kv_len=30)
    valid = _valid("holes", 2, 30)
    mask = KeyPadding(valid, 13, causal=True)
    compact, _ = window_attention(q, k, v, mask, normalization)
    explicit, _ = window_attention(q, k, v, mask.dense(), normalization)
    rows = _real_rows(valid, 2, 13, 30)[:, :, None, None]
    torch.testing.assert_close(compact * rows, explicit * rows, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
def test_softcap_and_scaling(spelling, monkeypatch):
    monkeypatch.setattr(window, "BAND_ROWS", 8)
    normalization = with_window(parse_normalization(spelling), 6)
    q, k, v = _inputs()
    valid = _valid("left", 2, 37)
    mask = KeyPadding(valid, 37, causal=True)
    got, _ = window_attention(q, k, v, mask, normalization, softcap=2.0, scaling=0.7)
    want, _ = reference_window_attention(q, k, v, mask.dense(), normalization, softcap=2.0, scaling=0.7)
    _compare(got, want, (q, k, v), _real_rows(valid, 2, 37, 37))


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
@pytest.mark.parametrize("explicit", [False, True])
def test_frobenius_norms_of_both_parts(spelling, explicit, monkeypatch):
    """The squared Frobenius norm of each head's whole weight matrix (the mix counted squared), without it; blocks of
    8 queries for the softmax part (the last one padded with 4 rows that must count nothing)."""
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)
    monkeypatch.setattr(window, "BAND_ROWS", 8)
    normalization = with_window(parse_normalization(spelling), 4)
    q, k, v = _inputs(q_len=20, kv_len=20)
    mask = KeyPadding(_valid("left", 2, 20), 20, causal=True)
    mix = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    accumulator = torch.zeros(2, 2, 3, dtype=torch.float32)
    window_attention(q, k, v, mask.dense() if explicit else mask, normalization, mix=mix, frobenius_sq=accumulator)
    _, weights = reference_window_attention(q, k, v, mask.dense(), normalization, mix=mix)
    expected = weights.square().sum(dim=(-2, -1)).reshape(2, 2, 3).float()
    torch.testing.assert_close(accumulator, expected, rtol=1e-6, atol=0)


def test_the_path_names_the_polynomial_part():
    x1, x3 = (parse_normalization(s + " + softmax window 64") for s in ("x/1", "x^3/16"))
    options = dict(causal=True, softcap=None, dropout=0.0, return_weights=False, has_state=False)
    valid = torch.ones(1, 1024, dtype=torch.bool)
    assert window_path(x1, 1024, 1024, KeyPadding(valid, 1024, True), None, **options).linear
    assert window_path(x1, 1024, 1024, None, None, **options).linear
    cubic = window_path(x3, 1024, 1024, None, None, **options)
    assert not cubic.linear and not cubic.fallback
    explicit = window_path(x1, 8, 8, torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(), None, **options)
    assert not explicit.linear and explicit.fallback and "explicit mask" in explicit.reason
    assert window_path(x1, 1, 1024, KeyPadding(valid, 1, True), None, **dict(options, has_state=True)).linear
    softcapped = window_path(x1, 1024, 1024, None, None, **dict(options, softcap=2.0))
    assert not softcapped.linear and softcapped.fallback


def test_what_the_window_cannot_compute_is_refused():
    q, k, v = _inputs(q_len=5, kv_len=5)
    windowed = parse_normalization("x^3/16 + softmax window 2")
    with pytest.raises(ValueError, match="bidirectional"):
        window_attention(q, k, v, None, windowed, causal=False)
    with pytest.raises(ValueError, match="bidirectional"):
        window_attention(q, k, v, KeyPadding(torch.ones(2, 5, dtype=torch.bool), 5, causal=False), windowed)
    with pytest.raises(ValueError, match="not x\\^3/16"):
        window_attention(q, k, v, None, parse_normalization("x^3/16"))
    with pytest.raises(ValueError, match="per query head"):
        window_attention(q, k, v, None, windowed, mix=torch.ones(2, dtype=torch.float64))


def test_the_kernels_refuse_a_window_instead_of_dropping_it():
    from hf_knorm.attention.compiled import compiled_attention
    from hf_knorm.attention.kernel import chunked_attention
    from hf_knorm.attention.linear_kernel import linear_attention

    q, k, v = _inputs(q_len=5, kv_len=5)
    windowed = parse_normalization("x/1 + softmax window 2")
    with pytest.raises(ValueError, match="window_attention"):
        linear_attention(q, k, v, None, windowed)
    with pytest.raises(ValueError, match="window_attention"):
        chunked_attention(q, k, v, None, windowed, causal=True)
    with pytest.raises(ValueError, match="window_attention"):
        compiled_attention(q, k, v, None, None, windowed, scaling=None, softcap=None, causal=True)


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
def test_an_additive_bias_enters_both_parts(spelling):
    """A rank-one bias ``b_ij = a_i c_j`` is the score of one more channel (``q`` gets ``a / scaling``, ``k`` gets
    ``c``): the reference on those channels is the exact answer."""
    normalization = with_window(parse_normalization(spelling), 4)
    q, k, v = _inputs(q_len=12, kv_len=12)
    generator = torch.Generator().manual_seed(1)
    a, c = torch.randn(2, 6, 12, 1, generator=generator, dtype=torch.float64), torch.randn(2, 2, 12, 1,
                                                                                          generator=generator,
                                                                                          dtype=torch.float64)
    scaling = 8 ** -0.5
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    bias = (a @ c.repeat_interleave(3, dim=1).transpose(-1, -2))[:, :, :, :]  # (B, H_q, q, kv)
    got, _ = window_attention(q, k, v, allowed.expand(2, 6, 12, 12), normalization, bias=bias, scaling=scaling)
    want, _ = reference_window_attention(torch.cat([q, a / scaling], dim=-1), torch.cat([k, c], dim=-1), v,
                                         allowed, normalization, scaling=scaling)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_dropout_reaches_both_parts(monkeypatch):
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)
    normalization = parse_normalization("x/1 + softmax window 3")
    q, k, v = _inputs(q_len=20, kv_len=20)
    mask = KeyPadding(torch.ones(2, 20, dtype=torch.bool), 20, causal=True)
    dropped, _ = window_attention(q, k, v, mask, normalization, dropout=1.0)
    assert dropped.abs().max() == 0
    path = window_path(normalization, 20, 20, mask, None, causal=True, softcap=None, dropout=0.5,
                       return_weights=False, has_state=False)
    assert not path.linear and "dropout" in path.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_adds_the_parts_in_fp32(dtype, monkeypatch):
    """bf16/fp16 inputs: the output is the fp64 reference on the same (rounded) inputs, rounded once to the dtype."""
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)
    for spelling in ("x^3/16", "x/1"):
        normalization = with_window(parse_normalization(spelling), 4)
        q, k, v = (t.detach().to(dtype) for t in _inputs(q_len=20, kv_len=20))
        got, _ = window_attention(q, k, v, KeyPadding(torch.ones(2, 20, dtype=torch.bool), 20, causal=True),
                                  normalization)
        assert got.dtype == dtype
        want, _ = reference_window_attention(q.double(), k.double(), v.double(), None, normalization)
        eps = torch.finfo(dtype).eps  # one rounding: within half a unit of the exact value, elementwise
        torch.testing.assert_close(got.double(), want, rtol=0.5 * eps * 1.001, atol=1e-5)
