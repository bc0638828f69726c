"""K/V codecs used to measure what balancing buys: quantizers, shared-scale fp8, joint low-rank PCA."""

import pytest
import torch
from tiny_models import tiny_inputs, tiny_model

from hf_knorm.attention.taps import KVTransform
from hf_knorm.balancing.codecs import JointLowRank, per_token_groups, quantize_groups, shared_absmax_fp8
from hf_knorm.recording.record_norms import routed_through_plugin


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_group_quantizer_levels_error_and_scale_equivariance(bits):
    x = torch.randn(5, 7, 128) * torch.linspace(0.1, 10, 128)
    q = quantize_groups(x, bits, group=64)
    groups, qg = x.reshape(5, 7, 2, 64), q.reshape(5, 7, 2, 64)
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    assert ((qg - groups).abs().amax(-1) <= step / 2 + 1e-5).all()  # at most half a step per group
    for i in range(2):
        assert len(torch.unique(qg[0, 0, i])) <= 2**bits
    assert torch.allclose(quantize_groups(x * 3.7, bits, 64), q * 3.7, rtol=1e-4, atol=1e-4)  # a scalar cannot matter


def test_group_quantizer_refuses_bad_groups():
    with pytest.raises(ValueError, match="groups of 64"):
        quantize_groups(torch.randn(3, 100), 4, 64)
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(torch.randn(3, 64), 0, 64)


def test_per_token_groups_span_heads_and_keep_shapes():
    key, value = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    k, v = per_token_groups(4, group=64)(None, key, value)
    assert k.shape == key.shape and v.shape == value.shape
    # one group = the 4 heads of a token: a head with 100x larger keys coarsens the others
    loud = key.clone()
    loud[:, 0] *= 100
    k_loud, _ = per_token_groups(4, group=64)(None, loud, value)
    assert (k_loud[:, 1:] - key[:, 1:]).abs().mean() > 10 * (k[:, 1:] - key[:, 1:]).abs().mean()


def test_shared_absmax_fp8_loses_the_small_side_unless_balanced():
    torch.manual_seed(0)
    key, value = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    def rel_error(k, v):
        qk, qv = shared_absmax_fp8(None, k, v)
        return ((qv - v).norm() / v.norm()).item()
    assert rel_error(key, value) < 0.05  # balanced: fp8 keeps ~3 significant bits
    assert rel_error(key * 1e3, value) < 0.05  # e4m3 spans 2^-9..448: a K/V ratio of 1e3 still fits
    assert rel_error(key * 1e5, value) > 0.3  # values fall below fp8's smallest subnormal relative to the key scale


def test_joint_low_rank_full_rank_is_exact_and_low_rank_is_not():
    model = tiny_model("llama")
    inputs = tiny_inputs("llama", length=20)
    with torch.no_grad():
        reference = model(**inputs).logits
    codec = JointLowRank.fit(model, [tiny_inputs("llama", length=32, seed=s) for s in range(2)])
    channels = codec.bases[0].shape[0]
    assert channels == 2 * 2 * 16
    results = {}
    for rank in (channels, channels // 4):
        with torch.no_grad(), routed_through_plugin(model), KVTransform(codec.with_rank(rank)):
            results[rank] = model(**inputs).logits
    assert torch.allclose(results[channels], reference, atol=1e-4)
    assert (results[channels // 4] - reference).abs().max() > 1e-2
    with pytest.raises(ValueError, match="rank"):
        codec.with_rank(0)


def test_joint_low_rank_prefers_the_dominant_side():
    """With keys 100x larger than values, the top directions are key directions: the point of balancing."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(100.0)
            layer.self_attn.q_proj.weight.div_(100.0)  # exact: scores unchanged
    codec = JointLowRank.fit(model, [tiny_inputs("llama", length=32)])
    top = codec.bases[0][:, :16]  # (2C, r): the first 32 rows are key channels
    assert top[:32].norm() > 0.99 * top.norm()
