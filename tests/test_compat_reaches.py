"""Every reach of hf_knorm into Transformers beyond a model it patched (docs/compatibility.md, "What importing hf_knorm
changes"): a plain model is built, generates and saves byte-identically with and without ``import hf_knorm``; what
import installs and what the first call that needs it installs; each installed once, a second function refused; the
``generate`` wrap reads ``generation_mode`` wherever ``generate`` passes it.

The plain half runs in a fresh process that never imports hf_knorm; the other half here, after other models met the
plugin (a patched ``x/1`` model, a model built from a config with learned values, a head-budget KNorm cache), so
that every lazy reach has been installed when the plain model is built.
"""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as tf
from tiny_models import tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

import hf_knorm
from hf_knorm import compat
from hf_knorm.attention.registration import names_a_normalization
from hf_knorm.eviction import ragged
from hf_knorm.eviction.cache import KNormCache
from hf_knorm.eviction.pipeline import KNormTextGenerationPipeline, register_pipeline
from hf_knorm.recurrent.generation import CHOOSER, default_cache

pytestmark = pytest.mark.compat

PLAIN_RUN = textwrap.dedent('''
    import json
    from pathlib import Path

    import torch
    import transformers as tf


    def plain_run(out):
        """A tiny llama from its config (seed 0), greedy generate on a left-padded batch, save_pretrained; one thread
        so that both halves sum in the same order."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(0)
            config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
            model = tf.AutoModelForCausalLM.from_config(config).eval()
            ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                                       min_new_tokens=8, pad_token_id=0)
            model.save_pretrained(out / "saved")
            torch.save({name: tensor.clone() for name, tensor in model.state_dict().items()}, out / "state.pt")
            (out / "ids.json").write_text(json.dumps(generated.tolist()))
        finally:
            torch.set_num_threads(threads)
''')
SAVED_FILES = ("config.json", "generation_config.json", "model.safetensors")


def _run_in_a_fresh_process(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _meet_the_plugin(tmp_path):
    """Other models meet the plugin, so that every lazy reach is installed."""
    hf_knorm.patch(tiny_model("llama"), "x/1")  # the generate wrap
    learned = hf_knorm.patch(tiny_model("llama"), "sigmoid(bias=learned)")
    learned.save_pretrained(tmp_path / "learned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "learned")  # the build hook adds and loads values
    KNormCache(0.5, head_budget="heads", config=tiny_model("llama").config)  # "knorm_ragged"


def test_a_plain_model_is_byte_identical_with_and_without_hf_knorm(tmp_path):
    without, with_plugin = tmp_path / "without", tmp_path / "with"
    without.mkdir(), with_plugin.mkdir()
    _run_in_a_fresh_process(PLAIN_RUN + textwrap.dedent(f'''
        import sys
        plain_run(Path({str(without)!r}))
        assert "hf_knorm" not in sys.modules and not hasattr(tf.PreTrainedModel.post_init, "__wrapped__")
    '''))
    _meet_the_plugin(tmp_path)
    assert hasattr(GenerationMixin._prepare_cache_for_generation, "__wrapped__")
    assert "knorm_ragged" in AttentionInterface._global_mapping
    namespace = {}
    exec(PLAIN_RUN, namespace)
    namespace["plain_run"](with_plugin)

    assert json.loads((with_plugin / "ids.json").read_text()) == json.loads((without / "ids.json").read_text())
    ours, theirs = (torch.load(folder / "state.pt") for folder in (with_plugin, without))
    assert list(ours) == list(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert sorted(p.name for p in (with_plugin / "saved").iterdir()) == sorted(SAVED_FILES)
    assert sorted(p.name for p in (without / "saved").iterdir()) == sorted(SAVED_FILES)
    for name in SAVED_FILES:
        assert (with_plugin / "saved" / name).read_bytes() == (without / "saved" / name).read_bytes(), name


def test_import_installs_only_what_cannot_wait_and_the_first_call_installs_the_rest(tmp_path):
    """In a fresh process: ``import hf_knorm`` wraps the build and serialization methods and registers the names a
    plain load needs; a plain load of an ``x/1`` checkpoint installs the ``generate`` wrap (and decodes with the
    state), the first head-budget cache registers ``"knorm_ragged"``."""
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x/1"), tmp_path / "linear")
    state = _run_in_a_fresh_process(textwrap.dedent(f'''
        import json
        import torch
        import transformers as tf
        from transformers import AttentionInterface
        from transformers.generation import GenerationMixin
        from transformers.pipelines import PIPELINE_REGISTRY

        def wrapped(method, marker):  # the marker hf_knorm.compat sets on its own wraps (Transformers wraps some
            return bool(getattr(method, marker, False))  # of these methods itself: __wrapped__ says nothing)

        def state():
            return dict(post_init=wrapped(tf.PreTrainedModel.post_init, "_hf_knorm_adds_parameters"),
                        init_weights=wrapped(tf.PreTrainedModel._init_weights, "_hf_knorm_adds_parameters"),
                        serialize=wrapped(tf.PretrainedConfig._remove_keys_not_serialized,
                                          "__hf_knorm_keeps_attn_implementation__"),
                        generate=wrapped(GenerationMixin._prepare_cache_for_generation,
                                         "__hf_knorm_chooses_the_default_cache__"),
                        hf_knorm="hf_knorm" in AttentionInterface._global_mapping,
                        ragged="knorm_ragged" in AttentionInterface._global_mapping,
                        pipeline="knorm-text-generation" in PIPELINE_REGISTRY.supported_tasks)

        states = [state()]
        import hf_knorm
        from hf_knorm.eviction.cache import KNormCache
        states.append(state())
        model = tf.AutoModelForCausalLM.from_pretrained({str(tmp_path / "linear")!r})
        states.append(state())
        out = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        cache = out.get("cache", out.get("past_key_values"))
        KNormCache(0.5, head_budget="heads", config=tf.LlamaConfig(num_hidden_layers=1))
        states.append(state())
        print(json.dumps(dict(states=states, cache=type(cache).__name__)))
    '''))
    from hf_knorm import compat  # the markers the fresh process reads, by name (it checks before importing hf_knorm)

    assert (compat._BUILDS, compat._WRAPPED, compat._CHOOSES) == (
        "_hf_knorm_adds_parameters", "__hf_knorm_keeps_attn_implementation__", "__hf_knorm_chooses_the_default_cache__")
    result = json.loads(state.strip().splitlines()[-1])
    before, imported, loaded, cached = result["states"]
    assert not any(before.values())
    assert imported == dict(post_init=True, init_weights=True, serialize=True, generate=False, hf_knorm=True,
                            ragged=False, pipeline=True)
    assert loaded == dict(imported, generate=True)
    assert cached == dict(loaded, ragged=True)
    assert result["cache"] == "RecurrentStateCache"


def _call_arguments(model, mode):
    """The arguments of ``_prepare_cache_for_generation`` by name, for the installed Transformers' signature."""
    generation_config = copy.deepcopy(model.generation_config)
    known = dict(generation_config=generation_config, model_kwargs={}, generation_mode=mode, batch_size=1,
                 max_cache_length=16, assistant_model=None, device=torch.device("cpu"))
    names = [name for name in inspect.signature(GenerationMixin._prepare_cache_for_generation.__wrapped__).parameters
             if name != "self"]
    missing = [name for name in names if name not in known]
    assert not missing, f"_prepare_cache_for_generation takes arguments this test does not know: {missing}"
    return {name: known[name] for name in names}


@pytest.mark.parametrize("passing", ["positional", "keyword"])
def test_the_generate_wrap_reads_the_generation_mode_by_position_and_by_keyword(passing):
    """A greedy call gets the state cache, an assisted one (which rewinds its cache) keeps the DynamicCache, however
    the mode is passed."""
    model = hf_knorm.patch(tiny_model("llama"), "x/1")
    for mode, expected in ((GenerationMode.GREEDY_SEARCH, hf_knorm.RecurrentStateCache),
                           (GenerationMode.ASSISTED_GENERATION, DynamicCache)):
        arguments = _call_arguments(model, mode)
        if passing == "positional":
            model._prepare_cache_for_generation(*arguments.values())
        else:
            model._prepare_cache_for_generation(**arguments)
        assert type(arguments["model_kwargs"][compat.cache_keyword()]) is expected, mode


def test_the_generate_wrap_is_installed_once_and_refuses_a_second_chooser():
    hf_knorm.patch(tiny_model("llama"), "x/1")
    before = GenerationMixin._prepare_cache_for_generation
    compat.choose_default_generation_cache(CHOOSER, default_cache)
    assert GenerationMixin._prepare_cache_for_generation is before
    with pytest.raises(ValueError, match="'hf_knorm_recurrent_state' is already registered with .*default_cache"):
        compat.choose_default_generation_cache(CHOOSER, lambda model, rewinds: None)
    assert compat._CACHE_CHOOSERS[CHOOSER] is default_cache


def test_the_serialization_wrap_refuses_a_second_rule_for_its_name():
    before = tf.PretrainedConfig._remove_keys_not_serialized
    compat.keep_attn_implementation_on_save("hf_knorm", names_a_normalization)
    assert tf.PretrainedConfig._remove_keys_not_serialized is before
    with pytest.raises(ValueError, match="'hf_knorm' is already registered with .*names_a_normalization"):
        compat.keep_attn_implementation_on_save("hf_knorm", lambda d: True)
    assert compat._KEPT_IMPLEMENTATIONS["hf_knorm"] is names_a_normalization


def test_the_ragged_attention_is_registered_once_and_refuses_another_function(monkeypatch):
    ragged.register()
    ragged.register()
    assert AttentionInterface._global_mapping["knorm_ragged"] is ragged.ragged_attention
    monkeypatch.setitem(AttentionInterface._global_mapping, "knorm_ragged", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="already holds another 'knorm_ragged' function"):
        ragged.register()


def test_the_pipeline_task_is_registered_once_and_refuses_another_class(monkeypatch):
    from transformers.pipelines import PIPELINE_REGISTRY

    held = PIPELINE_REGISTRY.supported_tasks["knorm-text-generation"]
    register_pipeline()
    assert PIPELINE_REGISTRY.supported_tasks["knorm-text-generation"] is held
    assert held["impl"] is KNormTextGenerationPipeline
    monkeypatch.setitem(PIPELINE_REGISTRY.supported_tasks, "knorm-text-generation", dict(held, impl=object))
    with pytest.raises(ValueError, match="already registered with <class 'object'>"):
        register_pipeline()


def test_the_hf_knorm_attention_is_registered_at_import_once():
    """Registering again (what a second ``import`` of the registration would do) keeps the same functions."""
    from transformers.masking_utils import AttentionMaskInterface

    from hf_knorm.attention import registration
    from hf_knorm.attention.interface import hf_knorm_attention
    from hf_knorm.attention.masks import hf_knorm_mask

    serialize = tf.PretrainedConfig._remove_keys_not_serialized
    registration.register()
    assert AttentionInterface._global_mapping["hf_knorm"] is hf_knorm_attention
    assert AttentionMaskInterface._global_mapping["hf_knorm"] is hf_knorm_mask
    assert tf.PretrainedConfig._remove_keys_not_serialized is serialize
