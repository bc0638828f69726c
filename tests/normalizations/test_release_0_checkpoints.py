"""Checkpoints written by the release before the normalization families (commit c14563d, hf_knorm 0.1.0: the
spelling alone in the config, a window mix as JSON floats in ``config.hf_knorm["window_mix"]``) load with this
release to the logits that release computed, bit for bit, and the mix moves into the parameters.

The checkpoints and logits in ``data/release_0_checkpoints/`` were written by that release:
``data/make_release_0_checkpoints.py`` (its docstring says how to run it again).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file

import hf_knorm
from hf_knorm.models.window_mix import window_mixes
from hf_knorm.normalizations import parse_normalization

DATA = Path(__file__).parent / "data" / "release_0_checkpoints"
MIX = [[0.25, -0.5, 1.5, 0.0], [2.0, 0.75, -1.25, 0.5]]  # what make_release_0_checkpoints.py set
SPELLINGS = {"windowed": "x^3/16 + softmax window 4 + sinks 1", "plain": "x^3/16"}


@pytest.fixture(scope="module")
def saved() -> dict[str, torch.Tensor]:
    return load_file(str(DATA / "logits.safetensors"))


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_the_checkpoints_are_the_old_releases():
    for name, spelling in SPELLINGS.items():
        section = json.loads((DATA / name / "config.json").read_text())["hf_knorm"]
        assert section["normalization"] == spelling and section["version"] == "0.1.0"
        assert "format" not in section and "normalization_record" not in section  # format 1
        assert ("window_mix" in section) == (name == "windowed")
        with safe_open(str(DATA / name / "model.safetensors"), framework="pt") as weights:
            assert not [key for key in weights.keys() if "hf_knorm" in key]  # no learnable values then


@pytest.mark.parametrize("name", SPELLINGS)
def test_an_old_checkpoint_loads_to_the_logits_the_old_release_computed(name, saved, tmp_path):
    loaded = hf_knorm.from_pretrained(DATA / name).eval()
    assert hf_knorm.patched_normalization(loaded) == SPELLINGS[name]
    assert torch.equal(_logits(loaded, saved["input_ids"]), saved[name])
    section = loaded.config.hf_knorm  # upgraded: the typed record, no config-held mix
    assert section["format"] == 2 and "window_mix" not in section
    assert section["normalization_record"] == parse_normalization(SPELLINGS[name]).to_record()
    if name == "windowed":  # the mix is in the parameters, as the old release set it
        assert window_mixes(loaded) == MIX
        assert [layer.self_attn.hf_knorm_window_mix.tolist() for layer in loaded.model.layers] == MIX
        assert not torch.equal(_without_mix(loaded, saved["input_ids"]), saved[name])  # the mix is used
    else:
        assert not [n for n, _ in loaded.named_parameters() if "hf_knorm" in n]

    # saved again by this release (format 2, the mix in the weights), it loads to the same logits
    hf_knorm.save_pretrained(loaded, tmp_path)
    again = hf_knorm.from_pretrained(tmp_path).eval()
    assert torch.equal(_logits(again, saved["input_ids"]), saved[name])
    resaved = json.loads((tmp_path / "config.json").read_text())["hf_knorm"]
    assert resaved["format"] == 2 and "window_mix" not in resaved


def _without_mix(model, input_ids):
    """The logits with every mix at 1 (what the model would compute had the saved mix been lost)."""
    from hf_knorm.models.window_mix import set_window_mix

    kept = window_mixes(model)
    set_window_mix(model, None)
    try:
        return _logits(model, input_ids)
    finally:
        set_window_mix(model, kept)


def test_a_plain_transformers_load_of_an_old_checkpoint_keeps_its_normalization(saved):
    plain = tf.AutoModelForCausalLM.from_pretrained(DATA / "plain").eval()
    assert plain.config._attn_implementation == "hf_knorm"
    assert torch.equal(_logits(plain, saved["input_ids"]), saved["plain"])


def test_a_plain_transformers_load_of_an_old_windowed_checkpoint_runs_with_its_mix(saved):
    plain = tf.AutoModelForCausalLM.from_pretrained(DATA / "windowed").eval()
    assert torch.equal(_logits(plain, saved["input_ids"]), saved["windowed"])
