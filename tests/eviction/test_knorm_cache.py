"""KNormCache against the plain reference eviction and against a full cache with the evicted keys masked out."""

from __future__ import annotations

import copy

import pytest
import torch
from knorm_helpers import NEW, NO_EOS, PROMPT, greedy, knorm_model
from tiny_models import DECODER_TYPES, tiny_config, tiny_inputs
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import hf_knorm
from hf_knorm.assets.texts import SAMPLE_TEXT
from hf_knorm.attention.masks import explicit_bool_mask
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.eviction.cache import KNormCache, KNormLayer, kept_count
from hf_knorm.eviction.settings import EvictionSettings
from hf_knorm.eviction.pipeline import generate_after, knorm_generate
from hf_knorm.eviction.reference import reference_generate, reference_kept_indices

FULL_ATTENTION_TYPES = ("llama", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# --- a full cache with per-head masking of the evicted prompt tokens (independent of KNormCache) -------------------
KEEP: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv, n) bool over the prompt; later tokens are always visible


def masked_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(groups, 1).transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[..., : key.shape[-2]], float("-inf"))
    keep = KEEP.get(module.layer_idx)
    if keep is not None:
        later = torch.ones(*keep.shape[:2], key.shape[-2] - keep.shape[-1], dtype=torch.bool)
        visible = torch.cat([keep, later], dim=-1).repeat_interleave(groups, 1)[:, :, None, :]
        scores = scores.masked_fill(~visible, float("-inf"))
    out = scores.softmax(-1) @ value.repeat_interleave(groups, 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("knorm_test_masked", masked_eager)
AttentionMaskInterface.register("knorm_test_masked", explicit_bool_mask)


@torch.no_grad()
def masked_logits(model, ids, continuation, keep_fn):
    """Teacher-forced logits of ``continuation`` after the prompt ``ids``, with a full cache where the tokens not kept
    (``keep_fn(layer, keys) -> (B, H_kv, k) positions``) are masked out per head after the prompt's forward."""
    original = model.config._attn_implementation
    model.set_attn_implementation("knorm_test_masked")
    try:
        KEEP.clear()
        out = model(input_ids=ids, cache=DynamicCache(), use_cache=True)
        logits = [out.logits[:, -1]]
        for layer, cached in enumerate(out.cache.layers):
            keep = torch.zeros(cached.keys.shape[:3], dtype=torch.bool)
            KEEP[layer] = keep.scatter_(2, keep_fn(layer, cached.keys), True)
        for step in range(continuation.shape[1] - 1):
            out = model(input_ids=continuation[:, step:step + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1])
        return logits
    finally:
        KEEP.clear()
        model.set_attn_implementation(original)


# --- equivalence -----------------------------------------------------------------------------------------------------
@pytest.mark.compat
@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_kept_indices_match_reference(model_type):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    full = output_cache(model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True))
    cache = KNormCache(0.5, config=model.config)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    checked = 0
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, KNormLayer):
            expected = reference_kept_indices(full.layers[index].keys, 0.5)
            assert torch.equal(cache.kept_positions(index), expected), f"layer {index}"
            assert cache.get_seq_length(index) == PROMPT
            checked += 1
    if model_type in ("mistral",):  # every layer has a sliding window: nothing is compressed
        assert checked == 0 and cache.stored_tokens() == [4, 4]
    else:
        assert checked >= 1


@pytest.mark.compat
@pytest.mark.parametrize("model_type", FULL_ATTENTION_TYPES)
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_generation_matches_reference(model_type, ratio):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    out = greedy(model, ids, KNormCache(ratio, config=model.config))
    tokens, logits, _ = reference_generate(model, ids, ratio, NEW)
    assert torch.equal(out.sequences[:, PROMPT:], tokens)
    for step, (a, b) in enumerate(zip(out.logits, logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("options", [{}, {"sink_tokens": 2, "recent_window": 3}, {"layer_ratios": {0: 0.0}}],
                         ids=["plain", "sinks+window", "layer0-kept"])
def test_generation_equals_masked_full_cache(do_sample, options):
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    question = tiny_inputs("llama", batch=2, length=3, seed=1)["input_ids"]
    cache = KNormCache(0.5, config=model.config, **options)
    model(input_ids=ids, cache=cache, use_cache=True)  # prefill: compressed
    kept = [cache.kept_positions(i).clone() for i in range(len(cache.layers))]
    torch.manual_seed(1)
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=NO_EOS, pad_token_id=0, max_new_tokens=NEW, do_sample=do_sample)
    new = generate_after(model, cache, ids, question, generation_config=config)
    # the masked run: full cache, evicted prompt tokens masked per head, question and answer teacher-forced
    continuation = torch.cat([question, new], dim=1)
    logits = masked_logits(model, ids, continuation, lambda layer, keys: kept[layer])
    knorm = KNormCache(0.5, config=model.config, **options)
    model(input_ids=ids, cache=knorm, use_cache=True)
    for step in range(continuation.shape[1] - 1):
        out = model(input_ids=continuation[:, step:step + 1], cache=knorm, use_cache=True)
        torch.testing.assert_close(out.logits[:, -1], logits[step + 1], atol=1e-4, rtol=1e-4)
    if not do_sample:
        assert torch.equal(torch.stack(logits[question.shape[1]:], 1).argmax(-1), new)
    if "layer_ratios" not in options:  # the question in one multi-token forward: its causal mask must hold
        knorm = KNormCache(0.5, config=model.config, **options)
        model(input_ids=ids, cache=knorm, use_cache=True)
        out = model(input_ids=question, cache=knorm, use_cache=True)
        expected = torch.stack(logits[1:question.shape[1] + 1], dim=1)
        torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.compat
@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_ratio_zero_is_bit_identical(model_type):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    plain = greedy(model, ids, DynamicCache(config=model.config))
    knorm = greedy(model, ids, KNormCache(0.0, config=model.config))
    assert torch.equal(plain.sequences, knorm.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, knorm.logits))


@pytest.mark.parametrize("normalization", ["x^3/16", "x^3/sqrtN", "softmax"])
def test_patched_model_matches_reference(normalization):
    model = hf_knorm.patch(knorm_model("llama"), normalization)
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    out = greedy(model, ids, KNormCache(0.5, config=model.config))
    tokens, logits, _ = reference_generate(model, ids, 0.5, NEW)
    assert torch.equal(out.sequences[:, PROMPT:], tokens)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(logits), atol=1e-4, rtol=1e-4)
    plain = greedy(model, ids, DynamicCache())
    zero = greedy(model, ids, KNormCache(0.0, config=model.config))
    assert torch.equal(plain.sequences, zero.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, zero.logits))


def test_key_scales_score_in_the_given_basis():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    generator = torch.Generator().manual_seed(3)
    scales = [torch.rand(2, 16, generator=generator) * 4 + 0.1 for _ in range(2)]
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    cache = KNormCache(0.5, key_scales=scales, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    for layer in range(2):
        expected = reference_kept_indices(full.layers[layer].keys, 0.5, key_scale=scales[layer])
        assert torch.equal(cache.kept_positions(layer), expected)
    plain = KNormCache(0.5, config=model.config)
    model(input_ids=ids, cache=plain, use_cache=True)
    assert not torch.equal(plain.kept_positions(0), cache.kept_positions(0))  # the basis matters


def test_balanced_model_original_basis_recovers_unbalanced_ranking():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    unbalanced = KNormCache(0.5, config=model.config)
    model(input_ids=ids, cache=unbalanced, use_cache=True)
    balanced = copy.deepcopy(model)
    calibration = [tiny_inputs("llama", batch=1, length=64, seed=s) for s in range(2)]
    hf_knorm.balance_kv(balanced, None, calibration, mode="channel", progress=False, min_tokens=1)
    original = hf_knorm.eviction.pipeline.knorm_cache_for(balanced, score_basis="original", compression_ratio=0.5)
    cached = hf_knorm.eviction.pipeline.knorm_cache_for(balanced, score_basis="cached", compression_ratio=0.5)
    balanced(input_ids=ids, cache=original, use_cache=True)
    balanced(input_ids=ids, cache=cached, use_cache=True)
    for layer in range(2):
        assert torch.equal(original.kept_positions(layer), unbalanced.kept_positions(layer))
    assert any(not torch.equal(cached.kept_positions(i), unbalanced.kept_positions(i)) for i in range(2))


# --- size and memory -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.9])
def test_cache_shrinks_as_configured(ratio):
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    cache = KNormCache(ratio, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    kept = kept_count(PROMPT, ratio)
    assert kept == PROMPT - int(ratio * PROMPT)
    assert cache.stored_tokens() == [kept, kept]
    assert cache.get_seq_length() == PROMPT
    assert cache.nbytes() == 2 * 2 * 2 * 16 * kept * 4 * 2  # K and V x layers x kv_heads x head_dim x tokens x fp32 x B
    model(input_ids=ids[:, :1], cache=cache, use_cache=True)  # a decoded token is appended, with its true position
    assert cache.stored_tokens() == [kept + 1] * 2 and cache.get_seq_length() == PROMPT + 1
    assert int(cache.kept_positions(0)[..., -1].min()) == PROMPT


def test_budget_sinks_window_and_decoding_budget():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    cache = KNormCache(budget=10, sink_tokens=2, recent_window=3, decoding_budget=8, config=model.config)
    out = greedy(model, ids, cache, new=10)
    assert out.sequences.shape[1] == PROMPT + 10
    assert cache.stored_tokens() == [8, 8]
    assert cache.get_seq_length() == PROMPT + 9
    positions = cache.kept_positions(1)
    for p in (0, 1, PROMPT + 6, PROMPT + 7, PROMPT + 8):  # sinks and the last 3 tokens are always kept
        assert bool((positions == p).any(-1).all())
    small = KNormCache(budget=10, config=model.config)
    model(input_ids=ids, cache=small, use_cache=True)
    assert small.stored_tokens() == [10, 10]


def test_layer_ratios_and_multi_token_steps():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    cache = KNormCache(0.5, layer_ratios={0: 0.0}, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    assert cache.stored_tokens() == [PROMPT, PROMPT // 2] and not cache.is_uniform()
    with pytest.raises(ValueError, match="one token per forward"):
        model(input_ids=ids[:, :3], cache=cache, use_cache=True)
    assert cache.stored_tokens() == [PROMPT, PROMPT // 2] and cache.get_seq_length() == PROMPT  # refused untouched


def test_layers_need_nothing_but_their_settings():
    """A KNorm layer is built from the shared settings alone; the cache's multi-token check needs no earlier
    ``get_mask_sizes`` call (no hidden call order)."""
    keys, values = torch.randn(2, 2, PROMPT, 16), torch.randn(2, 2, PROMPT, 16)
    layer = KNormLayer(EvictionSettings(compression_ratio=0.5), layer_idx=0)
    assert [t.shape[-2] for t in layer.update(keys, values)] == [PROMPT, PROMPT]  # the prompt is attended in full
    assert torch.equal(layer.positions, reference_kept_indices(keys, 0.5))
    padded = torch.arange(PROMPT).expand(2, PROMPT) - torch.tensor([[0], [3]])
    with pytest.raises(ValueError, match="padded batch"):
        KNormLayer(EvictionSettings(0.5), 0).update(keys, values, position_ids=padded)
    cache = KNormCache(0.5, layer_ratios={0: 0.0})
    for index in range(2):
        cache.update(keys, values, index)
    with pytest.raises(ValueError, match="one token per forward"):  # update alone, no mask built before
        cache.update(keys[:, :, :2], values[:, :, :2], 1)
    assert cache.stored_tokens() == [PROMPT, PROMPT // 2]


# --- the default model -----------------------------------------------------------------------------------------------
def test_default_model_matches_reference_and_masked_cache(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt")["input_ids"][:, :96]
    cache = KNormCache(0.5, config=model.config)
    out = greedy(model, ids, cache, new=8)
    tokens, logits, kept = reference_generate(model, ids, 0.5, 8)
    assert torch.equal(out.sequences[:, ids.shape[1]:], tokens)
    assert all(torch.equal(cache.kept_positions(i)[..., :48], kept[i]) for i in range(len(kept)))
    masked = masked_logits(model, ids, out.sequences[:, ids.shape[1]:], lambda layer, keys: kept[layer])
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(masked), atol=2e-4, rtol=1e-4)
    zero = greedy(model, ids, KNormCache(0.0, config=model.config), new=8)
    plain = greedy(model, ids, DynamicCache(config=model.config), new=8)
    assert torch.equal(zero.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(zero.logits, plain.logits))


# --- bad inputs ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, "0.5"])
def test_ratio_outside_range(ratio):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        KNormCache(ratio)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, "positive integer"),
    ({"budget": 5, "compression_ratio": 0.5}, "not both"),
    ({"sink_tokens": -1}, "sink_tokens"),
    ({"decoding_budget": 3, "sink_tokens": 2, "recent_window": 2}, "smaller than the protected"),
    ({"layer_ratios": {0: 1.0}}, r"layer_ratios\[0\]"),
    ({"layer_ratios": {5: 0.5}, "config": tiny_config("llama")}, "names layer 5"),
    ({"key_scales": [torch.ones(2, 16)], "config": tiny_config("llama")}, "key_scales has 1"),
    ({"config": tiny_config("bert")}, "encoder"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KNormCache(**kwargs)


def test_budget_larger_than_prompt():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match="larger than the prompt"):
        model(input_ids=ids, cache=KNormCache(budget=PROMPT + 1), use_cache=True)


def test_wrong_key_scale_shape():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match=r"\(H_kv, head_dim\)"):
        model(input_ids=ids, cache=KNormCache(0.5, key_scales=[torch.ones(3, 16)] * 2), use_cache=True)


def test_unsupported_model_and_cache():
    with pytest.raises(ValueError, match="does not support model_type"):
        KNormCache(config=_unknown_config())
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match="builds its own KNormCache"):
        knorm_generate(model, ids, cache=DynamicCache(), compression_ratio=0.5)
    cache = KNormCache(0.5)
    model(input_ids=ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="only the 0 tokens appended since its last eviction"):
        cache.crop(-1)  # into the compressed prompt: not exact (crop that is: tests/eviction/test_knorm_batches.py)
    with pytest.raises(ValueError, match="needs a filled DynamicCache"):
        KNormCache.from_dynamic_cache(cache, compression_ratio=0.5)


def _unknown_config():
    from transformers import FalconConfig

    return FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)


def test_padded_batch_raises():
    """Inside ``generate`` the cache sees the position ids (``hf_knorm.compat.update_position_ids``): a padded batch
    under Transformers' own attention is refused (its mask does not describe the rows' kept sets); this fails loudly
    the day Transformers stops passing them to ``Cache.update``. Not in the compatibility suite: before 5.24
    Transformers calls ``Cache.update`` without them (docs/compatibility.md "Supported Transformers versions";
    knorm_generate and the pipeline then refuse padded batches after the fact). Padded batches that work:
    tests/eviction/test_knorm_batches.py."""
    model = knorm_model("llama")
    inputs = tiny_inputs("llama", batch=2, length=PROMPT)
    inputs["attention_mask"][1, :4] = 0  # left padding in row 1
    with pytest.raises(ValueError, match="padded batch"):
        model.generate(**inputs, cache=KNormCache(0.5, config=model.config), max_new_tokens=2, pad_token_id=0)
