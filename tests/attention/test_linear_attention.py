"""The linear path for p = 1 (x/1, x/16, x/sqrtN) against the plain reference and the quadratic kernel.

Tolerances: fp64 1e-10 (outputs and gradients, absolute, on values of size ~1-10); fp32 against the fp64 reference
2e-5 relative to the largest output (the sums run in another order: states over chunks instead of rows).
"""

import pytest
import torch

import hf_knorm
from hf_knorm.attention import linear_kernel, paths
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.linear_kernel import linear_attention
from hf_knorm.normalizations import parse_normalization
from hf_knorm.attention.paths import attention_paths, causal_key_validity, choose_path
from hf_knorm.attention.reference import reference_attention
from hf_knorm.recording.record_norms import record_norms

LINEAR = ("x/1", "x/16", "x/sqrtN")
FP64_ATOL = 1e-10
FP32_RTOL = 2e-5


def _inputs(batch=2, q_heads=6, kv_heads=2, q_len=37, kv_len=45, dim=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim)]
    return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]


def _padded_causal(batch, q_len, kv_len):
    """Key validity (left padding in row 1, a hole in row 0) and the bottom-right causal mask it implies."""
    valid = torch.ones(batch, kv_len, dtype=torch.bool)
    valid[1, :5] = False
    valid[0, kv_len - 4] = False
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    return valid, (causal[None] & valid[:, None, :])[:, None]


@pytest.mark.parametrize("chunk_size, segment_elements", [(1, 1 << 21), (8, 1 << 21), (8, 1500), (64, 1 << 21)])
@pytest.mark.parametrize("spelling", LINEAR)
def test_fp64_outputs_and_gradients_equal_the_reference_and_the_quadratic_kernel(spelling, chunk_size,
                                                                                 segment_elements, monkeypatch):
    """Chunks of 1 row, 8 rows and more rows than the queries; 1500 scores per segment: 2 chunks per segment."""
    monkeypatch.setattr(linear_kernel, "SEGMENT_ELEMENTS", segment_elements)
    normalization = parse_normalization(spelling)
    q, k, v = _inputs()
    valid, allowed = _padded_causal(2, 37, 45)
    reference, _ = reference_attention(q, k, v, allowed, normalization)
    quadratic, _ = chunked_attention(q, k, v, allowed, normalization)
    linear = linear_attention(q, k, v, valid, normalization, chunk_size=chunk_size)
    torch.testing.assert_close(linear, reference, rtol=0, atol=FP64_ATOL)
    torch.testing.assert_close(linear, quadratic, rtol=0, atol=FP64_ATOL)
    grad = torch.randn_like(reference)
    expected = torch.autograd.grad((reference * grad).sum(), (q, k, v))
    got = torch.autograd.grad((linear * grad).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=FP64_ATOL, msg=f"d{name}")


@pytest.mark.parametrize("spelling", LINEAR)
def test_fp32_against_the_fp64_reference(spelling):
    normalization = parse_normalization(spelling)
    q, k, v = _inputs(q_len=300, kv_len=300)
    reference, _ = reference_attention(q, k, v, None, normalization, causal=True)
    linear = linear_attention(q.float(), k.float(), v.float(), None, normalization)
    assert linear.dtype == torch.float32
    error = (linear.double() - reference).abs().max() / reference.abs().max()
    assert error < FP32_RTOL


def test_a_state_carries_the_keys_before_exactly():
    """Two calls, the second continuing from the first's state, equal one call (prefill in two chunks, decoding)."""
    for spelling in LINEAR:
        normalization = parse_normalization(spelling)
        q, k, v = _inputs()
        valid, allowed = _padded_causal(2, 37, 45)
        whole, _ = reference_attention(q, k, v, allowed, normalization)
        first, state, count = linear_attention(q[:, :, :20], k[:, :, :28], v[:, :, :28], valid[:, :28], normalization,
                                               return_state=True)
        assert state.shape == (2, 2, 8, 8) and count.tolist() == [28.0, 23.0]
        second = linear_attention(q[:, :, 20:], k[:, :, 28:], v[:, :, 28:], valid[:, 28:], normalization,
                                  initial_state=state, initial_count=count)
        torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=0, atol=FP64_ATOL)


@pytest.mark.parametrize("spelling", LINEAR)
def test_frobenius_norms_without_the_matrix_equal_the_quadratic_kernel(spelling, monkeypatch):
    monkeypatch.setattr(linear_kernel, "SEGMENT_ELEMENTS", 1500)  # several segments carry the K^T K state
    normalization = parse_normalization(spelling)
    q, k, v = (t.detach() for t in _inputs())
    valid, allowed = _padded_causal(2, 37, 45)
    linear, quadratic = (torch.zeros(2, 2, 3, dtype=torch.float64) for _ in range(2))
    linear_attention(q, k, v, valid, normalization, frobenius_sq=linear, chunk_size=8)
    chunked_attention(q, k, v, allowed, normalization, frobenius_sq=quadratic)
    torch.testing.assert_close(linear, quadratic, rtol=1e-12, atol=0)


def test_the_linear_path_refuses_what_it_does_not_compute():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="p = 1"):
        linear_attention(q, k, v, None, parse_normalization("x^3/16"))
    with pytest.raises(ValueError, match="at least as many keys"):
        linear_attention(q, k[:, :, :30], v[:, :, :30], None, parse_normalization("x/1"))
    state = torch.zeros(2, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="use_cache=False"):
        linear_attention(q, k, v, None, parse_normalization("x/1"), initial_state=state,
                         frobenius_sq=torch.zeros(2, 2, 3, dtype=torch.float64))


def test_choose_path():
    x1, cubic = parse_normalization("x/1"), parse_normalization("x^3/16")
    valid, allowed = _padded_causal(2, 200, 200)
    options = dict(causal=True, softcap=None, dropout=0.0, return_weights=False, has_state=False)
    path = choose_path(x1, 200, 200, allowed, None, **options)
    assert path.linear and torch.equal(path.key_valid, valid)
    assert choose_path(x1, 200, 200, None, None, **options).linear
    blocked = {
        "not linear": choose_path(cubic, 200, 200, allowed, None, **options),
        "softcap": choose_path(x1, 200, 200, allowed, None, **dict(options, softcap=5.0)),
        "dropout": choose_path(x1, 200, 200, allowed, None, **dict(options, dropout=0.1)),
        "weights": choose_path(x1, 200, 200, allowed, None, **dict(options, return_weights=True)),
        "bias": choose_path(x1, 200, 200, allowed, torch.zeros(2, 1, 200, 200), **options),
        "LINEAR_MIN_QUERIES": choose_path(x1, 20, 200, allowed[..., -20:, :], None, **options),
        "bidirectional": choose_path(x1, 200, 200, None, None, **dict(options, causal=False)),
        "sliding window": choose_path(x1, 200, 200, allowed & _window(200, 16), None, **options),
    }
    for reason, path in blocked.items():
        assert not path.linear and reason in path.reason, (reason, path.reason)
    assert choose_path(x1, 1, 200, allowed[..., -1:, :], None, **dict(options, has_state=True)).linear


def _window(length, size):
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    return (distance < size)[None, None]


def test_mask_decomposition():
    valid, allowed = _padded_causal(2, 37, 45)
    is_causal, key_valid = causal_key_validity(allowed, 37, 45)
    assert is_causal and torch.equal(key_valid, valid)
    is_causal, key_valid = causal_key_validity(allowed[:1, :, :, :].clone().fill_(True).tril(8), 37, 45)
    assert (is_causal, key_valid) == (True, None)
    block_diagonal = allowed.clone()
    block_diagonal[..., 30:, :20] = False  # packed sequences
    assert causal_key_validity(block_diagonal, 37, 45) == (False, None)


def _model(normalization, model_type="llama"):
    from tiny_models import tiny_model

    return hf_knorm.patch(tiny_model(model_type, dtype=torch.float64), normalization)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("spelling", LINEAR)
def test_a_patched_model_takes_the_linear_path_with_the_quadratic_paths_logits_and_gradients(
        model_type, spelling, monkeypatch):
    model = _model(spelling, model_type)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    runs = {}
    for label, threshold in (("linear", 1), ("quadratic", 10**9)):
        monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", threshold)
        model.zero_grad()
        with attention_paths() as taken:
            logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        assert dict(taken) == {label: model.config.num_hidden_layers}
        runs[label] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (linear_logits, linear_grads), (quadratic_logits, quadratic_grads) = runs["linear"], runs["quadratic"]
    torch.testing.assert_close(linear_logits[mask.bool()], quadratic_logits[mask.bool()], rtol=0, atol=FP64_ATOL)
    for name, grad in quadratic_grads.items():
        torch.testing.assert_close(linear_grads[name], grad, rtol=0, atol=FP64_ATOL, msg=name)


def test_record_norms_on_the_linear_path_equals_the_quadratic_path(monkeypatch):
    model = _model("x/16")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    recorded = {}
    for label, threshold in (("linear", 1), ("quadratic", 10**9)):
        monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", threshold)
        with attention_paths() as taken, record_norms(model) as recorder:
            model(input_ids=ids)
        assert set(taken) == {label}
        recorded[label] = recorder.layers
    for linear, quadratic in zip(recorded["linear"], recorded["quadratic"]):
        torch.testing.assert_close(linear.attention_frobenius(), quadratic.attention_frobenius(), rtol=1e-6, atol=0)
        torch.testing.assert_close(linear.key_channel_norms(), quadratic.key_channel_norms(), rtol=1e-12, atol=0)
