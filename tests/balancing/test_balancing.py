"""K/V balancing is an exact reparametrization: same logits and generations, wrong folds caught, bad inputs refused.

Tolerances: tiny models run in fp64, where a correct fold changes logits by ~1e-15 relative; we allow 1e-9 (1e-6 for
gemma3_text, whose RMSNorm computes in fp32 even in an fp64 model). A wrong fold (RoPE pair split, wrong GQA
expansion) changes them by O(0.1): the negative tests require > 1e-3.
"""

import copy
import json

import pytest
import torch
import torch.nn as nn
import transformers as tf
from tiny_models import ALL_TYPES, DECODER_TYPES, tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.assets.texts import shakespeare_split
from hf_knorm.attention.taps import KVTransform
from hf_knorm.balancing.balance import balance_kv, key_scales, value_scales
from hf_knorm.models.architectures import SUPPORTED_ARCHITECTURES
from hf_knorm.models.kv_layouts import expand_to_query_heads, kv_layouts
from hf_knorm.recording.record_norms import routed_through_plugin

ISSUE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")


def _tol(model_type):
    return 1e-6 if model_type == "gemma3_text" else 1e-9


def _calibration(model_type, batches=2):
    return [tiny_inputs(model_type, batch=2, length=24, seed=seed) for seed in range(batches)]


def _out(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _state(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _assert_same_state(model, state):
    for name, p in model.state_dict().items():
        assert torch.equal(p, state[name]) or torch.allclose(p, state[name], equal_nan=True, rtol=0, atol=0), name


def _change(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def test_every_registered_architecture_has_a_layout_and_is_tested_here():
    assert set(ALL_TYPES) == set(SUPPORTED_ARCHITECTURES)
    for model_type in ALL_TYPES:
        assert len(kv_layouts(tiny_model(model_type))) == 2


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["layer", "channel"])
@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_fold_is_exact(model_type, mode):
    model = tiny_model(model_type, dtype=torch.float64)
    inputs = tiny_inputs(model_type, seed=7)
    reference = _out(model, inputs)
    report = balance_kv(model, None, _calibration(model_type), mode=mode, progress=False)
    assert _change(_out(model, inputs), reference) < _tol(model_type)
    assert report.max_logit_change <= report.tolerance
    # the weights really moved (a no-op fold would pass the check above trivially)
    assert not torch.allclose(report.key_scales[0], torch.ones_like(report.key_scales[0]))
    # after balancing, each layer's mean key and value channel norms agree (measured, within 1%)
    assert torch.allclose(report.after.ratios(), torch.ones(len(report.after.keys), dtype=torch.float64), rtol=0.01)


@pytest.mark.parametrize("model_type", [t for t in ISSUE_TYPES if t in DECODER_TYPES])
def test_greedy_generation_unchanged(model_type):
    model = tiny_model(model_type, dtype=torch.float64)
    prompt = tiny_inputs(model_type, batch=1, length=6, seed=3)
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    before = model.generate(**prompt, **settings)
    balance_kv(model, None, _calibration(model_type), mode="channel", alpha=1.0, progress=False)
    assert torch.equal(model.generate(**prompt, **settings), before)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gpt_neox"])
def test_rope_violating_scale_would_change_logits(model_type):
    """Scales equal on the wrong pairs (i, i + 1): the fold is no longer exact, and the test sees it."""
    model = tiny_model(model_type, dtype=torch.float64)
    inputs = tiny_inputs(model_type)
    reference = _out(model, inputs)
    for layout in kv_layouts(model):
        s = torch.ones(layout.num_kv_heads, layout.head_dim, dtype=torch.float64)
        s[:, :2] = 4.0  # equal within the pair (0, 1) (GPT-J pairing), not within (0, R/2) and (1, 1 + R/2)
        layout.fold(s, torch.ones_like(s))
    assert _change(_out(model, inputs), reference) > 1e-3


@pytest.mark.parametrize("model_type", ["phi3", "gpt_neox"])
def test_partial_rotary_pairs_with_half_the_rotary_dim_not_half_the_head(model_type):
    model = tiny_model(model_type, dtype=torch.float64)
    inputs = tiny_inputs(model_type)
    reference = _out(model, inputs)
    for layout in kv_layouts(model):
        assert 0 < layout.rotary_dim < layout.head_dim
        s = torch.ones(layout.num_kv_heads, layout.head_dim, dtype=torch.float64)
        half = layout.head_dim // 2
        s[:, 1], s[:, 1 + half] = 3.0, 3.0  # right for full rotary, wrong for partial rotary
        layout.fold(s, torch.ones_like(s))
    assert _change(_out(model, inputs), reference) > 1e-3


def test_wrong_gqa_expansion_would_change_logits():
    model = tiny_model("llama", dtype=torch.float64)
    inputs = tiny_inputs("llama")
    reference = _out(model, inputs)
    for layout in kv_layouts(model):
        assert layout.groups == 2
        s = torch.tensor([[0.5], [3.0]], dtype=torch.float64).expand(layout.num_kv_heads, layout.head_dim)
        layout.scale_query(s.repeat(layout.groups, 1))  # tiled: query head j gets KV head j % H_kv, not j // groups
        layout.scale_key(1.0 / s)
    assert _change(_out(model, inputs), reference) > 1e-3
    # the right expansion with the same scales is exact
    model = tiny_model("llama", dtype=torch.float64)
    for layout in kv_layouts(model):
        layout.scale_query(expand_to_query_heads(s, layout.groups))
        layout.scale_key(1.0 / s)
    assert _change(_out(model, inputs), reference) < 1e-9


def test_rebalancing_composes_and_key_scales_recover_the_original_basis():
    model = tiny_model("qwen2", dtype=torch.float64)  # GQA and q/k/v biases
    inputs = tiny_inputs("qwen2")
    original = _captured_kv(model, inputs)
    balance_kv(model, None, _calibration("qwen2"), mode="layer", progress=False)
    second = balance_kv(model, None, _calibration("qwen2"), mode="channel", alpha=1.0, progress=False)
    record = model.config.hf_knorm["kv_balancing"]
    assert record["history"] == ["layer", "channel(alpha=1.0)"]
    assert len(second.before.keys) == 2
    balanced = _captured_kv(model, inputs)
    for (k0, v0), (k1, v1), s, t in zip(original, balanced, key_scales(model.config), value_scales(model.config)):
        assert s.shape == (2, 16) and s.dtype == torch.float32
        assert torch.allclose(k1 * s.double()[None, :, None, :], k0, rtol=1e-6, atol=1e-9)
        assert torch.allclose(v1, v0 * t.double()[None, :, None, :], rtol=1e-6, atol=1e-9)
        assert not torch.allclose(k1, k0)


def _captured_kv(model, inputs):
    captured = []

    def capture(module, key, value):
        captured.append((key.clone(), value.clone()))
        return key, value

    with torch.no_grad(), routed_through_plugin(model), KVTransform(capture):
        model(**inputs)
    return captured


@pytest.mark.parametrize("normalization", ["x^3/16", "x/1"])
def test_composes_with_patch_and_keeps_other_config_keys(normalization):
    model = hf_knorm.patch(tiny_model("llama", dtype=torch.float64), normalization)
    inputs = tiny_inputs("llama")
    reference = _out(model, inputs)
    balance_kv(model, None, _calibration("llama"), mode="channel", progress=False)
    assert _change(_out(model, inputs), reference) < 1e-9
    assert model.config.hf_knorm["normalization"] == normalization
    hf_knorm.unpatch(model)
    assert "kv_balancing" in model.config.hf_knorm  # unpatching keeps the balancing record
    hf_knorm.patch(model, normalization)
    assert _change(_out(model, inputs), reference) < 1e-9


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen3")
    inputs = tiny_inputs("qwen3")
    balance_kv(model, None, _calibration("qwen3"), mode="channel", progress=False)
    hf_knorm.save_pretrained(model, tmp_path)
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert torch.equal(_out(loaded, inputs), _out(model, inputs))
    assert all(torch.equal(a, b) for a, b in zip(key_scales(loaded.config), key_scales(model.config)))
    layer = loaded.model.layers[0].self_attn
    assert torch.equal(layer.k_norm.weight, model.model.layers[0].self_attn.k_norm.weight)
    assert not torch.allclose(layer.k_norm.weight, torch.ones_like(layer.k_norm.weight))


def test_unbalanced_model_has_no_scales():
    assert key_scales(tiny_model("llama").config) is None


def test_report_plot_and_json(tmp_path):
    model = tiny_model("llama")
    report = balance_kv(model, None, _calibration("llama"), mode="layer", progress=False)
    assert report.plot(tmp_path / "kv.png").stat().st_size > 0
    assert report.plot_summary(tmp_path / "ratios.png").stat().st_size > 0
    data = json.loads(json.dumps(report.to_dict()))
    assert len(data["layers"]) == 2 and len(data["layers"][0]["before"]["keys"]) == 2 * 16
    with pytest.raises(ValueError, match="layer must be"):
        report.plot(tmp_path / "x.png", layer=5)


@pytest.mark.parametrize(
    "calibration, kwargs, message",
    [
        ([], {}, "empty"),
        (["", ""], {}, "no tokens"),
        ("tiny", {"min_tokens": 32}, "at least 32"),
        ("some text", {"mode": "head"}, "mode must be"),
        ("some text", {"alpha": 0.0}, "alpha"),
    ],
    ids=["empty", "empty-texts", "too-short", "bad-mode", "bad-alpha"],
)
def test_bad_calibration_and_settings_leave_weights_untouched(default_model_and_tokenizer, calibration, kwargs,
                                                              message):
    model, tokenizer = default_model_and_tokenizer
    state = _state(model)
    with pytest.raises(ValueError, match=message):
        balance_kv(model, tokenizer, calibration, progress=False, **kwargs)
    _assert_same_state(model, state)
    assert key_scales(model.config) is None


def test_nan_activations_are_refused():
    model = tiny_model("llama")
    state = _state(model)
    embeds = torch.randn(1, 40, 64)
    embeds[0, 5, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        balance_kv(model, None, [{"inputs_embeds": embeds}], progress=False)
    _assert_same_state(model, state)


def test_training_mode_is_kept_and_dropout_ignored():
    model = tiny_model("llama", dtype=torch.float64)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    assert not torch.equal(_out(model, tiny_inputs("llama")), _out(model, tiny_inputs("llama")))  # dropout is live
    balance_kv(model, None, _calibration("llama"), mode="channel", progress=False)  # dropout would fail the check
    assert model.training


def test_calibration_must_be_a_list():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="must be a list"):
        balance_kv(model, None, (t for t in ["a generator"]), progress=False)


def test_failed_verification_restores_the_weights():
    model = tiny_model("llama")  # fp32: the fold changes logits by ~1e-6, more than a zero tolerance
    state = _state(model)
    with pytest.raises(ValueError, match="weights are restored"):
        balance_kv(model, None, _calibration("llama"), mode="channel", tolerance=0.0, progress=False)
    _assert_same_state(model, state)
    assert key_scales(model.config) is None


def test_unsupported_layouts_are_refused():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.k_proj = nn.Sequential(model.model.layers[1].self_attn.k_proj)
    state = _state(model)
    with pytest.raises(ValueError, match="k_proj is Sequential"):
        balance_kv(model, None, _calibration("llama"), progress=False)
    _assert_same_state(model, state)
    shared = tiny_model("llama")
    shared.model.layers[1].self_attn.q_proj = shared.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="shared between layers"):
        balance_kv(shared, None, _calibration("llama"), progress=False)
    config = tf.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)
    with pytest.raises(ValueError, match="does not support model_type 'opt'"):
        balance_kv(tf.OPTForCausalLM(config), None, _calibration("llama"), progress=False)


@pytest.mark.slow
def test_default_model_balances_exactly(default_model_and_tokenizer):
    base, tokenizer = default_model_and_tokenizer
    model = copy.deepcopy(base)
    texts = shakespeare_split()[0][:1]
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    before = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    report = balance_kv(model, tokenizer, texts, mode="layer", max_tokens=512, progress=False)
    assert report.max_logit_change < 1e-3  # measured ~6e-5 on logits of magnitude ~40 (fp32)
    assert report.before.ratios()[0] > 10  # layer 0 keys dominate values by more than 10x
    assert torch.allclose(report.after.ratios(), torch.ones(30, dtype=torch.float64), rtol=0.01)
    assert torch.equal(model.generate(**prompt, max_new_tokens=8, do_sample=False), before)
    assert tokenizer.decode(before[0, prompt["input_ids"].shape[1]:]).strip().startswith("Paris")


@pytest.mark.slow
def test_cli_kv_norms_writes_figures_and_json(tmp_path, capsys):
    from hf_knorm.cli import main

    assert main(["kv-norms", "--mode", "channel", "--calibration-tokens", "64", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "kv_norms_channel.json").read_text())
    assert data["mode"] == "channel" and data["calibration_tokens"] == 64 and len(data["layers"]) == 30
    assert len(data["layers"][0]["before"]["keys"]) == 3 * 64
    figure = tmp_path / "kv_norms_layer0_channel.png"  # layer 0: the most imbalanced layer of SmolLM2-135M
    assert figure.stat().st_size > 10_000 and (tmp_path / "kv_ratios_channel.png").exists()
    bad_layer = ["kv-norms", "--mode", "layer", "--layer", "99", "--calibration-tokens", "64", "--out", str(tmp_path)]
    assert main(bad_layer) == 2
    assert "--layer 99 is out of range: the model has layers 0..29" in capsys.readouterr().err
