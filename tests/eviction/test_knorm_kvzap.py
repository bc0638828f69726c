"""KVzap's surrogate of KVzip's score (arXiv 2601.07891; hf_knorm.eviction.surrogate): the keys' rotation undone
exactly (full and partial rotary, QK-norm, no rotary), the ridge fit against least squares, the prediction against a
plain per-token loop, a fit end to end on a tiny model, the cache's kept pairs under the surrogate's score (uniform
and global budgets), saving and loading, and the refusals (another model, other shapes, a file with no spelling)."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from knorm_helpers import kept_lists, knorm_model, real_positions, word_text, word_tokenizer
from tiny_models import tiny_model
from transformers import DynamicCache

from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.cache import KNormCache, KNormLayer
from hf_knorm.eviction.pipeline import knorm_cache_for
from hf_knorm.eviction.scores import KVzap, resolve_score, score_spelling
from hf_knorm.eviction.surrogate import (KVzapSurrogate, _NormalEquations, calibrate_threshold, fit_kvzap, rotary_of,
                                         surrogate_features, unrotated_keys)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def pre_rotary_keys(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], DynamicCache]:
    """Every layer's keys as they enter ``apply_rotary_pos_emb`` (after any QK-norm), and the cache of the forward."""
    import importlib

    module = importlib.import_module(type(model).__module__)
    original, seen = module.apply_rotary_pos_emb, []

    def recording(q, k, *args, **kwargs):
        seen.append(k.clone())
        return original(q, k, *args, **kwargs)

    cache = DynamicCache()
    with mock.patch.object(module, "apply_rotary_pos_emb", recording):
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    return seen, cache


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3"])
def test_unrotated_keys_are_the_keys_before_their_rotation(model_type):
    """The cached (rotated) keys, unrotated at their positions, equal the keys the model rotated: full rotary (llama),
    after a QK-norm (qwen3), partial rotary (phi3: half the dimensions rotate). fp64: agreement to 1e-12."""
    model = knorm_model(model_type).double().eval()
    ids = torch.randint(4, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    seen, cache = pre_rotary_keys(model, ids)
    inv_freq, scaling = rotary_of(model)
    assert inv_freq is not None
    positions = torch.arange(17).expand(2, cache.layers[0].keys.shape[1], -1)
    for index, layer in enumerate(cache.layers):
        unrotated = unrotated_keys(layer.keys, positions, inv_freq.double(), scaling)
        torch.testing.assert_close(unrotated.double(), seen[index].double(), atol=1e-5, rtol=1e-5)


def test_a_model_without_rotary_keys_is_read_as_it_is():
    """GPT-2's keys carry no rotation (absolute positions): no frequencies, the keys unchanged."""
    inv_freq, scaling = rotary_of(tiny_model("gpt2"))
    keys = torch.randn(1, 2, 5, 4)
    assert inv_freq is None and scaling == 1.0
    assert torch.equal(unrotated_keys(keys, torch.zeros(1, 2, 5, dtype=torch.long), None), keys)


def test_per_layer_type_rotary_reads_the_full_attention_layers():
    """Gemma 3 rotates its sliding and its full layers by different frequencies; a KNorm cache compresses the full
    ones, so their frequencies are the ones undone (the cache keeps a sliding layer whole)."""
    model = tiny_model("gemma3_text")
    inv_freq, _ = rotary_of(model)
    assert torch.equal(inv_freq, model.model.rotary_emb.full_attention_inv_freq.float())
    assert not torch.equal(inv_freq, model.model.rotary_emb.sliding_attention_inv_freq.float())


def test_the_ridge_fit_is_least_squares_with_an_intercept():
    """``_NormalEquations`` accumulated in three parts, with no penalty, equals ``torch.linalg.lstsq`` on the stacked
    data with a column of ones; a penalty shrinks the weights."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=generator, dtype=torch.float64) * torch.tensor([1, 2, 3, 0.5, 1, 4.0]) + 3
    y = x @ torch.randn(6, 2, generator=generator, dtype=torch.float64) + torch.randn(300, 2, generator=generator,
                                                                                      dtype=torch.float64)
    equations = _NormalEquations(6, 2)
    for part in (slice(0, 100), slice(100, 250), slice(250, 300)):
        equations.add(x[part], y[part])
    weight, bias = equations.solve(ridge=0.0)
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(300, 1, dtype=torch.float64)], dim=1), y).solution
    torch.testing.assert_close(weight.double(), solution[:6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias.double(), solution[6], atol=1e-5, rtol=1e-5)
    shrunk, _ = equations.solve(ridge=10.0)
    assert shrunk.norm() < weight.norm()


def random_surrogate(layers: int, heads: int, dim: int, inv_freq, seed: int = 0) -> KVzapSurrogate:
    generator = torch.Generator().manual_seed(seed)
    return KVzapSurrogate(torch.randn(layers, 2 * heads * dim, heads, generator=generator),
                          torch.randn(layers, heads, generator=generator), inv_freq, 1.0, {"model": "a test"})


def reference_prediction(surrogate: KVzapSurrogate, keys, values, positions, layer_idx) -> torch.Tensor:
    """The prediction token by token and head by head, the rotation undone pair of dimensions by pair."""
    batch, heads, length, dim = keys.shape
    half = surrogate.inv_freq.numel()
    out = torch.empty(batch, heads, length)
    for b in range(batch):
        for t in range(length):
            unrotated = []
            for h in range(heads):
                k = keys[b, h, t].double().clone()
                for i in range(half):
                    angle = float(positions[b, h, t]) * float(surrogate.inv_freq[i])
                    c, s = math.cos(angle), math.sin(angle)
                    x1, x2 = float(keys[b, h, t, i]), float(keys[b, h, t, i + half])
                    k[i], k[i + half] = x1 * c + x2 * s, x2 * c - x1 * s
                unrotated.append(k)
            x = torch.cat(unrotated + [values[b, h, t].double() for h in range(heads)])
            for h in range(heads):
                out[b, h, t] = float(x @ surrogate.weight[layer_idx, :, h].double() + surrogate.bias[layer_idx, h])
    return out


def test_the_prediction_is_the_plain_per_token_loop():
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
    surrogate = random_surrogate(2, 2, 8, inv_freq)
    generator = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 2, 6, 8, generator=generator), torch.randn(2, 2, 6, 8, generator=generator)
    positions = torch.randint(0, 500, (2, 2, 6), generator=generator)
    got = surrogate.predict(keys, values, positions, 1)
    torch.testing.assert_close(got, reference_prediction(surrogate, keys, values, positions, 1), atol=1e-4, rtol=1e-4)
    assert surrogate_features(keys, values, positions, inv_freq).shape == (2, 6, 32)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A surrogate fitted on a tiny llama (3 contexts of 40 words, 1 held out), saved and loaded back."""
    model = knorm_model("llama").eval()
    surrogate = fit_kvzap(model, word_tokenizer(), [word_text(40, seed) for seed in range(3)], [word_text(40, 9)])
    path = surrogate.save(tmp_path_factory.mktemp("kvzap") / "tiny.safetensors")
    return model, surrogate, path


def test_a_fit_end_to_end_saves_and_loads_exactly(fitted):
    model, surrogate, path = fitted
    loaded = KVzapSurrogate.load(path)
    assert torch.equal(loaded.weight, surrogate.weight) and torch.equal(loaded.bias, surrogate.bias)
    assert torch.equal(loaded.inv_freq, surrogate.inv_freq) and loaded.attention_scaling == surrogate.attention_scaling
    assert loaded.weight.shape == (2, 2 * 2 * 16, 2)
    assert loaded.info["fit"]["texts"] == 3 and loaded.info["fit"]["tokens"] == 3 * 40  # no chat template: the words
    report = loaded.info["report"]
    assert report["texts"] == 1 and len(report["r2"]) == 2
    assert all(0.0 <= share <= 1.0 for share in report["top_half_overlap"])
    loaded.check_model(model)


def test_a_model_with_sliding_layers_fits_its_full_layers():
    """Gemma 3 (a sliding layer, then a full one): the cache compresses only the full layer, so only it is fitted, and
    scoring the sliding one is refused."""
    model = knorm_model("gemma3_text").eval()
    surrogate = fit_kvzap(model, word_tokenizer(), [word_text(30, seed) for seed in range(2)])
    assert surrogate.info["layers"] == [1] and torch.equal(surrogate.weight[0], torch.zeros_like(surrogate.weight[0]))
    states = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="layer 0 caches"):
        surrogate.predict(states, states, torch.zeros(1, 2, 4, dtype=torch.long), 0)
    assert surrogate.predict(states, states, torch.zeros(1, 2, 4, dtype=torch.long), 1).shape == (1, 2, 4)


def test_the_cache_keeps_the_pairs_the_surrogate_ranks_first(fitted):
    """``KNormCache(score=KVzap(file))`` keeps, per head, the pairs of highest plain-loop prediction (uniform budget),
    and under ``layer_budget="global"`` the highest of the whole cache (``head_floor=0``, KVzip's)."""
    model, surrogate, path = fitted
    ids = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = knorm_cache_for(model, recorded_defaults=False, compression_ratio=0.5, score=KVzap(file=str(path)))
    full = DynamicCache()
    model(input_ids=ids, **cache_kwargs(full), use_cache=True)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    positions = torch.arange(30).expand(1, 2, -1)
    predictions = []
    for index, layer in enumerate(cache.layers):
        predicted = reference_prediction(surrogate, full.layers[index].keys, full.layers[index].values, positions,
                                         index)
        predictions.append(predicted)
        expected = predicted.topk(15, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions, expected)
    global_cache = knorm_cache_for(model, recorded_defaults=False, compression_ratio=0.5, head_budget="heads",
                                   layer_budget="global", head_floor=0.0, score=KVzap(file=str(path)))
    model(input_ids=ids, **cache_kwargs(global_cache), use_cache=True)
    everything = torch.cat([p.flatten() for p in predictions])
    threshold = everything.topk(everything.numel() // 2).values[-1]
    for index in range(len(predictions)):
        held = global_cache.stored_per_head(index)[0]
        expected = (predictions[index][0] >= threshold).sum(dim=-1)
        assert torch.equal(held, expected), index


def test_the_global_budget_on_a_padded_batch_keeps_each_rows_own_pairs(fitted):
    """KVzap's usual setting (``layer_budget="global"``) on a left-padded batch through ``knorm_generate``: every row
    keeps, head by head, the pairs it keeps alone and generates the same tokens."""
    from hf_knorm.eviction.pipeline import knorm_generate
    from hf_knorm.eviction.ragged import ragged_attention_for
    from hf_knorm.eviction.rows import left_pad

    model, _, path = fitted
    options = dict(compression_ratio=0.5, head_budget="heads", layer_budget="global", head_floor=0.0,
                   score=KVzap(file=str(path)))
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 128, (n,), generator=generator) for n in (26, 15, 21)]
    ids, mask = left_pad(prompts, pad_id=0)
    generate = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    batch = knorm_generate(model, ids, mask, **options, **generate)

    padded = knorm_cache_for(model, recorded_defaults=False, **options)
    with torch.no_grad(), ragged_attention_for(model, padded, padded=True):
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
              **cache_kwargs(padded), use_cache=True)
    for row, prompt in enumerate(prompts):
        alone = knorm_generate(model, prompt[None], **options, **generate)
        assert torch.equal(batch[row, ids.shape[1]:], alone[0, prompt.numel():])
        cache = knorm_cache_for(model, recorded_defaults=False, **options)
        with torch.no_grad():
            model(input_ids=prompt[None], **cache_kwargs(cache), use_cache=True)
        assert all(kept_lists(padded, layer)[row] == kept_lists(cache, layer)[0] for layer in range(len(cache.layers)))


def test_spelling_and_refusals(fitted, tmp_path):
    model, surrogate, path = fitted
    assert isinstance(resolve_score("kvzap"), KVzap) and score_spelling("kvzap") == "kvzap"
    with pytest.raises(ValueError, match="names a file"):
        score_spelling(KVzap(file=str(path)))
    with pytest.raises(ValueError, match="Bad score spelling"):
        resolve_score("kvzap+file3")
    with pytest.raises(ValueError, match="fitted on"):  # the shipped surrogate belongs to the default model
        knorm_cache_for(model, recorded_defaults=False, compression_ratio=0.5, score="kvzap")
    other = knorm_model("qwen3")
    with pytest.raises(ValueError, match="fitted on"):
        surrogate.check_model(other)
    with pytest.raises(ValueError, match="layer 0 caches"):
        surrogate.predict(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="fitted on"):
        surrogate.predict(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, dtype=torch.long), 5)
    with pytest.raises(FileNotFoundError, match="No KVzap surrogate"):
        KVzapSurrogate.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a KVzap surrogate"):
        KVzapSurrogate.load(tmp_path / "other.safetensors")


def test_an_interrupted_save_keeps_the_previous_file(fitted, tmp_path):
    _, surrogate, _ = fitted
    path = surrogate.save(tmp_path / "s.safetensors")
    before = path.read_bytes()
    with mock.patch("safetensors.torch.save_file", side_effect=KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        surrogate.save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


@pytest.mark.slow
def test_the_shipped_surrogate_belongs_to_the_default_model(default_model_and_tokenizer):
    """``score="kvzap"`` on the default model: the shipped file loads, matches the model, and its report is the
    one docs/results/knorm.md quotes (fitted on plays, held-out plays: median R^2 above 0.3)."""
    import statistics

    model, _ = default_model_and_tokenizer
    score = resolve_score("kvzap")
    score.check_model(model)
    report = score.surrogate().info["report"]
    assert len(report["r2"]) == model.config.num_hidden_layers and statistics.median(report["r2"]) > 0.3
    cache = knorm_cache_for(model, recorded_defaults=False, compression_ratio=0.5, score="kvzap")
    assert isinstance(cache.layers[0], KNormLayer) and isinstance(cache, KNormCache)


# --- threshold pruning (KVzap's ThresholdPress) --------------------------------------------------------------------
def threshold_kept(importance, positions, length: int, threshold: float, window: int, sinks: int) -> list:
    """The plain rule, per batch row and head: after ``length`` tokens a pair is held when it is a sink, among the last
    ``window`` tokens, or its importance is at least ``threshold``."""
    keep = (positions < sinks) | (positions >= length - window) | (importance >= threshold)
    return [[positions[b, h][keep[b, h]].tolist() for h in range(keep.shape[1])] for b in range(keep.shape[0])]


def test_threshold_pruning_is_the_plain_rule_at_every_step(tmp_path):
    """A ragged layer under ``threshold``: after the prompt it holds exactly the sinks, the last ``recent_window``
    tokens and the older pairs whose predicted importance reaches the threshold (the plain rule on the whole
    sequence); what a decoding step's attention reads is the same rule with the query added to the window (as a
    ``decoding_budget`` cache's step reads it); the pairs are held with their own keys, the removals moving pairs
    down inside the store."""
    from hf_knorm.eviction.ragged import RaggedKNormLayer
    from hf_knorm.eviction.settings import EvictionSettings

    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
    path = random_surrogate(2, 2, 8, inv_freq).save(tmp_path / "s.safetensors")
    generator = torch.Generator().manual_seed(0)
    batch, heads, prompt, steps, window, sinks = 2, 2, 40, 70, 3, 1  # 70 steps: the store's room runs out
    keys, values = (torch.randn(batch, heads, prompt + steps, 8, generator=generator) for _ in range(2))
    positions = torch.arange(prompt + steps).expand(batch, heads, -1)
    importance = KVzap(file=str(path))(keys, values, positions, 1)
    threshold = float(importance.median())
    settings = EvictionSettings(score=KVzap(file=str(path)), head_budget="heads", threshold=threshold,
                                recent_window=window, sink_tokens=sinks)
    layer = RaggedKNormLayer(settings, 1)
    layer.update(keys[:, :, :prompt], values[:, :, :prompt])
    for length in range(prompt, prompt + steps + 1):
        if length > prompt:
            layer.update(keys[:, :, length - 1:length], values[:, :, length - 1:length])
        seen = window if length == prompt else window + 1  # a decoding step's window: the query and W before it
        expected = threshold_kept(importance[..., :length], positions[..., :length], length, threshold, seen, sinks)
        assert real_positions(layer.padded()[2]) == expected, length
        held, where = layer.padded()[0], layer.padded()[2]
        index = where.clamp_min(0)[..., None].expand_as(held)
        real = (where >= 0)[..., None]
        assert torch.equal(held * real, keys[:, :, :length].gather(2, index) * real)
    assert len({count for row in layer.lengths.tolist() for count in row}) > 1  # the heads differ


def test_threshold_at_its_extremes(fitted):
    """``threshold`` far below every importance is the full cache (the tokens of a DynamicCache, nothing evicted);
    far above, it keeps the sinks and the window only: the tokens and logits of a cache that holds exactly those
    (``score="recent"`` with ``decoding_budget`` = sinks + window)."""
    from hf_knorm.eviction.pipeline import knorm_generate

    model, _, path = fitted
    ids = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    generate = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                    return_dict_in_generate=True)
    protect = dict(sink_tokens=2, recent_window=4)
    threshold = dict(score=KVzap(file=str(path)), head_budget="heads", **protect)
    plain = model.generate(input_ids=ids, **cache_kwargs(DynamicCache()), **generate)
    everything = knorm_generate(model, ids, threshold=-1e9, **threshold, **generate)
    assert torch.equal(everything.sequences, plain.sequences)
    window = knorm_generate(model, ids, threshold=1e9, **threshold, **generate)
    streaming = knorm_generate(model, ids, score="recent", decoding_budget=6, **protect, **generate)
    assert torch.equal(window.sequences, streaming.sequences)
    for mine, theirs in zip(window.logits, streaming.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


def test_threshold_reports_what_it_evicted_and_takes_padded_batches(fitted):
    """``compression_achieved`` is the share of pairs gone (0 with nothing evicted); a left-padded batch keeps each
    row's own pairs (its own positions) and generates what each prompt generates alone."""
    from hf_knorm.eviction.pipeline import knorm_generate
    from hf_knorm.eviction.ragged import ragged_attention_for
    from hf_knorm.eviction.rows import left_pad

    model, _, path = fitted
    options = dict(score=KVzap(file=str(path)), head_budget="heads", sink_tokens=2, recent_window=4)
    ids = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    importance = []
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(full), use_cache=True)
    for index, layer in enumerate(full.layers):
        importance.append(KVzap(file=str(path))(layer.keys, layer.values, torch.arange(30).expand(1, 2, -1), index))
    threshold = float(torch.cat([i.flatten() for i in importance]).median())
    cache = knorm_cache_for(model, recorded_defaults=False, threshold=threshold, **options)
    with torch.no_grad(), ragged_attention_for(model, cache):
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    older = [(i[..., 2:26] < threshold).sum().item() for i in importance]  # neither sinks nor the window
    assert cache.compression_achieved() == pytest.approx(sum(older) / (30 * 2 * len(importance)))
    generate = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 128, (n,), generator=generator) for n in (26, 15, 21)]
    batch_ids, mask = left_pad(prompts, pad_id=0)
    batch = knorm_generate(model, batch_ids, mask, threshold=threshold, **options, **generate)
    for row, prompt in enumerate(prompts):
        alone = knorm_generate(model, prompt[None], threshold=threshold, **options, **generate)
        assert torch.equal(batch[row, batch_ids.shape[1]:], alone[0, prompt.numel():])


def test_threshold_refusals(fitted):
    _, _, path = fitted
    kvzap = KVzap(file=str(path))
    with pytest.raises(ValueError, match="score='kvzap'"):
        KNormCache(threshold=-3.0, score="kv_diff", head_budget="heads", config=knorm_model("llama").config)
    with pytest.raises(ValueError, match="drop compression_ratio"):
        KNormCache(0.5, threshold=-3.0, score=kvzap, head_budget="heads", config=knorm_model("llama").config)
    with pytest.raises(ValueError, match="head_budget='heads'"):
        KNormCache(threshold=-3.0, score=kvzap)
    with pytest.raises(ValueError, match="finite number"):
        KNormCache(threshold=float("nan"), score=kvzap, head_budget="heads", config=knorm_model("llama").config)


def test_a_calibrated_threshold_evicts_the_share_asked(fitted):
    """``calibrate_threshold(..., evict)`` on some texts: a threshold cache with the same sinks and window evicts
    ``round(evict * N)`` of the ``N`` pairs it may evict at the prefill of those texts (every layer and head); the
    refusals say what to give."""
    from hf_knorm.eviction.pipeline import encode_prompt
    from hf_knorm.eviction.ragged import ragged_attention_for

    model, _, path = fitted
    tokenizer, score = word_tokenizer(), KVzap(file=str(path))
    texts = [word_text(40, seed) for seed in (11, 12)]
    protect = dict(sink_tokens=2, recent_window=4)
    for evict in (0.25, 0.6):
        threshold = calibrate_threshold(model, tokenizer, texts, evict, score=score, **protect)
        gone = evictable = 0
        for text in texts:
            ids, _ = encode_prompt(tokenizer, text, "")
            cache = knorm_cache_for(model, recorded_defaults=False, score=score, head_budget="heads",
                                    threshold=threshold, **protect)
            with ragged_attention_for(model, cache):
                model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            pairs = ids.shape[1] * 2 * 2  # tokens x KV heads x layers
            gone += cache.compression_achieved() * pairs
            evictable += (ids.shape[1] - 6) * 2 * 2
        assert round(gone) == round(evict * evictable), evict
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"in \(0, 1\)"):
            calibrate_threshold(model, tokenizer, texts, bad, score=score)
    with pytest.raises(ValueError, match="at least one text"):
        calibrate_threshold(model, tokenizer, [], 0.5, score=score)
    with pytest.raises(ValueError, match="give longer texts"):
        calibrate_threshold(model, tokenizer, [word_text(5, 1)], 0.5, score=score, **protect)
