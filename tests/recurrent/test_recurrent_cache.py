"""Constant-size decoding of p = 1 models: generate uses a RecurrentStateCache and gives the K/V cache's tokens (what
a call asks for instead, and every way to load such a model: test_plain_load.py)."""

import copy

import pytest
import torch
from tiny_models import tiny_config, tiny_model
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

import hf_knorm
from hf_knorm import KNormCache, RecurrentStateCache, attention_paths
from hf_knorm.attention.taps import pending_handover, taps_set
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.evaluation.decoding_cost import decoding_cost

FULL_ATTENTION_TYPES = ("llama", "qwen3", "phi3", "gpt2", "gpt_neox")
GREEDY = dict(do_sample=False, pad_token_id=0, min_new_tokens=8, max_new_tokens=8)


def _prompts(batch=2, length=10, pad=3):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = 0
    return ids, mask


@pytest.mark.compat
@pytest.mark.parametrize("spelling", ["x/1", "x/16", "x/sqrtN"])
@pytest.mark.parametrize("model_type", FULL_ATTENTION_TYPES)
def test_generate_decodes_with_the_state_and_gives_the_kv_caches_tokens(model_type, spelling):
    model = hf_knorm.patch(tiny_model(model_type), spelling)
    ids, mask = _prompts()
    with attention_paths() as taken:
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    assert isinstance(output_cache(out), RecurrentStateCache)
    assert dict(taken) == {"linear": 8 * model.config.num_hidden_layers}
    assert output_cache(out).get_seq_length() == 10 + 7  # the last token is never fed back
    expected = model.generate(input_ids=ids, attention_mask=mask, **GREEDY, **cache_kwargs(DynamicCache()))
    assert out.sequences.tolist() == expected.tolist()


@pytest.mark.compat
@pytest.mark.parametrize("window", [0, 3], ids=["state", "state-and-window"])
def test_beam_search_reorders_the_states(window):
    """The states (and, with a softmax window, the kept keys and values) follow the beams."""
    model = hf_knorm.patch(tiny_model("llama"), "x/16", softmax_window=window)
    ids, mask = _prompts()
    options = dict(GREEDY, num_beams=3, num_return_sequences=2)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **options)
    assert isinstance(output_cache(out), RecurrentStateCache)
    expected = model.generate(input_ids=ids, attention_mask=mask, **options, **cache_kwargs(DynamicCache()))
    assert out.sequences.tolist() == expected.tolist()


@pytest.mark.compat
def test_the_state_does_not_grow_with_the_context():
    model = hf_knorm.patch(tiny_model("llama"), "x/1")
    ids, mask = _prompts(batch=1, pad=0)
    sizes = []
    for new_tokens in (4, 40):
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, do_sample=False,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
        cache = output_cache(out)
        assert cache.nbytes() == _held_bytes(cache)
        sizes.append(_held_bytes(cache))
    layers, kv_heads, head_dim = 2, 2, 16
    assert sizes == [layers * (kv_heads * head_dim * head_dim * 4 + 4)] * 2  # fp32 state + count, per layer


def _held_bytes(cache) -> int:
    """Every tensor the cache's layers hold, whatever the attribute (``nbytes()`` counts the state by construction:
    keys or values kept beside it would not show there)."""
    return sum(value.nbytes for layer in cache.layers for value in vars(layer).values()
               if isinstance(value, torch.Tensor))


@pytest.mark.compat
def test_reloaded_models_decode_with_the_state(tmp_path):
    model = hf_knorm.patch(tiny_model("qwen3"), "x/1")
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model")
    ids, mask = _prompts()
    out = loaded.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    assert isinstance(output_cache(out), RecurrentStateCache)
    assert out.sequences.tolist() == model.generate(input_ids=ids, attention_mask=mask, **GREEDY).tolist()


def test_what_a_state_cannot_do_is_refused():
    with pytest.raises(ValueError, match="patched by hf_knorm"):
        RecurrentStateCache(config=tiny_model("llama").config)
    with pytest.raises(ValueError, match="p = 1"):
        RecurrentStateCache(config=hf_knorm.patch(tiny_model("llama"), "x^3/16").config)
    with pytest.raises(ValueError, match="sliding"):
        RecurrentStateCache(config=hf_knorm.patch(tiny_model("mistral"), "x/1").config)
    with pytest.raises(NotImplementedError, match="assisted"):
        RecurrentStateCache(config=hf_knorm.patch(tiny_model("llama"), "x/1").config).crop(1)
    with pytest.raises(ValueError, match="nothing to evict"):
        KNormCache(0.5, config=hf_knorm.patch(tiny_model("llama"), "x/16").config)


@pytest.mark.compat
def test_a_state_cache_on_a_model_that_does_not_read_it_is_an_error():
    model = tiny_model("llama")  # softmax, its own attention
    ids, mask = _prompts()
    with pytest.raises(RuntimeError, match="did not read its recurrent state"):
        model.generate(input_ids=ids, attention_mask=mask, **GREEDY, **cache_kwargs(RecurrentStateCache()))
    cubic = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    with pytest.raises(ValueError, match="linear attention only"):
        cubic.generate(input_ids=ids, attention_mask=mask, **GREEDY, **cache_kwargs(RecurrentStateCache()))


def _patched_llama(layers: int):
    config = tiny_config("llama")
    config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return hf_knorm.patch(AutoModelForCausalLM.from_config(config).eval(), "x/1")


def _last_layer_attends_with(model, implementation: str) -> None:
    """The last layer alone leaves the plugin: its attention module reads a config of its own."""
    attention = hf_knorm.models.architectures.attention_modules(model)[-1][1]
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = implementation


@pytest.mark.compat
@pytest.mark.parametrize("layers", [1, 2])
def test_a_missed_last_layer_is_an_error_at_the_steps_end(layers):
    """The last layer (the only one, in a one-layer model) does not read its state: no later update reveals it
    within the step, so the step's end does (it used to give a wrong output silently)."""
    model = _patched_llama(layers)
    _last_layer_attends_with(model, "sdpa")
    ids, mask = _prompts(batch=1, pad=0)
    with pytest.raises(RuntimeError, match=f"Layer {layers - 1}'s attention did not read its recurrent state"):
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(RecurrentStateCache(config=model.config)))
    assert pending_handover() is None and not taps_set()


@pytest.mark.compat
def test_an_error_between_the_update_and_the_attention_leaves_no_tap_set():
    """The process-wide tap flag (what compiled attention reads) drops back when a forward fails after a layer handed
    its state over and before its attention took it (it stayed set for the rest of the process)."""
    def failing_attention(*args, **kwargs):
        raise ArithmeticError("an attention that fails")

    AttentionInterface.register("hf_knorm_test_failing", failing_attention)
    model = _patched_llama(2)
    _last_layer_attends_with(model, "hf_knorm_test_failing")
    ids, mask = _prompts(batch=1, pad=0)
    assert not taps_set()
    with pytest.raises(ArithmeticError, match="an attention that fails"):
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(RecurrentStateCache(config=model.config)))
    assert pending_handover() is None and not taps_set()
    hf_knorm.unpatch(model)
    assert not any(hook.__name__ == "_check_step_end" for hook in model._forward_hooks.values())


@pytest.mark.compat
def test_decoding_cost_rows(monkeypatch):
    """The cache bytes and the seconds per decoding forward: a clock that advances 0.25 s in each forward of the
    model (and nowhere else) gives exactly 0.25 s per token, the warm-up token and the prefill left out."""
    from hf_knorm.evaluation import decoding_cost as module

    model = tiny_model("llama")
    clock = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    model.register_forward_hook(lambda *args: clock.__setitem__(0, clock[0] + 0.25))
    rows = decoding_cost(model, [16, 64], new_tokens=2)
    assert hf_knorm.patched_normalization(model) is None  # left as it came
    by = {(row["normalization"], row["context"]): row for row in rows}
    assert by[("x/1", 16)]["cache_bytes"] == by[("x/1", 64)]["cache_bytes"]
    assert by[("softmax", 64)]["cache_bytes"] == 4 * by[("softmax", 16)]["cache_bytes"]
    assert [row["seconds_per_token"] for row in rows] == [0.25] * len(rows)
