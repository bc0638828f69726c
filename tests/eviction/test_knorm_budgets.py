"""Head- and layer-adaptive budgets of KNormCache and its packed per-head store: the uniform budget given back exactly,
the fast selection against a plain-loop reference, attention against a full cache with the evicted keys masked out,
the bytes held, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from knorm_helpers import NEW, PROMPT, greedy, kept_lists, knorm_model
from test_knorm_cache import masked_logits
from tiny_models import tiny_config, tiny_inputs
from transformers import AutoModelForCausalLM

from hf_knorm.eviction.budgets import allocate, head_adaptive_keep, layer_keep_counts
from hf_knorm.eviction.cache import KNormCache, kept_count
from hf_knorm.eviction import ragged
from hf_knorm.eviction.ragged import RAGGED_ATTENTION, RaggedKNormLayer, RaggedViews
from hf_knorm.eviction.reference import reference_head_adaptive_kept

SCORES = ("key_norm", "kv_diff", "key_diff", "value_over_key", "recent")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True)
def _ragged_attention_registered():
    """These tests select "knorm_ragged" before building a head-budget cache (the call that registers it for users;
    its laziness is tested in tests/test_compat_reaches.py)."""
    ragged.register()


def ragged_model(model_type="llama", layers=None):
    model = knorm_model(model_type)
    if layers is not None:
        config = copy.deepcopy(model.config)
        config.num_hidden_layers, config.layer_types = layers, None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(RAGGED_ATTENTION)
    return model


# --- exactness: every head's budget equal gives today's uniform cache ------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("score", ["key_norm", "kv_diff"])
def test_equal_budgets_equal_uniform_cache(model_type, score):
    model = knorm_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    uniform = greedy(model, ids, KNormCache(0.5, score=score, config=model.config))
    model.set_attn_implementation(RAGGED_ATTENTION)
    cache = KNormCache(0.5, score=score, head_budget="heads", head_floor=1.0, config=model.config)
    ragged = greedy(model, ids, cache)
    assert isinstance(cache.layers[0], RaggedKNormLayer)
    assert torch.equal(uniform.sequences, ragged.sequences)
    assert all(torch.equal(a, b) for a, b in zip(uniform.logits, ragged.logits))


def test_equal_budgets_under_beam_search():
    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    options = dict(max_new_tokens=NEW, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=10**6)
    uniform = model.generate(input_ids=ids, cache=KNormCache(0.5, config=model.config), **options)
    model.set_attn_implementation(RAGGED_ATTENTION)
    cache = KNormCache(0.5, head_budget="heads", head_floor=1.0, config=model.config)
    assert torch.equal(uniform, model.generate(input_ids=ids, cache=cache, **options))
    adaptive = model.generate(input_ids=ids, cache=KNormCache(0.5, head_budget="heads", config=model.config),
                              **options)
    assert adaptive.shape == uniform.shape


@pytest.mark.parametrize("floor", [1.0, 0.2])
def test_free_room_changes_nothing_under_beam_search(floor, monkeypatch):
    """Beam search reorders the store every step; with free room after each slice (rebuilt when used up) the tokens
    are those of the exact-fit store, and with equal budgets those of the uniform cache."""
    model = ragged_model()
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    options = dict(max_new_tokens=NEW, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=10**6,
                   output_logits=True, return_dict_in_generate=True)
    runs = []
    for slack in (0.02, 0.25):
        monkeypatch.setattr(ragged, "CAPACITY_SLACK", slack)
        cache = KNormCache(0.5, head_budget="heads", head_floor=floor, config=model.config)
        runs.append(model.generate(input_ids=ids, cache=cache, **options))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))
    if floor == 1.0:
        model.set_attn_implementation("sdpa")
        uniform = model.generate(input_ids=ids, cache=KNormCache(0.5, config=model.config), **options)
        assert all(torch.equal(a, b) for a, b in zip(uniform.logits, runs[1].logits))


def test_decoding_step_returns_views_not_a_padded_copy():
    keys = torch.randn(2, 3, PROMPT, 16) * torch.tensor([0.5, 1.0, 3.0])[None, :, None, None]
    cache = KNormCache(0.5, head_budget="heads", config=tiny_config("llama"))
    cache.update(keys, torch.randn_like(keys), 0)
    layer = cache.layers[0]
    assert len(set(layer.lengths.flatten().tolist())) > 1
    key, value = layer.update(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    assert key.shape == (2, 3, 1, 16) and isinstance(key.knorm_ragged, RaggedViews)
    views = key.knorm_ragged
    assert views.keys.data_ptr() == layer.keys.data_ptr()  # the store itself, no copy
    assert [length for _, length in views.spans] == layer.lengths.flatten().tolist()
    equal = KNormCache(0.5, head_budget="heads", head_floor=1.0, config=tiny_config("llama"))
    equal.update(keys, torch.randn_like(keys), 0)
    key, _ = equal.layers[0].update(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    assert key.shape == (2, 3, kept_count(PROMPT, 0.5) + 1, 16) and not hasattr(key, "knorm_ragged")
    assert key.data_ptr() == equal.layers[0].keys.data_ptr()  # a strided view of the store


def test_row_operations_move_each_rows_slices(monkeypatch):
    """reorder_cache, batch_repeat_interleave and batch_select_indices on a store with free room (one token decoded
    into it) give the rows' per-head contents in the new order, and decoding goes on into the rebuilt store."""
    monkeypatch.setattr(ragged, "CAPACITY_SLACK", 0.25)
    keys = torch.randn(2, 3, PROMPT, 16) * torch.tensor([0.5, 1.0, 3.0])[None, :, None, None]
    cache = KNormCache(0.5, head_budget="heads", config=tiny_config("llama"))
    cache.update(keys, torch.randn_like(keys), 0)
    layer = cache.layers[0]
    layer.update(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    assert layer.capacity() > int(layer.lengths.sum())  # free room after the slices
    before = layer.padded()
    for operation, rows in [(lambda: layer.reorder_cache(torch.tensor([1, 0])), [1, 0]),
                            (lambda: layer.batch_repeat_interleave(2), [1, 1, 0, 0]),
                            (lambda: layer.batch_select_indices(torch.tensor([1, 2])), [1, 0])]:
        operation()
        after = layer.padded()
        for got, want in zip(after, before):
            assert torch.equal(got, want[rows])
    key, _ = layer.update(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    assert layer.lengths.tolist() == (before[3].sum(-1)[[1, 0]] + 1).tolist()
    assert all(length == count for (_, length), count in zip(key.knorm_ragged.spans, layer.lengths.flatten().tolist()))


# --- the selection against the plain reference -----------------------------------------------------------------------
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("ratio, floor, sinks, window", [(0.5, 0.2, 0, 0), (0.75, 0.0, 2, 3), (0.25, 0.5, 1, 0)])
def test_selection_matches_reference(score, ratio, floor, sinks, window):
    keys = torch.randn(2, 3, PROMPT, 16) * torch.tensor([0.5, 1.0, 3.0])[None, :, None, None]  # heads on own scales
    values = torch.randn(2, 3, PROMPT, 16)
    cache = KNormCache(ratio, score=score, head_budget="heads", head_floor=floor, sink_tokens=sinks,
                       recent_window=window, config=tiny_config("llama"))
    cache.update(keys, values, 0)
    expected = reference_head_adaptive_kept(keys, ratio, floor, values=values, score=score, sink_tokens=sinks,
                                            recent_window=window)
    assert kept_lists(cache, 0) == expected
    keep = kept_count(PROMPT, ratio)
    assert cache.stored_per_head(0).sum(-1).tolist() == [3 * max(keep, sinks + window)] * 2


def test_budgets_move_between_heads_and_respect_the_floor():
    """A head whose scores single out a few tokens gives up budget to a flat head; each keeps at least the floor."""
    order = torch.cat([torch.linspace(0, 1, 20)[None], torch.cat([torch.zeros(3), torch.ones(17)])[None]])[None]
    kept = head_adaptive_keep(order, keep=10, head_floor=0.2)
    assert kept.sum().item() == 20
    counts = kept.sum(-1)[0].tolist()
    assert counts[0] > counts[1] >= 2 and sum(counts) == 20
    assert kept[0, 1, :3].all()  # head 1's three singled-out tokens are kept
    uniform = head_adaptive_keep(order, keep=10, head_floor=1.0)
    assert uniform.sum(-1).tolist() == [[10, 10]]


# --- attention over per-head counts: a full cache with the evicted keys masked per head -----------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("layer_budget", ["uniform", "dispersion"])
@pytest.mark.parametrize("slack", [0.02, 0.25], ids=["room0", "room3"])
def test_adaptive_generation_equals_masked_full_cache(model_type, layer_budget, slack, monkeypatch):
    """Decoding attends each head's slice of the store; with room 3 per head (~12 kept) the store is also rebuilt
    once during the 6 steps."""
    monkeypatch.setattr(ragged, "CAPACITY_SLACK", slack)
    model = ragged_model(model_type)
    ids = tiny_inputs(model_type, batch=2, length=PROMPT)["input_ids"]
    cache = KNormCache(0.5, score="kv_diff", head_budget="heads", head_floor=0.2, layer_budget=layer_budget,
                       config=model.config)
    out = greedy(model, ids, cache)
    counts = [cache.stored_per_head(layer) for layer in range(2)]
    assert any(len(set(c.flatten().tolist())) > 1 for c in counts)  # the heads really keep different counts
    kept = [cache.kept_positions(layer)[..., :] for layer in range(2)]

    def keep_fn(layer, keys):
        positions = kept[layer]
        prompt = positions.masked_fill((positions < 0) | (positions >= PROMPT), -1)
        return torch.where(prompt < 0, prompt.max(-1, keepdim=True).values, prompt)  # repeat a kept one

    reference = masked_logits(model, ids, out.sequences[:, PROMPT:], keep_fn)
    for got, want in zip(out.logits, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- layer schedules -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_budget", ["uniform", "skip_first", "dispersion"])
@pytest.mark.parametrize("head_budget", ["uniform", "heads"])
def test_layer_schedules_keep_the_ratios_total(layer_budget, head_budget):
    model = ragged_model(layers=5)
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    cache = KNormCache(0.5, head_budget=head_budget, layer_budget=layer_budget, config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    per_layer = [int(cache.stored_per_head(layer).sum()) for layer in range(5)]
    heads = model.config.num_key_value_heads
    assert sum(per_layer) == 5 * heads * kept_count(PROMPT, 0.5)
    if layer_budget == "skip_first":
        assert per_layer[:2] == [heads * PROMPT] * 2
    if layer_budget == "uniform":
        assert per_layer == [heads * kept_count(PROMPT, 0.5)] * 5
    if layer_budget == "dispersion":
        assert len(set(per_layer)) > 1
    model(input_ids=ids[:, :1], cache=cache, use_cache=True)  # decoding goes on after the schedule
    assert cache.get_seq_length() == PROMPT + 1


def test_allocate_and_layer_counts():
    assert allocate(10, [1, 1, 1], [1, 1, 1], [10, 10, 10]) == [4, 3, 3]
    assert allocate(12, [1, 0, 1], [1, 5, 1], [4, 8, 8]) == [4, 5, 3]
    assert layer_keep_counts("skip_first", 10, 6, 4) == [10, 10, 2, 2]
    assert sum(layer_keep_counts("dispersion", 10, 6, 4, dispersions=[0.1, 0.5, 2.0, 9.0])) == 24
    counts = layer_keep_counts("dispersion", 100, 50, 3, dispersions=[0.0, 1.0, 3.0])
    assert counts[0] > counts[1] > counts[2] and sum(counts) == 150


# --- memory -----------------------------------------------------------------------------------------------------------
def test_bytes_held_are_the_kept_pairs_plus_the_index():
    model = ragged_model()
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    cache = KNormCache(0.5, head_budget="heads", config=model.config)
    greedy(model, ids, cache)
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 16
    pairs = sum(int(cache.stored_per_head(layer).sum()) for layer in range(2))
    heads = model.config.num_key_value_heads
    index = 2 * (2 * heads * 8)  # ends and lengths, (B, H_kv) int64 each
    assert cache.nbytes() == 2 * pairs * dim * 4 + 2 * index  # ~12 tokens per head: no free room (< 50)
    for layer in cache.layers:  # nothing padded survives the call: every tensor the layer holds is the store
        held = sum(t.nbytes for t in vars(layer).values() if isinstance(t, torch.Tensor))
        assert held == 2 * layer.capacity() * dim * 4 + index + layer.positions.nbytes
        assert layer.keys.dim() == 2 and layer.capacity() == int(layer.lengths.sum())
    uniform = KNormCache(0.5, config=model.config)
    model.set_attn_implementation("sdpa")
    greedy(model, ids, uniform)
    assert cache.nbytes() == uniform.nbytes() + 2 * index  # same total kept, plus the index


def test_free_room_stays_within_two_percent_while_decoding():
    """A long prompt: each head's slice gets ``floor(2% of the mean count)`` free slots, used up by decoding and then
    rebuilt; the bytes held stay within 2% of the kept pairs (+ the index) at every step."""
    model = ragged_model()
    ids = tiny_inputs("llama", batch=1, length=400)["input_ids"]
    cache = KNormCache(0.5, score="kv_diff", head_budget="heads", config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 16
    capacities = set()
    for step in range(12):
        pairs = sum(int(cache.stored_per_head(layer).sum()) for layer in range(2))
        index = 2 * 2 * model.config.num_key_value_heads * 8
        assert 2 * pairs * dim * 4 + index <= cache.nbytes() <= 1.02 * 2 * pairs * dim * 4 + index
        capacities.add(cache.layers[0].capacity())
        out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert len(capacities) > 1  # the room ran out and the store was rebuilt


# --- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"head_budget": "layers"}, "Unknown head_budget"),
    ({"layer_budget": "pyramid"}, "Unknown layer_budget"),
    ({"head_budget": "heads", "head_floor": 1.5}, r"head_floor must be in \[0, 1\]"),
    ({"head_budget": "heads", "head_floor": -0.1}, "head_floor"),
    ({"head_budget": "heads", "budget": 8}, "do not combine with budget"),
    ({"layer_budget": "dispersion", "compression_ratio": 0.5, "layer_ratios": {0: 0.0}}, "layer_ratios"),
    ({"head_budget": "heads", "decoding_budget": 8}, "drop decoding_budget"),
    ({"head_budget": "heads", "layer_budget": "global", "compression_ratio": 0.5}, "'key_norm' is not"),
    ({"layer_budget": "global", "compression_ratio": 0.5, "score": "kvzip"}, "head_budget='heads'"),
])
def test_bad_budget_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KNormCache(**kwargs, config=tiny_config("llama"))


def test_budgets_need_the_config_and_the_ragged_attention():
    with pytest.raises(ValueError, match="config=model.config"):
        KNormCache(0.5, head_budget="heads")
    model = knorm_model("llama")  # sdpa: it would attend the padding
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match="set_attn_implementation"):
        greedy(model, ids, KNormCache(0.5, head_budget="heads", config=model.config))


def test_skip_first_too_much_for_the_ratio():
    model = ragged_model(layers=3)
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    with pytest.raises(ValueError, match="lower compression_ratio"):
        model(input_ids=ids, cache=KNormCache(0.75, layer_budget="skip_first", config=model.config), use_cache=True)


def test_ragged_cache_refuses_what_the_uniform_one_refuses():
    model = ragged_model()
    inputs = tiny_inputs("llama", batch=2, length=PROMPT)
    cache = KNormCache(0.5, head_budget="heads", config=model.config)
    model(input_ids=inputs["input_ids"], cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="one token per forward"):
        model(input_ids=inputs["input_ids"][:, :3], cache=cache, use_cache=True)
    inputs["attention_mask"][1, :4] = 0  # a padded batch: taken under knorm_ragged (test_knorm_batches.py) only
    plain = knorm_model("llama")
    with pytest.raises(ValueError, match="padded batch"):
        plain.generate(**inputs, cache=KNormCache(0.5, head_budget="heads", config=plain.config), max_new_tokens=2,
                       pad_token_id=0)


# --- the one-call paths ------------------------------------------------------------------------------------------------
def test_knorm_generate_runs_head_budgets_and_gives_the_attention_back():
    from hf_knorm.eviction.pipeline import answer_after_context, knorm_cache_for, knorm_generate

    model = knorm_model("llama")
    ids = tiny_inputs("llama", batch=1, length=PROMPT)["input_ids"]
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=10**6)
    uniform = knorm_generate(model, ids, compression_ratio=0.5, **options)
    equal = knorm_generate(model, ids, compression_ratio=0.5, head_budget="heads", head_floor=1.0, **options)
    assert torch.equal(uniform, equal) and model.config._attn_implementation == "sdpa"
    cache = knorm_cache_for(model, compression_ratio=0.5, head_budget="heads", layer_budget="dispersion")
    answer = answer_after_context(model, cache, ids[:, :-4], ids[:, -4:], **options)
    assert answer.shape == (1, NEW) and model.config._attn_implementation == "sdpa"


def test_head_budgets_refuse_a_patched_model():
    import hf_knorm

    model = hf_knorm.patch(knorm_model("llama"), normalization="x^3/16")
    with pytest.raises(ValueError, match="patched with x\\^3/16"):
        KNormCache(0.5, head_budget="heads", config=model.config)


@pytest.mark.parametrize("head_budget", ["uniform", "heads"])
def test_prefill_from_and_reset_give_the_same_schedule(head_budget):
    from transformers import DynamicCache

    model = ragged_model(layers=4)
    ids = tiny_inputs("llama", batch=2, length=PROMPT)["input_ids"]
    options = dict(compression_ratio=0.5, score="kv_diff", head_budget=head_budget, layer_budget="dispersion",
                   config=model.config)
    direct = KNormCache(**options)
    model(input_ids=ids, cache=direct, use_cache=True)
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    later = KNormCache.from_dynamic_cache(full, **options)
    direct.reset()
    model(input_ids=ids, cache=direct, use_cache=True)  # a reset cache schedules its new prompt again
    for layer in range(4):
        assert torch.equal(later.kept_positions(layer), direct.kept_positions(layer))
        assert torch.equal(later.stored_per_head(layer), direct.stored_per_head(layer))
