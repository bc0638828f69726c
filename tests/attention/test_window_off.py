"""A windowed layer with its window dropped (window dropout, ``attention/window_off.py``): the base family alone over
every allowed key, RMS-normalized per row and mixed, against a plain reference; in training only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_model  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.attention.interface import hf_knorm_attention  # noqa: E402
from hf_knorm.attention import paths  # noqa: E402
from hf_knorm.attention.masks import KeyPadding  # noqa: E402
from hf_knorm.attention.paths import Path as KernelPath  # noqa: E402
from hf_knorm.attention.reference import reference_attention, reference_window_attention  # noqa: E402
from hf_knorm.attention.window import ROW_EPS  # noqa: E402
from hf_knorm.attention.window_off import WINDOW_DROPPED, window_is_dropped, window_off_attention  # noqa: E402
from hf_knorm.models.architectures import attention_modules  # noqa: E402
from hf_knorm.models.window_mix import set_window_mix, window_dropped  # noqa: E402
from hf_knorm.normalizations import parse_normalization  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)  # fp32: the kernels sum in another order than the reference's matmul


def _dropped_reference(query, key, value, allowed, normalization, mix, params=None):
    """The definition, written out: the base family over every allowed key (the reference attention), each row
    scaled to RMS 1 over the head dimension (+ ROW_EPS), times the head's mix. ``(B, q, H_q, D)`` and the weights."""
    part, weights = reference_attention(query, key, value, allowed, normalization.without_window, params=params)
    factor = torch.rsqrt(part.pow(2).mean(dim=-1, keepdim=True) + ROW_EPS) * mix[None, None, :, None]
    return part * factor, weights * factor.permute(0, 2, 1, 3)


def _layer(spelling: str, seed: int = 0):
    """A tiny llama patched with ``spelling``, its first attention module, and a random mix on it."""
    model = tiny_model("llama", seed=seed)
    hf_knorm.patch(model, spelling)
    generator = torch.Generator().manual_seed(seed)
    heads = model.config.num_attention_heads
    set_window_mix(model, [torch.rand(heads, generator=generator) + 0.5 for _ in attention_modules(model)])
    return model, attention_modules(model)[0][1]


def _qkv(module, batch=2, length=13, seed=1):
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads = module.config.num_attention_heads, module.config.num_key_value_heads
    dim = module.head_dim
    make = lambda h: torch.randn(batch, h, length, dim, generator=generator, requires_grad=True)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


SPELLINGS = ["x^3/16 + softmax window 4", "x^3/16 + softmax window 4 + sinks 2", "x/1 + softmax window 3 + sinks 1",
             "relu(x)^3/16 + softmax window 4 + sinks 2 + sparse 2 (key_norm)"]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("mask_form", ["none", "left padding", "explicit"])
def test_a_dropped_window_is_the_base_family_over_every_key_rms_normalized_and_mixed(spelling, mask_form,
                                                                                     monkeypatch):
    """x/1 on the linear kernel where the mask allows it (LINEAR_MIN_QUERIES = 1), the others quadratic; values and
    gradients of every real query against the reference."""
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)
    model, module = _layer(spelling)
    model.train()
    query, key, value = _qkv(module)
    batch, length = query.shape[0], query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    valid = torch.ones(batch, length, dtype=torch.bool)
    if mask_form == "none":
        mask = None
    elif mask_form == "left padding":
        valid[1, :3] = False
        mask = valid.clone()  # the (B, kv) form of the plugin's mask function
    else:
        valid[1, :3] = False
        mask = (causal[None] & valid[:, None, :])[:, None]  # (B, 1, q, kv) bool
    allowed = (causal[None] & valid[:, None, :])[:, None]
    normalization = parse_normalization(spelling)
    mix = module.hf_knorm_window_mix.detach()
    with window_dropped(model), paths.attention_paths() as counted:
        assert window_is_dropped(module)
        output, _ = hf_knorm_attention(module, query, key, value, mask, scaling=module.scaling, is_causal=True)
    linear = spelling.startswith("x/1")  # an explicit causal mask with padding too: its key padding is read off
    assert counted == {"linear" if linear else "quadratic": 1}
    expected, _ = _dropped_reference(query, key, value, allowed, normalization, mix)
    real = valid[:, :, None, None].expand_as(expected)  # padded queries are read by nothing
    torch.testing.assert_close(output[real], expected[real], **TOL)
    with_window, _ = reference_window_attention(query, key, value, allowed, normalization, mix=mix)
    assert not torch.allclose(output[real], with_window[real], atol=1e-3)  # the window is really off
    weight = torch.randn(output[real].shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((output[real] * weight).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected[real] * weight).sum(), (query, key, value))
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL, msg=lambda text: f"d{name}: {text}")


def test_the_weights_and_norms_of_a_dropped_window_are_the_scaled_base_weights():
    model, module = _layer("x^3/16 + softmax window 4 + sinks 2")
    query, key, value = (t.detach() for t in _qkv(module))
    normalization = parse_normalization("x^3/16 + softmax window 4 + sinks 2")
    mix = module.hf_knorm_window_mix.detach()
    frobenius_sq = torch.zeros(query.shape[0], key.shape[1], query.shape[1] // key.shape[1])
    output, weights = window_off_attention(query, key, value, None, normalization, KernelPath(linear=False),
                                           return_weights=True, frobenius_sq=frobenius_sq, mix=mix)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()[None, None]
    expected, expected_weights = _dropped_reference(query, key, value, causal, normalization, mix)
    torch.testing.assert_close(output, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)
    torch.testing.assert_close(frobenius_sq.flatten(1), expected_weights.square().sum(dim=(-2, -1)), **TOL)


def test_the_window_runs_in_evaluation_whatever_the_switch():
    model, module = _layer("x^3/16 + softmax window 4 + sinks 2")
    query, key, value = (t.detach() for t in _qkv(module))
    mask = KeyPadding(torch.ones(2, 13, dtype=torch.bool), 13, causal=True).key_valid
    model.eval()
    plain, _ = hf_knorm_attention(module, query, key, value, mask, scaling=module.scaling, is_causal=True)
    with window_dropped(model):
        assert getattr(module, WINDOW_DROPPED) and not window_is_dropped(module)
        switched, _ = hf_knorm_attention(module, query, key, value, mask, scaling=module.scaling, is_causal=True)
        ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(0))
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(plain, switched)
    assert torch.equal(generated, model.generate(ids, max_new_tokens=4, do_sample=False))
    assert not hasattr(module, WINDOW_DROPPED)  # left as it was


def test_a_whole_model_trains_without_its_window_only_inside_the_switch():
    model, _ = _layer("x^3/16 + softmax window 4 + sinks 2")
    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with window_dropped(model):
            dropped = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
        model.eval()
        with window_dropped(model):
            evaluated = model(input_ids=ids).logits
    assert torch.equal(before, after) and torch.equal(before, evaluated)
    assert not torch.allclose(before, dropped, atol=1e-3)


def test_the_switch_refuses_a_model_without_a_window():
    model = tiny_model("llama")
    hf_knorm.patch(model, "x^3/16")
    with pytest.raises(ValueError, match="softmax_window"):
        with window_dropped(model):
            pass
    with pytest.raises(ValueError, match="has none"):
        q = torch.randn(1, 2, 3, 4)
        window_off_attention(q, q, q, None, parse_normalization("x^3/16"), KernelPath(linear=False))
