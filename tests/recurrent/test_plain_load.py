"""Every way to get a ``p = 1`` model decodes it with its state: plain ``AutoModelForCausalLM.from_pretrained`` (no
hf_knorm call after ``import hf_knorm``), ``from_config`` of a saved config, a deep copy, ``hf_knorm.from_pretrained``
and ``hf_knorm.patch``; the cache ``generate`` used is checked, and the tokens against ``hf_knorm.from_pretrained``'s
and a K/V cache's. The choice lives in ``hf_knorm.compat.choose_default_generation_cache`` (its compatibility test)."""

import copy

import pytest
import torch
import transformers as tf
from tiny_models import tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm import RecurrentStateCache
from hf_knorm.compat import cache_keyword, cache_kwargs, choose_default_generation_cache, output_cache
from hf_knorm.recurrent.state import RecurrentStateLayer
from hf_knorm.recurrent.window_cache import WindowStateLayer

pytestmark = pytest.mark.compat

GREEDY = dict(do_sample=False, pad_token_id=0, min_new_tokens=6, max_new_tokens=6, return_dict_in_generate=True)
LINEAR = ["x/1", "x/16", "x/sqrtN", "x/1 + softmax window 8 + sinks 2"]


def _prompts():
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return dict(input_ids=ids, attention_mask=mask)


def _layer_kind(spelling):
    return WindowStateLayer if "window" in spelling else RecurrentStateLayer


def _decodes_with_the_state(model, spelling, expected_tokens=None):
    out = model.generate(**_prompts(), **GREEDY)
    cache = output_cache(out)
    assert isinstance(cache, RecurrentStateCache), f"generate decoded with a {type(cache).__name__}"
    assert all(type(layer) is _layer_kind(spelling) for layer in cache.layers)
    if expected_tokens is not None:
        assert out.sequences.tolist() == expected_tokens
    return out.sequences.tolist()


@pytest.mark.parametrize("spelling", LINEAR)
def test_a_plain_transformers_load_decodes_with_the_state(tmp_path, spelling):
    model = hf_knorm.patch(tiny_model("llama"), spelling)
    model.save_pretrained(tmp_path)  # Transformers' own save
    tokens = _decodes_with_the_state(hf_knorm.from_pretrained(tmp_path).eval(), spelling)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # and its own load: no hf_knorm call
    _decodes_with_the_state(loaded, spelling, tokens)
    built = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(tmp_path))
    built.load_state_dict(model.state_dict())
    _decodes_with_the_state(built.eval(), spelling, tokens)
    _decodes_with_the_state(copy.deepcopy(loaded), spelling, tokens)
    _decodes_with_the_state(model, spelling, tokens)
    kv_cache = loaded.generate(**_prompts(), **GREEDY, **cache_kwargs(DynamicCache()))  # the quadratic reference
    assert isinstance(output_cache(kv_cache), DynamicCache) and kv_cache.sequences.tolist() == tokens


def test_what_the_call_asks_for_is_kept():
    """A cache of its own, a cache_implementation, no cache, a rewinding call: Transformers' choice; a model that
    is not p = 1 or not patched: a K/V cache."""
    model = hf_knorm.patch(tiny_model("llama"), "x/1")
    own = DynamicCache()
    assert output_cache(model.generate(**_prompts(), **GREEDY, **cache_kwargs(own))) is own
    dynamic = model.generate(**_prompts(), **GREEDY, cache_implementation="dynamic")
    assert type(output_cache(dynamic)) is DynamicCache
    assert model.generate(**_prompts(), **GREEDY, use_cache=False).get(cache_keyword()) is None
    single = {name: tensor[:1] for name, tensor in _prompts().items()}  # prompt lookup takes one sequence
    looked_up = model.generate(**single, **GREEDY, prompt_lookup_num_tokens=2)
    assert type(output_cache(looked_up)) is DynamicCache  # rewound by the lookup: a state cannot be
    assert looked_up.sequences.tolist() == model.generate(**single, **GREEDY).sequences.tolist()
    for other in (hf_knorm.patch(tiny_model("llama"), "x^3/16"), tiny_model("llama"),
                  hf_knorm.unpatch(hf_knorm.patch(tiny_model("llama"), "x/1"))):
        assert type(output_cache(other.generate(**_prompts(), **GREEDY))) is DynamicCache


def test_the_wrap_is_installed_once_and_a_transformers_without_the_method_gets_a_warning(monkeypatch):
    from transformers.generation import GenerationMixin

    from hf_knorm.recurrent.generation import CHOOSER, default_cache

    hf_knorm.patch(tiny_model("llama"), "x/1")  # the first p = 1 model installs the wrap
    before = GenerationMixin._prepare_cache_for_generation
    assert before.__wrapped__.__qualname__ == "GenerationMixin._prepare_cache_for_generation"
    choose_default_generation_cache(CHOOSER, default_cache)
    assert GenerationMixin._prepare_cache_for_generation is before
    monkeypatch.delattr(GenerationMixin, "_prepare_cache_for_generation")
    with pytest.warns(UserWarning, match="no GenerationMixin._prepare_cache_for_generation.*RecurrentStateCache"):
        choose_default_generation_cache(CHOOSER, default_cache)
