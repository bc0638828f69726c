"""Eviction scores beyond the key norm: each against the plain reference, ratio 0, bad names, balanced models."""

from __future__ import annotations

import copy

import pytest
import torch
from knorm_helpers import NEW, PROMPT, greedy, knorm_model
from tiny_models import DECODER_TYPES, tiny_inputs
from transformers import DynamicCache

import hf_knorm
from hf_knorm.evaluation.needle import parse_score_spec, score_variants
from hf_knorm.eviction.cache import KNormCache, KNormLayer, kept_count
from hf_knorm.eviction.reference import reference_generate, reference_kept_indices
from hf_knorm.eviction.scores import SCORES, KeyDiff, KeyNorm, KVDiff, Random, Recent, resolve_score, score_spelling

SCORE_NAMES = tuple(name for name, cls in SCORES.items() if not getattr(cls, "reconstructs", False)
                    and name != "kvzap")  # from states alone; the reconstruction score (kvzip) needs the model and
# the surrogate (kvzap) a fit of one model: each has its own tests (test_knorm_kvzip.py, test_knorm_kvzap.py)
NEW_SCORES = tuple(name for name in SCORE_NAMES if name != "key_norm")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_registry_lists_every_score_once():
    assert SCORE_NAMES == ("key_norm", "value_over_key", "key_diff", "kv_diff", "recent", "random")
    assert tuple(SCORES) == (*SCORE_NAMES, "kvzip", "kvzap")
    for name, cls in SCORES.items():
        assert cls.name == name and cls.__doc__ and ("arXiv" in cls.__doc__ or "kvpress" in cls.__doc__)
    assert isinstance(KNormCache().settings.score, KeyNorm)  # the paper's score stays the default


# --- each score against the plain reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("score", SCORE_NAMES)
@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_kept_positions_match_reference(model_type, score):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    full = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True).cache
    cache = KNormCache(0.5, score=score, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    checked = 0
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, KNormLayer):
            expected = reference_kept_indices(full.layers[index].keys, 0.5, values=full.layers[index].values,
                                              score=score, layer_idx=index)
            assert torch.equal(cache.kept_positions(index), expected), f"layer {index}"
            checked += 1
    assert checked >= (0 if model_type == "mistral" else 1)  # mistral's tiny config: every layer is a sliding window


@pytest.mark.parametrize("score", [KeyDiff(pool=3), KVDiff(pool=1), KVDiff(pool=7)], ids=repr)
def test_pooling_windows_match_reference(score):
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    cache = KNormCache(0.5, score=score, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    for index in range(2):
        expected = reference_kept_indices(full.layers[index].keys, 0.5, values=full.layers[index].values,
                                          score=score, layer_idx=index)
        assert torch.equal(cache.kept_positions(index), expected)
    unpooled = KNormCache(0.5, score=KeyDiff(), config=model.config)
    model(input_ids=ids, cache=unpooled, use_cache=True)
    if isinstance(score, KeyDiff):  # the window changes what is kept
        assert not torch.equal(unpooled.kept_positions(0), cache.kept_positions(0))


@pytest.mark.parametrize("pool", [0, 2, -1, 1.0])
def test_pool_must_be_odd(pool):
    with pytest.raises(ValueError, match="odd integer"):
        KeyDiff(pool=pool)
    with pytest.raises(ValueError, match="odd integer"):
        KVDiff(pool=pool)


@pytest.mark.parametrize("score", NEW_SCORES)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gpt2", "gpt_neox"])
def test_generation_matches_reference(model_type, score):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    out = greedy(model, ids, KNormCache(0.5, score=score, config=model.config))
    tokens, logits, _ = reference_generate(model, ids, 0.5, NEW, score=score)
    assert torch.equal(out.sequences[:, PROMPT:], tokens)
    for step, (a, b) in enumerate(zip(out.logits, logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")


def test_scores_keep_different_tokens():
    """The scores are not aliases of one another: on one prompt every pair keeps a different set somewhere."""
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    kept = {}
    for score in SCORE_NAMES:
        cache = KNormCache(0.5, score=score, config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        kept[score] = torch.cat([cache.kept_positions(i) for i in range(2)], dim=-1)
    for a in SCORE_NAMES:
        for b in SCORE_NAMES:
            assert a == b or not torch.equal(kept[a], kept[b]), (a, b)


def test_recent_with_sinks_is_streaming_llm():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    cache = KNormCache(0.5, score="recent", sink_tokens=4, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    kept = kept_count(PROMPT, 0.5)
    expected = list(range(4)) + list(range(PROMPT - (kept - 4), PROMPT))
    for layer in range(2):
        assert cache.kept_positions(layer).tolist() == [[expected] * 2]


def test_random_is_seeded():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]

    def kept(score):
        cache = KNormCache(0.5, score=score, config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        return torch.cat([cache.kept_positions(i) for i in range(2)], dim=-1)

    assert torch.equal(kept("random"), kept(Random(seed=0)))
    assert torch.equal(kept(Random(seed=5)), kept(Random(seed=5)))
    assert not torch.equal(kept(Random(seed=5)), kept(Random(seed=6)))
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    expected = reference_kept_indices(full.layers[1].keys, 0.5, score="random", layer_idx=1, seed=5)
    cache = KNormCache(0.5, score=Random(seed=5), config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    assert torch.equal(cache.kept_positions(1), expected)


@pytest.mark.parametrize("score", NEW_SCORES)
def test_protections_and_decoding_budget_apply_to_every_score(score):
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    cache = KNormCache(budget=10, sink_tokens=2, recent_window=3, decoding_budget=8, score=score, config=model.config)
    out = greedy(model, ids, cache, new=10)
    assert out.sequences.shape[1] == PROMPT + 10
    assert cache.stored_tokens() == [8, 8]
    positions = cache.kept_positions(1)
    for p in (0, 1, PROMPT + 6, PROMPT + 7, PROMPT + 8):
        assert bool((positions == p).any(-1).all())


# --- ratio 0 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score", SCORE_NAMES)
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])
def test_ratio_zero_is_bit_identical_for_every_score(model_type, score):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    plain = greedy(model, ids, DynamicCache(config=model.config))
    knorm = greedy(model, ids, KNormCache(0.0, score=score, config=model.config))
    assert torch.equal(plain.sequences, knorm.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, knorm.logits))


# --- names ------------------------------------------------------------------------------------------------------------
def test_bad_score_name_lists_the_accepted_ones():
    with pytest.raises(ValueError) as error:
        KNormCache(0.5, score="expected_attention")
    for name in SCORE_NAMES:
        assert name in str(error.value)
    with pytest.raises(ValueError, match="score instance"):
        KNormCache(0.5, score=42)
    with pytest.raises(ValueError, match="key_diff"):
        hf_knorm.eviction.pipeline.knorm_cache_for(knorm_model("llama"), compression_ratio=0.5, score="keydiff")
    assert isinstance(resolve_score(KeyDiff()), KeyDiff) and isinstance(resolve_score("recent"), Recent)


@pytest.mark.parametrize("score", [KeyNorm(), KeyDiff(pool=3), KVDiff(pool=1), KVDiff(), Random(seed=-2), Recent()],
                         ids=repr)
def test_score_spelling_reads_back_as_the_same_score(score):
    assert resolve_score(score_spelling(score)) == score
    assert resolve_score("key_diff+pool3") == KeyDiff(pool=3) and score_spelling(KVDiff(pool=5)) == "kv_diff"
    with pytest.raises(ValueError, match=r"\+poolN"):
        resolve_score("key_diff+window3")
    with pytest.raises(ValueError, match="it has none"):
        resolve_score("recent+pool3")


def test_score_specs_of_the_command_line():
    assert parse_score_spec("key_diff+sinks4+window64") == {"score": "key_diff", "sink_tokens": 4,
                                                            "recent_window": 64}
    assert parse_score_spec("recent+sinks4") == {"score": "recent", "sink_tokens": 4}
    with pytest.raises(ValueError, match="accepted"):
        parse_score_spec("norm")
    with pytest.raises(ValueError, match=r"\+sinksK"):
        parse_score_spec("key_diff+sink4")
    assert parse_score_spec("key_diff+pool5+sinks4") == {"score": KeyDiff(pool=5), "sink_tokens": 4}
    with pytest.raises(ValueError, match="no pooling window"):
        parse_score_spec("recent+pool5")
    with pytest.raises(ValueError, match="odd integer"):
        parse_score_spec("kv_diff+pool4")
    assert parse_score_spec("kv_diff+heads+layers-dispersion") == {"score": "kv_diff", "head_budget": "heads",
                                                                   "layer_budget": "dispersion"}
    assert parse_score_spec("key_norm+layers-skip_first") == {"score": "key_norm", "layer_budget": "skip_first"}
    assert parse_score_spec("kvzip+heads+floor0+layers-global") == {"score": "kvzip", "head_budget": "heads",
                                                                    "head_floor": 0.0, "layer_budget": "global"}
    assert parse_score_spec("kv_diff+heads+floor0.5")["head_floor"] == 0.5
    with pytest.raises(ValueError, match=r"\+layers-dispersion"):
        parse_score_spec("key_norm+layers-uniform")
    variants = score_variants([0, 0.5], ["key_norm", "key_diff+sinks4"])
    assert [v.name for v in variants] == ["r=0", "r=0.5", "r=0.5 key_diff+sinks4"]
    assert variants[0].options == {"compression_ratio": 0.0}
    assert variants[2].options == {"compression_ratio": 0.5, "score": "key_diff", "sink_tokens": 4}


def test_threshold_rows_of_the_command_line():
    """``+thresholdT``: KVzap's threshold pruning, one row whatever the ratios, named ``t=<T> <entry>``, no ratio;
    options a cache refuses are refused when the rows are built (before any model loads)."""
    assert parse_score_spec("kvzap+heads+sinks4+window128+threshold-4.3") == {
        "score": "kvzap", "head_budget": "heads", "sink_tokens": 4, "recent_window": 128, "threshold": -4.3}
    assert parse_score_spec("kvzap+heads+threshold2")["threshold"] == 2.0
    variants = score_variants([0, 0.5, 0.75], ["kv_diff", "kvzap+heads+window128+threshold-4.3"])
    assert [v.name for v in variants] == ["r=0", "r=0.5 kv_diff", "r=0.75 kv_diff", "t=-4.3 kvzap+heads+window128"]
    assert [v.ratio for v in variants] == [0.0, 0.5, 0.75, None]
    assert variants[-1].options == {"score": "kvzap", "head_budget": "heads", "recent_window": 128, "threshold": -4.3}
    with pytest.raises(ValueError, match="score='kvzap'"):
        score_variants([0, 0.5], ["kv_diff+heads+threshold-4"])
    with pytest.raises(ValueError, match="head_budget='heads'"):
        score_variants([0, 0.5], ["kvzap+threshold-4"])
    with pytest.raises(ValueError, match=r"\+thresholdT"):
        parse_score_spec("kvzap+heads+threshold")


# --- balanced models --------------------------------------------------------------------------------------------------
def test_balanced_model_original_basis_keeps_what_the_unbalanced_model_keeps():
    """Per-channel balancing stores ``k / s`` and ``v * t``: scored in the original basis every score keeps exactly the
    unbalanced model's tokens; scored as cached, the scores that read key directions or value norms keep others."""
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    balanced = copy.deepcopy(model)
    calibration = [tiny_inputs("llama", batch=1, length=64, seed=s) for s in range(2)]
    hf_knorm.balance_kv(balanced, None, calibration, mode="channel", alpha=1.0, progress=False, min_tokens=1)
    assert hf_knorm.balancing.balance.value_scales(balanced.config) is not None

    def kept(m, score, basis="cached"):
        cache = hf_knorm.eviction.pipeline.knorm_cache_for(m, score_basis=basis, compression_ratio=0.5, score=score)
        m(input_ids=ids, cache=cache, use_cache=True)
        return [cache.kept_positions(i) for i in range(2)]

    for score in SCORE_NAMES:
        unbalanced = kept(model, score)
        assert all(torch.equal(a, b) for a, b in zip(kept(balanced, score, "original"), unbalanced)), score
        changed = any(not torch.equal(a, b) for a, b in zip(kept(balanced, score, "cached"), unbalanced))
        assert changed == (score in ("key_norm", "value_over_key", "key_diff", "kv_diff")), score


def test_layer_balancing_changes_no_ranking():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    balanced = copy.deepcopy(model)
    calibration = [tiny_inputs("llama", batch=1, length=64, seed=s) for s in range(2)]
    hf_knorm.balance_kv(balanced, None, calibration, mode="layer", progress=False, min_tokens=1)
    for score in SCORE_NAMES:
        caches = [KNormCache(0.5, score=score, config=m.config) for m in (model, balanced)]
        for m, cache in zip((model, balanced), caches):
            m(input_ids=ids, cache=cache, use_cache=True)
        assert all(torch.equal(caches[0].kept_positions(i), caches[1].kept_positions(i)) for i in range(2)), score


def test_value_scales_are_checked():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match="value_scales has 1"):
        KNormCache(0.5, value_scales=[torch.ones(2, 16)], config=model.config)
    with pytest.raises(ValueError, match=r"value_scales\[0\] has shape"):
        model(input_ids=ids, cache=KNormCache(0.5, score="value_over_key", value_scales=[torch.ones(3, 16)] * 2),
              use_cache=True)


# --- the one-call entry points ----------------------------------------------------------------------------------------
def test_knorm_generate_and_pipeline_take_a_score(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    from hf_knorm.assets.texts import SAMPLE_TEXT

    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt")["input_ids"][:, :96]
    out = hf_knorm.eviction.pipeline.knorm_generate(model, ids, compression_ratio=0.5, score="key_diff", max_new_tokens=4,
                                  do_sample=False)
    cache = KNormCache(0.5, score="key_diff", config=model.config)
    plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=4,
                           do_sample=False)
    assert torch.equal(out, plain)
    from transformers import pipeline

    pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(SAMPLE_TEXT, question="How many steps did the keeper climb?", compression_ratio=0.5,
                  score="key_diff", sink_tokens=4, max_new_tokens=4)
    assert isinstance(answer["answer"], str)
    with pytest.raises(ValueError, match="accepted"):
        pipe(SAMPLE_TEXT, question="How many?", compression_ratio=0.5, score="nope", max_new_tokens=2)
