"""Norm statistics recorded inside the attention function."""

import math

import torch
from tiny_models import tiny_inputs, tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm.attention.taps import KVTransform
from hf_knorm.recording.record_norms import routed_through_plugin


def test_key_value_channel_norms_equal_the_cached_states():
    """Per-channel L2 norms over real tokens equal those of the cache's (post-RoPE) keys and values."""
    model = tiny_model("llama")
    inputs = tiny_inputs("llama", length=10)
    inputs["attention_mask"][1, :3] = 0  # 3 padding tokens are excluded
    with torch.no_grad(), hf_knorm.record_norms(model) as recorder:
        cache = model(**inputs, use_cache=True, cache=DynamicCache(config=model.config)).cache
    assert hf_knorm.patched_normalization(model) is None  # temporary patch undone
    real = inputs["attention_mask"].bool()  # (B, N)
    for layer, stats in enumerate(recorder.layers):
        keys = cache.layers[layer].keys.permute(0, 2, 1, 3)[real].flatten(1)  # (tokens, H_kv * D)
        values = cache.layers[layer].values.permute(0, 2, 1, 3)[real].flatten(1)
        torch.testing.assert_close(stats.key_channel_norms().float(), keys.norm(dim=0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats.value_channel_norms().float(), values.norm(dim=0), rtol=1e-5, atol=1e-6)
        assert stats.tokens == int(real.sum())


def test_attention_frobenius_norms_follow_the_normalization():
    """softmax keeps ||A||_F <= sqrt(N); x^3/1 on large scores exceeds it."""
    inputs = tiny_inputs("bert", length=16)
    norms = {}
    for normalization in ("softmax", "x^3/1"):
        model = hf_knorm.patch(tiny_model("bert"), normalization)
        with torch.no_grad(), hf_knorm.record_norms(model, keys_values=False) as recorder:
            model(**inputs)
        norms[normalization] = torch.stack([layer.attention_frobenius() for layer in recorder.layers])
        assert recorder.layers[0].key_sq is None
    assert (norms["softmax"] <= math.sqrt(16) + 1e-4).all()
    assert norms["x^3/1"].max() > math.sqrt(16)


def test_kv_transform_changes_what_attention_reads():
    model = tiny_model("llama")
    inputs = tiny_inputs("llama")
    with torch.no_grad(), routed_through_plugin(model):
        plain = model(**inputs).logits
        with KVTransform(lambda module, key, value: (key, torch.zeros_like(value))):
            zeroed = model(**inputs).logits
        with KVTransform(lambda module, key, value: (key, value)):
            identity = model(**inputs).logits
    assert torch.equal(plain, identity)
    assert not torch.allclose(plain, zeroed)
