"""Saved models keep their normalization, and never come back silently as softmax."""

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf
from tiny_models import tiny_inputs, tiny_model

import hf_knorm

pytestmark = pytest.mark.compat


def _logits(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("normalization", ["softmax", "x/16", "x^3/16", "x^3/sqrtN"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "bert"])
def test_round_trip(tmp_path, model_type, normalization):
    model = hf_knorm.patch(tiny_model(model_type), normalization)
    inputs = tiny_inputs(model_type)
    hf_knorm.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == "hf_knorm"
    assert saved["hf_knorm"]["normalization"] == normalization
    assert saved["hf_knorm"]["version"] == hf_knorm.__version__
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert hf_knorm.patched_normalization(loaded) == normalization
    assert type(loaded) is type(model)
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))


def test_plain_transformers_save_and_load_keep_the_normalization(tmp_path):
    model = hf_knorm.patch(tiny_model("qwen2"), "x^3/16")
    inputs = tiny_inputs("qwen2")
    model.save_pretrained(tmp_path)  # Transformers' own save
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # and its own load
    assert loaded.config._attn_implementation == "hf_knorm"
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))
    # saved again after a plain load: still marked
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attn_implementation"] == "hf_knorm"


def test_hf_knorm_save_marks_a_plainly_loaded_model_even_before_any_forward(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x/1"), tmp_path / "a")
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    hf_knorm.save_pretrained(loaded, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["attn_implementation"] == "hf_knorm"


def test_loading_without_hf_knorm_fails_loudly_instead_of_softmax(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x^3/16"), tmp_path)
    script = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    assert 'attn_implementation="hf_knorm"' in result.stderr


def test_contradicting_attn_implementation_is_refused(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x^3/16"), tmp_path)
    with pytest.raises(ValueError, match=r"saved with normalization x\^3/16.*attn_implementation='sdpa'"):
        hf_knorm.from_pretrained(tmp_path, attn_implementation="sdpa")


def test_unpatched_save_has_no_plugin_marks(tmp_path):
    model = hf_knorm.unpatch(hf_knorm.patch(tiny_model("llama"), "x/16"))
    hf_knorm.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "hf_knorm" not in saved and "attn_implementation" not in saved
    assert tf.AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_corrupt_saved_normalization_is_reported(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x/16"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hf_knorm"]["normalization"] = "x^0/16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="power p must be an integer >= 1"):
        hf_knorm.from_pretrained(tmp_path)


def test_missing_folder_is_reported():
    with pytest.raises(FileNotFoundError, match="'/nonexistent/model' is not 'default', not a folder"):
        hf_knorm.models.persistence.load_model("/nonexistent/model")


def test_hf_knorm_loader_repairs_a_config_that_lost_the_marker(tmp_path):
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["attn_implementation"]  # e.g. re-saved by plain save_pretrained right after a plain load
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "hf_knorm"
    inputs = tiny_inputs("llama")
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))
