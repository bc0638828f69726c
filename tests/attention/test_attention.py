"""The memory-efficient attention against the plain reference: forward, gradients, masks, GQA, dtypes."""

import math

import pytest
import torch

from hf_knorm.attention.interface import read_mask
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.normalizations import FAMILIES, PAPER_NORMALIZATIONS, parse_normalization
from hf_knorm.attention.reference import reference_attention

NORMALIZATIONS = PAPER_NORMALIZATIONS + ("x^2/4",)


def _tensors(batch=2, q_heads=4, kv_heads=2, q_len=37, kv_len=37, dim=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()  # noqa: E731
    return make(batch, q_heads, q_len, dim), make(batch, kv_heads, kv_len, dim), make(batch, kv_heads, kv_len, dim)


def _padded_causal_mask(batch, q_len, kv_len, pad):
    """Causal bool mask, bottom-right aligned, batch item 1 left-padded by ``pad`` tokens: (B, 1, q, kv)."""
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    mask = (torch.arange(kv_len)[None, :] <= rows).expand(batch, 1, q_len, kv_len).clone()
    mask[1, :, :, :pad] = False
    return mask


@pytest.mark.compat
@pytest.mark.parametrize("spelling", NORMALIZATIONS)
@pytest.mark.parametrize("chunk_elements", [10**9, 300], ids=["one-chunk", "many-chunks"])
def test_forward_and_gradients_match_reference(spelling, chunk_elements):
    normalization = parse_normalization(spelling)
    q, k, v = _tensors()
    mask = _padded_causal_mask(2, 37, 37, pad=5)
    out, _ = chunked_attention(q, k, v, mask, normalization, scaling=0.4, chunk_elements=chunk_elements)
    ref, _ = reference_attention(q, k, v, mask, normalization, scaling=0.4)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # fp64: exact up to summation order
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("spelling", [example for family in FAMILIES.values() for example in family.examples])
@pytest.mark.parametrize("chunk_elements", [10**9, 300], ids=["one-chunk", "many-chunks"])
def test_every_family_matches_reference_with_its_learnable_values(spelling, chunk_elements):
    """Each registered family's example spellings, a padded causal batch, fp64: outputs and gradients (the learnable
    values' included: one per query head, spread around their initial value)."""
    normalization = parse_normalization(spelling)
    q, k, v = _tensors()
    generator = torch.Generator().manual_seed(1)
    params = {name: (init + 0.3 * torch.randn(4, generator=generator, dtype=torch.float64)).requires_grad_()
              for name, init in normalization.learnable().items()}
    mask = _padded_causal_mask(2, 37, 37, pad=5)
    out, _ = chunked_attention(q, k, v, mask, normalization, scaling=0.4, chunk_elements=chunk_elements, params=params)
    ref, _ = reference_attention(q, k, v, mask, normalization, scaling=0.4, params=params)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(out)
    inputs = (q, k, v, *params.values())
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"input {index}: {m}")


@pytest.mark.parametrize("spelling", ["softmax", "x^3/sqrtN", "x/16"])
def test_decoding_rows_against_a_longer_cache(spelling):
    """q shorter than kv (a decode step or a chunked prefill against a cache), with a sliding window."""
    normalization = parse_normalization(spelling)
    q, k, v = _tensors(q_len=3, kv_len=20)
    mask = _padded_causal_mask(2, 3, 20, pad=4)
    mask[..., :10] = False  # a window: old keys are out of reach
    out, _ = chunked_attention(q, k, v, mask, normalization, chunk_elements=16)
    ref, _ = reference_attention(q, k, v, mask, normalization)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spelling", ["softmax", "x^3/16"])
def test_softcap_and_implicit_causal_mask(spelling):
    normalization = parse_normalization(spelling)
    q, k, v = _tensors(q_len=25, kv_len=25)
    out, _ = chunked_attention(q, k, v, None, normalization, softcap=2.0, causal=True, chunk_elements=100)
    ref, _ = reference_attention(q, k, v, None, normalization, softcap=2.0, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_returned_weights_are_post_normalization_and_masked():
    normalization = parse_normalization("x^3/16")
    q, k, v = _tensors(q_len=9, kv_len=9)
    mask = _padded_causal_mask(2, 9, 9, pad=3)
    _, weights = chunked_attention(q, k, v, mask, normalization, return_weights=True, chunk_elements=50)
    _, ref = reference_attention(q, k, v, mask, normalization)
    torch.testing.assert_close(weights, ref)
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()


def test_frobenius_accumulator_without_materializing():
    normalization = parse_normalization("softmax")
    q, k, v = _tensors(q_len=30, kv_len=30)
    mask = _padded_causal_mask(2, 30, 30, pad=6)
    frobenius_sq = torch.zeros(2, 2, 2)
    chunked_attention(q, k, v, mask, normalization, frobenius_sq=frobenius_sq, chunk_elements=100)
    _, ref = reference_attention(q, k, v, mask, normalization)
    torch.testing.assert_close(frobenius_sq.reshape(2, 4), ref.square().sum(dim=(-2, -1)).float())
    # softmax bounds the norm by sqrt(number of real rows)
    assert (frobenius_sq.sqrt()[1] <= math.sqrt(24) + 1e-5).all()


@pytest.mark.compat
def test_hand_computed_three_tokens():
    """q = (1, 2, -1), k = (1, 1, 2), v = (1, 10, 100), one head, D = 1, scaling 1, causal.

    Scores, causal: row 0 (1), row 1 (2, 2), row 2 (-1, -1, -2).
    x^3/1: outputs 1, 8 + 80 = 88, -1 - 10 - 800 = -811. x/16: 1/16, 22/16, -211/16.
    x^3/sqrtN: 1/1, 88/sqrt(2), -811/sqrt(3).
    """
    q = torch.tensor([1.0, 2.0, -1.0]).view(1, 1, 3, 1)
    k = torch.tensor([1.0, 1.0, 2.0]).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 10.0, 100.0]).view(1, 1, 3, 1)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().view(1, 1, 3, 3)
    expected = {
        "x^3/1": [1.0, 88.0, -811.0],
        "x/16": [1 / 16, 22 / 16, -211 / 16],
        "x^3/sqrtN": [1.0, 88 / math.sqrt(2), -811 / math.sqrt(3)],
        "softmax": [1.0, 5.5, (math.exp(-1) * 11 + math.exp(-2) * 100) / (2 * math.exp(-1) + math.exp(-2))],
    }
    for spelling, values in expected.items():
        out, _ = chunked_attention(q, k, v, mask, parse_normalization(spelling), scaling=1.0, chunk_elements=1)
        torch.testing.assert_close(out.flatten(), torch.tensor(values), msg=spelling)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_the_power_in_fp32(dtype):
    """Scores of ~60 cubed overflow fp16 (max 65504): computed in fp32, the result is finite and right."""
    normalization = parse_normalization("x^3/16")
    q, k, v = (t.detach() for t in _tensors(q_len=16, kv_len=16, dim=4, dtype=torch.float32))
    q, k = q * 4, k * 4
    mask = _padded_causal_mask(2, 16, 16, pad=4)
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)  # eager-style mask
    allowed, bias = read_mask(additive, 16, 16, causal=True)
    assert bias is None and torch.equal(allowed, mask)
    out, _ = chunked_attention(q.to(dtype), k.to(dtype), v.to(dtype), allowed, normalization)
    ref, _ = reference_attention(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), mask, normalization)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_gqa_grouping_matches_repeated_heads():
    """Query head h reads KV head h // groups (Transformers' repeat_kv)."""
    normalization = parse_normalization("x^3/sqrtN")
    q, k, v = _tensors(q_heads=6, kv_heads=2, q_len=7, kv_len=7)
    out, _ = chunked_attention(q, k, v, None, normalization, causal=True)
    repeated, _ = chunked_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), None, normalization, causal=True)
    torch.testing.assert_close(out, repeated)
    wrong, _ = chunked_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), None, normalization, causal=True)
    assert not torch.allclose(out, wrong)


def test_bad_head_counts_raise():
    q, k, v = _tensors(q_heads=5, kv_heads=2)
    with pytest.raises(ValueError, match="cannot be grouped"):
        chunked_attention(q, k, v, None, parse_normalization("x/1"))


@pytest.mark.parametrize("spelling", ["softmax", "x^3/sqrtN", "x/1"])
def test_all_training_paths_agree(spelling):
    """Hand-written backward (default), autograd with returned weights, and checkpointed autograd (dropout)."""
    normalization = parse_normalization(spelling)
    q, k, v = _tensors(q_len=21, kv_len=21)
    mask = _padded_causal_mask(2, 21, 21, pad=3)
    results = []
    for options in (dict(), dict(return_weights=True)):
        out, _ = chunked_attention(q, k, v, mask, normalization, softcap=3.0, chunk_elements=200, **options)
        results.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    for (out, grads), (ref_out, ref_grads) in zip(results[1:], results[:1]):
        torch.testing.assert_close(out, ref_out)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    dropped = []
    for options in (dict(), dict(return_weights=True)):  # checkpointed vs kept chunks: same dropout masks
        torch.manual_seed(7)
        out, _ = chunked_attention(q, k, v, mask, normalization, dropout=0.3, chunk_elements=200, **options)
        dropped.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    torch.testing.assert_close(dropped[0][0], dropped[1][0])
    for grad, ref_grad in zip(dropped[0][1], dropped[1][1]):
        torch.testing.assert_close(grad, ref_grad)
    assert not torch.allclose(dropped[0][0], results[0][0])


def test_additive_mask_with_biases_is_split():
    mask = torch.tensor([[0.0, -1.5, torch.finfo(torch.float32).min]]).view(1, 1, 1, 3)
    allowed, bias = read_mask(mask, 1, 3, causal=False)
    assert allowed.tolist() == [[[[True, True, False]]]]
    assert bias.tolist() == [[[[0.0, -1.5, 0.0]]]]
