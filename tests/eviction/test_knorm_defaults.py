"""KNorm defaults recorded in the config: validated, used when a call gives none, carried by save and load."""

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from card_values import stated_knorm_defaults
from tiny_models import tiny_inputs, tiny_model
from transformers import AutoModelForCausalLM

import hf_knorm
from hf_knorm.eviction.defaults import set_knorm_defaults
from hf_knorm.eviction.pipeline import knorm_generate
from hf_knorm.eviction.scores import KeyDiff, KVDiff, Random, resolve_score


def test_recorded_defaults_are_what_knorm_cache_for_uses():
    model = tiny_model("llama")
    set_knorm_defaults(model, compression_ratio=0.5, sink_tokens=2, layer_ratios={0: 0.0})
    recorded = hf_knorm.eviction.pipeline.knorm_cache_for(model).settings
    assert (recorded.compression_ratio, recorded.sink_tokens, recorded.layer_ratios) == (0.5, 2, {0: 0.0})
    override = hf_knorm.eviction.pipeline.knorm_cache_for(model, sink_tokens=0).settings
    assert (override.compression_ratio, override.sink_tokens) == (0.5, 0)
    sized = hf_knorm.eviction.pipeline.knorm_cache_for(model, budget=8).settings  # a passed budget replaces the recorded ratios
    assert (sized.budget, sized.compression_ratio, sized.layer_ratios, sized.sink_tokens) == (8, 0.0, {}, 2)


def test_generation_with_recorded_defaults_equals_passing_them():
    model = tiny_model("llama")
    ids = tiny_inputs("llama", batch=1, length=20)["input_ids"]
    explicit = knorm_generate(model, ids, compression_ratio=0.5, sink_tokens=2, max_new_tokens=6, do_sample=False)
    set_knorm_defaults(model, compression_ratio=0.5, sink_tokens=2)
    assert torch.equal(knorm_generate(model, ids, max_new_tokens=6, do_sample=False), explicit)
    plain = knorm_generate(model, ids, compression_ratio=0.0, max_new_tokens=6, do_sample=False)
    assert not torch.equal(plain, explicit)  # the defaults do change what is generated


def test_bad_defaults_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="Unknown KNorm option.*ratio"):
        set_knorm_defaults(model, ratio=0.5)
    with pytest.raises(ValueError, match="compression_ratio"):
        set_knorm_defaults(model, compression_ratio=1.5)
    with pytest.raises(ValueError, match="score_basis"):
        set_knorm_defaults(model, score_basis="query")
    with pytest.raises(ValueError, match="encoder"):
        set_knorm_defaults(tiny_model("bert"), compression_ratio=0.5)
    assert hf_knorm.eviction.defaults.knorm_defaults(model.config) == {}


def test_defaults_travel_with_the_model_and_can_be_removed(tmp_path):
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    set_knorm_defaults(model, compression_ratio=0.25, layer_ratios={0: 0.0, 1: 0.5}, score_basis="original")
    hf_knorm.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hf_knorm"]["knorm"]["layer_ratios"] == {"0": 0.0,
                                                                                                       "1": 0.5}
    loaded = hf_knorm.from_pretrained(tmp_path)
    assert hf_knorm.eviction.defaults.knorm_defaults(loaded.config) == {"compression_ratio": 0.25, "layer_ratios": {0: 0.0, 1: 0.5},
                                                      "score_basis": "original"}
    assert hf_knorm.eviction.pipeline.knorm_cache_for(loaded).settings.layer_ratios == {0: 0.0, 1: 0.5}
    card = (tmp_path / "README.md").read_text()
    recorded = json.loads((tmp_path / "config.json").read_text())["hf_knorm"]["knorm"]
    assert stated_knorm_defaults(card) == {key: str(value) for key, value in recorded.items()}
    assert stated_knorm_defaults(card)["compression_ratio"] == "0.25"
    set_knorm_defaults(loaded)
    assert hf_knorm.eviction.defaults.knorm_defaults(loaded.config) == {}
    assert hf_knorm.patched_normalization(loaded) == "x^3/16"  # the rest of the section stays


def test_recorded_defaults_can_be_ignored():
    model = tiny_model("llama")
    set_knorm_defaults(model, compression_ratio=0.5, sink_tokens=2, score="kv_diff")
    settings = hf_knorm.eviction.pipeline.knorm_cache_for(model, recorded_defaults=False, budget=8).settings
    assert (settings.budget, settings.sink_tokens, settings.score.name) == (8, 0, "key_norm")
    assert hf_knorm.eviction.pipeline.knorm_cache_for(model, budget=8).settings.sink_tokens == 2  # by default they apply


@pytest.mark.parametrize("score, spelling", [(KeyDiff(pool=3), "key_diff+pool3"), (Random(seed=7), "random+seed7"),
                                             (KVDiff(), "kv_diff"), ("recent", "recent")])
def test_a_recorded_score_instance_is_saved_as_text_and_read_back(tmp_path, score, spelling):
    model = tiny_model("llama")
    assert set_knorm_defaults(model, compression_ratio=0.5, score=score)["score"] == spelling
    model.save_pretrained(tmp_path)  # a plain save: JSON would refuse a dataclass
    assert json.loads((tmp_path / "config.json").read_text())["hf_knorm"]["knorm"]["score"] == spelling
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_knorm.eviction.pipeline.knorm_cache_for(loaded).settings.score == resolve_score(score)


def test_a_custom_score_cannot_be_recorded():
    @dataclass(frozen=True)
    class Mine:
        name: ClassVar[str] = "mine"

        def __call__(self, keys, values, positions, layer_idx):
            return -keys.norm(dim=-1)

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="cannot be written as text.*pass it at call time"):
        set_knorm_defaults(model, compression_ratio=0.5, score=Mine())
    assert hf_knorm.eviction.defaults.knorm_defaults(model.config) == {}
    assert hf_knorm.eviction.pipeline.knorm_cache_for(model, score=Mine()).settings.score == Mine()  # usable at call time
