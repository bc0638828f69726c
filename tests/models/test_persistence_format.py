"""The saved-config format is a contract: checkpoints written before the package was reorganized (issue 7) still load.

The configs below are what hf_knorm 0.1.0 wrote before the move into subpackages, key for key. Each test writes such
a checkpoint itself (the weights with Transformers' own ``save_pretrained``, the plugin's keys added to config.json
exactly as the old code wrote them), then loads it with the current code.
"""

import json

import pytest
import torch
from tiny_models import tiny_inputs, tiny_model

import hf_knorm

pytestmark = pytest.mark.compat

PRE_LAYOUT_SECTION = {"normalization": "x^3/16", "original_attn_implementation": "sdpa", "version": "0.1.0"}


def _write_pre_layout_checkpoint(model, path, section):
    model.save_pretrained(path)  # unpatched: no plugin keys yet
    config = json.loads((path / "config.json").read_text())
    assert "hf_knorm" not in config
    config.update(attn_implementation="hf_knorm", hf_knorm=section)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_a_pre_layout_checkpoint_loads_with_its_normalization(tmp_path):
    model = tiny_model("llama")
    _write_pre_layout_checkpoint(model, tmp_path, PRE_LAYOUT_SECTION)
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert hf_knorm.patched_normalization(loaded) == "x^3/16"
    reference = hf_knorm.patch(model, "x^3/16").eval()
    inputs = tiny_inputs("llama")
    assert torch.equal(_logits(loaded, inputs), _logits(reference, inputs))
    hf_knorm.unpatch(loaded)  # the recorded original implementation comes back
    assert loaded.config._attn_implementation == "sdpa"


def test_a_pre_layout_balanced_checkpoint_keeps_its_scales(tmp_path):
    model = tiny_model("llama")
    layers, kv_heads, head_dim = 2, 2, 16
    key_scale = torch.linspace(0.5, 2.0, layers * kv_heads * head_dim).reshape(layers, kv_heads, head_dim)
    section = dict(
        PRE_LAYOUT_SECTION,
        normalization="x/16",
        kv_balancing={
            "alpha": 0.5,
            "convention": "K' = K / key_scale, Q' = Q * key_scale, V' = V * value_scale, o_proj' = o_proj / value_scale",
            "history": ["channel(alpha=0.5)"],
            "key_scale": key_scale.tolist(),
            "mode": "channel",
            "value_scale": (1 / key_scale).tolist(),
            "version": "0.1.0",
        },
    )
    _write_pre_layout_checkpoint(model, tmp_path, section)
    loaded = hf_knorm.from_pretrained(tmp_path)
    assert hf_knorm.patched_normalization(loaded) == "x/16"
    scales = hf_knorm.balancing.balance.key_scales(loaded.config)
    assert len(scales) == layers and scales[0].shape == (kv_heads, head_dim)
    torch.testing.assert_close(torch.stack(scales), key_scale)
    torch.testing.assert_close(torch.stack(hf_knorm.balancing.balance.value_scales(loaded.config)), 1 / key_scale)


def test_a_sparse_cache_saved_under_the_old_default_score_keeps_it(tmp_path):
    """``+ sparse K`` without a score meant ``key_norm`` until the default became ``prefix_kv_diff``. A model saved then
    spelled its score in the name and the record (patch writes the canonical name): it loads as ``key_norm``, with
    its logits; a record without the score field reads as ``key_norm`` too, what it meant when written."""
    spelled = "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm)"
    model = hf_knorm.patch(tiny_model("llama"), spelled).eval()
    hf_knorm.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    section = config["hf_knorm"]
    assert section["normalization"] == spelled and section["normalization_record"]["score"] == "key_norm"
    del section["normalization_record"]["score"]
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert hf_knorm.patched_normalization(loaded) == spelled
    assert hf_knorm.parse_normalization(spelled.replace(" (key_norm)", "")).score == "prefix_kv_diff"  # today's default
    inputs = tiny_inputs("llama", length=16)
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))
