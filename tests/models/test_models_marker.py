"""The persistence gap: a model loaded with plain from_pretrained and saved straight away keeps its normalization.

Compatibility suite: the marker is kept by a workaround (hf_knorm.compat.keep_attn_implementation_on_save) that these
tests catch failing on any supported Transformers version.
"""

import json

import pytest
import torch
import transformers as tf
from tiny_models import tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.attention.registration import names_a_normalization
from hf_knorm.compat import keep_attn_implementation_on_save

pytestmark = pytest.mark.compat

pytestmark = pytest.mark.compat


def _logits(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("model_type, auto", [("llama", tf.AutoModelForCausalLM), ("gemma2", tf.AutoModelForCausalLM),
                                              ("bert", tf.AutoModel)])
def test_plain_load_then_plain_save_before_any_forward_keeps_the_marker(tmp_path, model_type, auto):
    model = hf_knorm.patch(tiny_model(model_type), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path / "a")
    loaded = auto.from_pretrained(tmp_path / "a")  # Transformers' own load: no plugin call on this instance
    assert "attn_implementation" not in loaded.config.__dict__  # the state that used to lose the marker
    loaded.save_pretrained(tmp_path / "b")  # Transformers' own save, no forward pass in between
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["attn_implementation"] == "hf_knorm"
    assert saved["hf_knorm"]["normalization"] == "x^3/16"
    again = auto.from_pretrained(tmp_path / "b").eval()  # still the polynomial, not softmax
    assert again.config._attn_implementation == "hf_knorm"
    inputs = tiny_inputs(model_type)
    assert torch.equal(_logits(again, inputs), _logits(model.eval(), inputs))


def test_a_config_alone_keeps_the_marker(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("qwen2"), "x/16"), tmp_path / "a")
    config = tf.AutoConfig.from_pretrained(tmp_path / "a")
    assert json.loads(config.to_json_string())["attn_implementation"] == "hf_knorm"
    config.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["attn_implementation"] == "hf_knorm"


def test_other_implementations_serialize_as_before(tmp_path):
    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama", attn_implementation=implementation)
        model.save_pretrained(tmp_path / implementation)
        saved = json.loads((tmp_path / implementation / "config.json").read_text())
        assert "attn_implementation" not in saved and "hf_knorm" not in saved
    unpatched = hf_knorm.unpatch(hf_knorm.patch(tiny_model("llama"), "x/16"))
    assert "attn_implementation" not in json.loads(unpatched.config.to_json_string())


def test_a_model_patched_then_switched_to_another_implementation_keeps_the_marker(tmp_path):
    """The marker follows the hf_knorm section, not the implementation the model happens to run at save time."""
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    model.set_attn_implementation("eager")  # e.g. to read attention weights for a while
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attn_implementation"] == "hf_knorm"
    assert tf.AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "hf_knorm"


def test_the_wrap_writes_the_name_for_the_configs_it_accepts(monkeypatch):
    from hf_knorm import compat

    monkeypatch.setattr(compat, "_KEPT_IMPLEMENTATIONS", dict(compat._KEPT_IMPLEMENTATIONS))
    keep_attn_implementation_on_save("my_attention", lambda d: "my_section" in d)
    config = tf.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    assert "attn_implementation" not in config.to_dict()
    config.my_section = {"on": True}
    for serialized in (config.to_dict(), config.to_diff_dict(), json.loads(config.to_json_string())):
        assert serialized["attn_implementation"] == "my_attention"
        assert "_attn_implementation_internal" not in serialized  # Transformers' own removal still runs


def test_a_transformers_without_the_method_gets_a_warning_not_an_import_error(monkeypatch):
    monkeypatch.delattr(tf.PretrainedConfig, "_remove_keys_not_serialized")
    with pytest.warns(UserWarning, match="has no PretrainedConfig._remove_keys_not_serialized.*'hf_knorm'"):
        keep_attn_implementation_on_save("hf_knorm", names_a_normalization)
    assert not hasattr(tf.PretrainedConfig, "_remove_keys_not_serialized")


def test_the_wrap_is_installed_once():
    before = tf.PretrainedConfig._remove_keys_not_serialized
    keep_attn_implementation_on_save("hf_knorm", names_a_normalization)
    keep_attn_implementation_on_save("hf_knorm", names_a_normalization)
    assert tf.PretrainedConfig._remove_keys_not_serialized is before
    assert before.__wrapped__.__qualname__.lower() == "pretrainedconfig._remove_keys_not_serialized"
