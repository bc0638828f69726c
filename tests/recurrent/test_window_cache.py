"""Constant-size decoding of a p = 1 model with a softmax window: the W last keys and values plus the state
(``hf_knorm/recurrent/window_cache.py``), against the K/V cache and the full forward.

Tolerance: fp32 logits within 1e-4 of the full forward's (as tests/models/test_generation.py; logits of size ~10).
"""

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm import RecurrentStateCache, attention_paths
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.recurrent.state import RecurrentStateLayer
from hf_knorm.recurrent.window_cache import WindowStateLayer

GREEDY = dict(do_sample=False, pad_token_id=0, min_new_tokens=8, max_new_tokens=8)
ATOL = 1e-4


def _prompts(batch=2, length=10, pad=3):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = 0
    return ids, mask


@pytest.mark.compat
@pytest.mark.parametrize("window, sinks", [(1, 0), (3, 0), (14, 0), (3, 2), (14, 4)])  # 14: the window fills up
@pytest.mark.parametrize("spelling", ["x/1", "x/16", "x/sqrtN"])                     # while decoding (10 + 8 tokens)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2", "gpt_neox"])
def test_generate_with_the_window_and_the_state_gives_the_kv_caches_tokens(model_type, spelling, window, sinks):
    """Sinks: each sequence's first real keys are kept beside the window (row 1 is left-padded: its sinks are
    positions 3 ..)."""
    model = hf_knorm.patch(tiny_model(model_type), spelling, softmax_window=window, attention_sinks=sinks)
    ids, mask = _prompts()
    with attention_paths() as taken:
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    cache = output_cache(out)
    assert isinstance(cache, RecurrentStateCache)
    assert all(isinstance(layer, WindowStateLayer) and layer.window == window for layer in cache.layers)
    assert dict(taken) == {"linear": 8 * model.config.num_hidden_layers}
    assert cache.get_seq_length() == 10 + 7
    assert all(layer.kept() == min(window, 17) for layer in cache.layers)
    assert all((layer.sinks is None) == (sinks == 0) for layer in cache.layers)
    if sinks:
        assert cache.layers[0].sinks.position.expand(2, -1).tolist() == [list(range(sinks)),
                                                                        list(range(3, 3 + sinks))]
    expected = model.generate(input_ids=ids, attention_mask=mask, **GREEDY, **cache_kwargs(DynamicCache()))
    assert out.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("spelling", ["x/1", "x/sqrtN"])
@pytest.mark.parametrize("sinks", [0, 2, 3])
def test_decoding_in_chunks_and_tokens_equals_the_full_forward(spelling, sinks):
    """A prompt in two chunks (4 then 3 tokens: fewer than the window of 5, then past it), then token by token, on a
    left-padded batch; with sinks, row 1's (3 padded keys first) come from both chunks."""
    model = hf_knorm.patch(tiny_model("llama"), spelling, softmax_window=5, attention_sinks=sinks)
    ids, mask = _prompts(length=16)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        cache = RecurrentStateCache(config=model.config)
        steps, done = [], 0
        for size in (4, 3) + (1,) * 9:
            out = model(input_ids=ids[:, done: done + size], attention_mask=mask[:, : done + size],
                        **cache_kwargs(cache), use_cache=True)
            steps.append(out.logits)
            done += size
            if done == 4:  # row 1 has one real key: its sinks are still searched for in the next chunk
                assert not any(layer.sinks_complete for layer in cache.layers)
    assert all(layer.sinks_complete == bool(sinks) for layer in cache.layers)  # then kept without a search
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], rtol=0, atol=ATOL)


@pytest.mark.compat
def test_the_cache_does_not_grow_with_the_context():
    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4)
    ids, mask = _prompts(batch=1, pad=0)
    sizes = []
    for new_tokens in (4, 40):
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, do_sample=False,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
        sizes.append(output_cache(out).nbytes())
    layers, kv_heads, head_dim, window = 2, 2, 16, 4
    state = kv_heads * head_dim * head_dim * 4 + 4  # fp32 state + count
    kept = 2 * kv_heads * window * head_dim * 4  # fp32 keys and values of the last W tokens
    assert sizes == [layers * (state + kept)] * 2


@pytest.mark.compat
def test_a_state_kept_for_another_window_is_refused():
    ids, mask = _prompts()
    windowed = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=3)
    with pytest.raises(ValueError, match="window of 0 keys"):  # no config: pure states
        windowed.generate(input_ids=ids, attention_mask=mask, **GREEDY, **cache_kwargs(RecurrentStateCache()))
    pure = hf_knorm.patch(tiny_model("llama"), "x/1")
    with pytest.raises(ValueError, match="window of 3 keys"):
        pure.generate(input_ids=ids, attention_mask=mask, **GREEDY,
                      **cache_kwargs(RecurrentStateCache(config=windowed.config)))
    assert isinstance(RecurrentStateCache(config=pure.config).layers[0], RecurrentStateLayer)
    assert not isinstance(RecurrentStateCache(config=pure.config).layers[0], WindowStateLayer)
    with pytest.raises(ValueError, match="W > 0"):
        WindowStateLayer(0, 0)
    with pytest.raises(NotImplementedError, match="assisted"):
        RecurrentStateCache(config=windowed.config).crop(1)


@pytest.mark.compat
def test_a_reloaded_windowed_model_decodes_with_the_window_and_the_state(tmp_path):
    model = hf_knorm.patch(tiny_model("qwen3"), "x/1", softmax_window=3)
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model")
    ids, mask = _prompts()
    out = loaded.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    assert all(isinstance(layer, WindowStateLayer) and layer.window == 3 for layer in output_cache(out).layers)
    assert out.sequences.tolist() == model.generate(input_ids=ids, attention_mask=mask, **GREEDY).tolist()
