"""A sparse global cache beside the window in patched models, and decoding a p = 1 model from ``W + S + K`` pairs
plus the state (``hf_knorm/recurrent/sparse_cache.py``).

- The whole model against its twin whose attention is the plain reference (explicit masks), fp64: logits within 1e-9
  of their largest entry and every parameter's gradient (the window mix included) within 1e-9 of its largest entry;
  left padding, GQA; with clusters beside the cache too (tests/models/test_clusters.py tests the rest of them).
- Decoding in chunks and token by token with the bounded cache equals the full forward, fp32 logits within 1e-4 (as
  tests/recurrent/test_window_cache.py; logits of size ~10), on sequences long enough that pairs are displaced; the
  cache holds, per head, the pairs the reference chooses for the next query.
- ``generate`` with the bounded cache gives the full forward's greedy tokens; the layers never hold more than
  ``W + S + K`` pairs, and the cache's bytes do not grow with the context.
"""

import pytest
import torch
from card_values import expected_normalization, stated_normalization
from tiny_models import assert_same_step, greedy_by_full_forward, logits_and_grads, tiny_inputs, tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import hf_knorm
from hf_knorm import RecurrentStateCache, attention_paths
from hf_knorm.attention import sparse
from hf_knorm.attention.interface import normalization_of
from hf_knorm.attention.masks import explicit_bool_mask
from hf_knorm.attention.reference import reference_scores, reference_window_attention, sparse_split, window_split
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.models.cluster_codebook import fit_cluster_codebook, set_clusters
from hf_knorm.models.parameters import add_parameters, hold_normalization
from hf_knorm.models.window_mix import set_window_mix, window_mixes
from hf_knorm.recurrent.sparse_cache import SparseWindowStateLayer
from hf_knorm.recurrent.window_cache import WindowStateLayer

REFERENCE = "test_reference_sparse_window"
CODEBOOK = "hf_knorm_cluster_codebook"
ATOL = 1e-4
GREEDY = dict(do_sample=False, pad_token_id=0)


def _reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    normalization = normalization_of(module)
    params = normalization.values_on(module)
    output, _ = reference_window_attention(query, key, value, attention_mask, normalization, scaling=scaling,
                                           softcap=kwargs.get("softcap"), mix=params.get("window_mix"), params=params,
                                           codebook=getattr(module, CODEBOOK, None))
    return output, None


AttentionInterface.register(REFERENCE, _reference)
AttentionMaskInterface.register(REFERENCE, explicit_bool_mask)


def _prompts(batch=2, length=30, pad=3, seed=0):
    """Token ids without repeats in a row (repeated text, whose ties are broken by position: test_sparse_ties.py)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(125, generator=generator)[:length] + 3 for _ in range(batch)])
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[-1, :pad] = 0
        ids[-1, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("model_type, spelling", [
    ("llama", "x/1 + softmax window 3 + sinks 1 + sparse 2"),
    ("qwen3", "x/sqrtN + softmax window 4 + sparse 3 (value_over_key)"),
    ("gpt2", "x^3/16 + softmax window 3 + sinks 2 + sparse 2"),
    ("llama", "sigmoid(bias=learned) + softmax window 2 + sparse 4 (key_norm)"),
    ("qwen3", "x/1 + softmax window 3 + sinks 1 + sparse 2 (prefix_kv_diff)"),
    ("llama", "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm) + clusters 4"),  # clusters: fitted first
    ("qwen3", "x/1 + softmax window 3 + sinks 1 + sparse 2 (prefix_kv_diff) + clusters 3"),
    ("gpt2", "x^3/16 + softmax window 3 + sinks 2 + sparse 2 (key_norm) + clusters 4"),
])
@pytest.mark.parametrize("rows", [256, 6])  # 6: a p = 1 forward in blocks with the state carried (sparse._chunked)
def test_models_equal_the_reference_attention(model_type, spelling, rows, monkeypatch):
    monkeypatch.setattr(sparse, "ROWS", rows)
    model = hf_knorm.patch(tiny_model(model_type, dtype=torch.float64), spelling)
    clusters = hf_knorm.parse_normalization(spelling).clusters
    if clusters:
        fit_cluster_codebook(model, torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(5)))
    generator = torch.Generator().manual_seed(1)
    mixes = [torch.randn(4, generator=generator, dtype=torch.float64) for _ in window_mixes(model)]
    set_window_mix(model, mixes)
    reference = tiny_model(model_type, dtype=torch.float64)
    reference.config.hf_knorm = dict(model.config.hf_knorm)
    hold_normalization(reference, hf_knorm.parse_normalization(spelling))
    add_parameters(reference, hf_knorm.parse_normalization(spelling))
    set_window_mix(reference, mixes)
    codebooks = {name: value for name, value in model.named_parameters() if name.endswith(CODEBOOK)}
    assert len(codebooks) == (2 if clusters else 0)
    assert all(value.ne(0).any(dim=-1).all() for value in codebooks.values())  # fitted
    reference.load_state_dict(codebooks, strict=False)
    reference.set_attn_implementation(REFERENCE)
    inputs = tiny_inputs(model_type, length=20)
    inputs["attention_mask"][1, :4] = 0
    got, want = logits_and_grads(model, inputs), logits_and_grads(reference, inputs)
    assert any("window_mix" in name for name in want[1])
    assert not any(name.endswith(CODEBOOK) for name in got[1])  # a codebook is fitted, never trained
    assert_same_step(got, want, logits_atol=1e-9 * want[0].abs().max().item(), grads_relative=1e-9, grads_floor=1e-15)
    if clusters:
        set_clusters(model, 0)
        without, _ = logits_and_grads(model, inputs)
        assert (without - got[0]).abs().amax() > 1e-3  # the clusters matter


def _decode(model, ids, mask, cache, sizes):
    steps, done, positions = [], 0, []
    with torch.no_grad():
        for size in sizes:
            out = model(input_ids=ids[:, done: done + size], attention_mask=mask[:, : done + size],
                        **cache_kwargs(cache), use_cache=True)
            steps.append(out.logits)
            done += size
            layer = cache.layers[0]
            if isinstance(layer, SparseWindowStateLayer) and layer.sparse_pairs is not None:
                positions.append(torch.where(layer.sparse_pairs.filled, layer.sparse_pairs.position, -1))
    return torch.cat(steps, dim=1), positions


@pytest.mark.parametrize("spelling", ["x/1 + softmax window 3 + sparse 2", "x/1 + softmax window 3 + sinks 2 + sparse 3",
                                      "x/sqrtN + softmax window 4 + sinks 1 + sparse 2 (value_over_key)",
                                      "x/16 + softmax window 2 + sparse 1 (key_norm)",
                                      "x/1 + softmax window 3 + sinks 1 + sparse 3 (prefix_kv_diff)"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [256, 2])  # 2: the full forward and the prompt's chunks in blocks (sparse._chunked)
def test_decoding_from_the_bounded_cache_equals_the_full_forward(model_type, spelling, rows, monkeypatch):
    """A left-padded prompt in two chunks (5 then 4 tokens), then 21 tokens one by one: pairs enter the cache, are
    displaced and join the state; every real row's logits are the full forward's. Qwen3's QK-norm gives every key one
    norm: under key_norm every pair ties and the cache keeps the oldest, never turning over (test_sparse_ties.py), so
    it runs value_over_key there. ``prefix_kv_diff`` (the default score) carries its running statistics from one call
    to the next (its tail of scores included)."""
    monkeypatch.setattr(sparse, "ROWS", rows)
    if model_type == "qwen3":
        spelling = spelling.replace("(key_norm)", "(value_over_key)")
    model = hf_knorm.patch(tiny_model(model_type), spelling)
    normalization = hf_knorm.parse_normalization(spelling)
    ids, mask = _prompts()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
    cache = RecurrentStateCache(config=model.config)
    steps, positions = _decode(model, ids, mask, cache, (5, 4) + (1,) * 21)
    real = mask.bool()
    torch.testing.assert_close(steps[real], full[real], rtol=0, atol=ATOL)
    bound = normalization.window + normalization.sinks + normalization.sparse
    assert all(isinstance(layer, SparseWindowStateLayer) and layer.stored_pairs() == bound for layer in cache.layers)
    displaced = sum(len(set(before[b, h].tolist()) - set(after[b, h].tolist()) - {-1})
                    for before, after in zip(positions, positions[1:]) for b in range(2) for h in range(2))
    assert displaced >= 3  # the cache really turned over (layer 0's pairs, per sequence and head)
    assert (cache.layers[0].count == real.sum(dim=1) - normalization.window - normalization.sinks
            - normalization.sparse).all()  # every other pair is in the state


def test_the_cache_holds_the_pairs_the_reference_chooses():
    """After 30 tokens, each head's cache holds the K older keys of lowest norm among those the next query reads
    beyond its window (the reference's rule, on the keys a K/V cache kept from the same steps)."""
    spelling = "x/1 + softmax window 3 + sinks 1 + sparse 3 (key_norm)"
    model = hf_knorm.patch(tiny_model("llama"), spelling)
    ids, mask = _prompts()
    sizes = (9,) + (1,) * 21
    bounded = RecurrentStateCache(config=model.config)
    _decode(model, ids, mask, bounded, sizes)
    full = DynamicCache(config=model.config)
    _decode(model, ids, mask, full, sizes)
    for layer, kv_layer in zip(bounded.layers, full.layers):
        keys, values = kv_layer.keys, kv_layer.values  # (B, H_kv, 30, D)
        allowed = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1).bool()[:, None, None, :30]
        _, older = window_split(allowed.expand(2, 1, 1, 30), 3 - 1, 1)  # the next query (31st) reads W - 1 of these
        ranks = reference_scores("key_norm", keys, values, mask.bool())
        chosen = sparse_split(older.expand(2, 2, 1, 30), ranks, 3)[:, :, 0]
        pairs = layer.sparse_pairs
        for b in range(2):
            for h in range(2):
                kept = sorted(pairs.position[b, h][pairs.filled[b, h]].tolist())
                assert kept == torch.nonzero(chosen[b, h]).flatten().tolist()


@pytest.mark.parametrize("spelling", ["x/1 + softmax window 3 + sinks 2 + sparse 3", "x/sqrtN + softmax window 5 + sparse 4",
                                      "x/1 + softmax window 4 + sinks 1 + sparse 3 (prefix_kv_diff)"])
def test_generate_with_the_bounded_cache_gives_the_full_forwards_greedy_tokens(spelling):
    model = hf_knorm.patch(tiny_model("llama"), spelling)
    ids, mask = _prompts(length=12)
    with attention_paths() as taken:
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, min_new_tokens=16,
                             max_new_tokens=16, **GREEDY)
    cache = output_cache(out)
    assert isinstance(cache, RecurrentStateCache)
    assert all(isinstance(layer, SparseWindowStateLayer) for layer in cache.layers)
    assert dict(taken) == {"sparse": 16 * model.config.num_hidden_layers}
    sequence = greedy_by_full_forward(model, ids, mask, 16)
    assert out.sequences.tolist() == sequence.tolist()
    with_kv_cache = model.generate(input_ids=ids, attention_mask=mask, min_new_tokens=16, max_new_tokens=16,
                                   **GREEDY, **cache_kwargs(DynamicCache()))
    assert with_kv_cache.tolist() == sequence.tolist()


@pytest.mark.parametrize("score", ["value_over_key", "prefix_kv_diff"])
def test_beam_search_reorders_the_sparse_cache_and_the_scores_statistics(score):
    """Beams reorder (and first expand) the window, the sparse cache's pairs and, for ``prefix_kv_diff``, the running
    statistics with the states: the bounded cache gives the K/V cache's beams."""
    model = hf_knorm.patch(tiny_model("llama"), f"x/1 + softmax window 4 + sinks 1 + sparse 3 ({score})")
    ids, mask = _prompts(length=12)
    options = dict(GREEDY, num_beams=3, num_return_sequences=2, min_new_tokens=12, max_new_tokens=12)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **options)
    assert all(isinstance(layer, SparseWindowStateLayer) for layer in output_cache(out).layers)
    expected = model.generate(input_ids=ids, attention_mask=mask, **options, **cache_kwargs(DynamicCache()))
    assert out.sequences.tolist() == expected.tolist()


def test_a_polynomial_base_generates_with_the_kv_cache():
    """``x^3`` has no state: ``generate`` keeps Transformers' K/V cache and the full forward's tokens."""
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16 + softmax window 3 + sparse 2")
    ids, mask = _prompts(length=12)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, min_new_tokens=8,
                         max_new_tokens=8, **GREEDY)
    assert not isinstance(output_cache(out), RecurrentStateCache)
    sequence, attention = ids, mask
    with torch.no_grad():
        for _ in range(8):
            following = model(input_ids=sequence, attention_mask=attention).logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, following], dim=1)
            attention = torch.cat([attention, torch.ones_like(following)], dim=1)
    assert out.sequences.tolist() == sequence.tolist()


def test_the_bounded_cache_does_not_grow_with_the_context():
    model = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 4 + sinks 2 + sparse 3 (key_norm)")
    ids, mask = _prompts(batch=1, length=10)
    sizes, pairs = [], []
    for new_tokens in (12, 40):  # past the crossover (17 tokens here), where generate decodes with the state
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, **GREEDY)
        cache = output_cache(out)
        sizes.append(cache.nbytes())
        pairs.append([layer.stored_pairs() for layer in cache.layers])
    assert sizes[0] == sizes[1] and pairs == [[4 + 2 + 3] * 2] * 2
    layers, kv_heads, head_dim = 2, 2, 16
    state = kv_heads * head_dim * head_dim * 4 + 4  # fp32 state + count
    kept = 2 * kv_heads * (4 + 2) * head_dim * 4 + 2 * (8 + 1)  # window and sinks (positions int64, validity bool)
    sparse = 2 * kv_heads * 3 * head_dim * 4 + kv_heads * 3 * (4 + 8 + 1)  # pairs, scores, positions, filled slots
    assert sizes[0] == layers * (state + kept + sparse)


def test_a_prefix_scores_statistics_do_not_grow_with_the_context():
    """``prefix_kv_diff`` adds to each layer its running statistics: ``D + D_v + 4`` fp64 numbers per sequence and KV
    head, the count, and the score of the last ``W + 2`` positions, whatever the length."""
    model = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 4 + sinks 2 + sparse 3 (prefix_kv_diff)")
    ids, mask = _prompts(batch=1, length=10)
    sizes = []
    for new_tokens in (12, 40):  # past the crossover (17 tokens here), where generate decodes with the state
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, **GREEDY)
        cache = output_cache(out)
        sizes.append(cache.nbytes())
        assert int(cache.layers[0].score_statistics.seen) == 10 + new_tokens - 1  # the last token is not run
    kv_heads, head_dim, tail = 2, 16, 4 + 2
    statistics = (kv_heads * (2 * head_dim + 4 + tail) + 1) * 8 + tail + 8  # sums, moments, tail; count; valid; seen
    without = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 4 + sinks 2 + sparse 3 (key_norm)")
    out = without.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, min_new_tokens=12,
                           max_new_tokens=12, **GREEDY)
    assert sizes[0] == sizes[1] == output_cache(out).nbytes() + 2 * statistics


def test_a_prefix_score_needs_a_window_longer_than_its_reach():
    """A token's ``prefix_kv_diff`` is final two tokens after it; a window of 2 would rank it before."""
    with pytest.raises(ValueError, match="needs a softmax window of at least 3"):
        hf_knorm.parse_normalization("x/1 + softmax window 2 + sparse 3 (prefix_kv_diff)")
    with pytest.raises(ValueError, match="prefix_kv_diff is kv_diff over each token's prefix"):
        hf_knorm.parse_normalization("x/1 + softmax window 4 + sparse 3 (kv_diff)")


def test_a_sparse_model_travels_and_refuses_another_cache(tmp_path):
    model = hf_knorm.patch(tiny_model("qwen3"), "x/1", softmax_window=3, attention_sinks=1)
    hf_knorm.unpatch(model)
    spelling = "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm)"
    model = hf_knorm.patch(model, spelling)
    assert hf_knorm.patched_normalization(model) == spelling
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model").eval()
    assert hf_knorm.patched_normalization(loaded) == spelling
    stated = stated_normalization((tmp_path / "model" / "README.md").read_text())
    assert stated == expected_normalization(spelling) and (stated["sparse"], stated["score"]) == (2, "key_norm")
    ids, mask = _prompts(length=12)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits,
                           model(input_ids=ids, attention_mask=mask).logits)
    generated = loaded.generate(input_ids=ids, attention_mask=mask, min_new_tokens=8, max_new_tokens=8, **GREEDY)
    assert generated.tolist() == model.generate(input_ids=ids, attention_mask=mask, min_new_tokens=8,
                                                max_new_tokens=8, **GREEDY).tolist()
    windowed = hf_knorm.patch(tiny_model("qwen3"), "x/1 + softmax window 3 + sinks 1")
    with pytest.raises(ValueError, match="sparse cache of 2 pairs and the model runs x/1 \\+ softmax window 3"):
        windowed.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **GREEDY,
                          **cache_kwargs(RecurrentStateCache(config=model.config)))
    with pytest.raises(ValueError, match="window of 3 keys and the model runs .*sparse 2"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **GREEDY,
                       **cache_kwargs(RecurrentStateCache(config=windowed.config)))
    assert type(RecurrentStateCache(config=windowed.config).layers[0]) is WindowStateLayer
    with pytest.raises(ValueError, match="K > 0"):
        SparseWindowStateLayer(0, 3, 0)


def test_linear_require_runs_the_blocks_and_refuses_the_masked_rows(monkeypatch):
    """``linear="require"``: the full forward (in blocks) and bounded decoding run; recording the attention weights,
    which needs every row's weights over every key, is the quadratic fallback and raises."""
    monkeypatch.setattr(sparse, "ROWS", 4)
    model = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 3 + sinks 1 + sparse 2", linear="require")
    ids, mask = _prompts(length=12)
    with attention_paths() as taken, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert dict(taken) == {"sparse": model.config.num_hidden_layers}
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    with torch.no_grad(), pytest.raises(ValueError, match="requires the linear path.*returned weights"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_a_models_own_sliding_window_is_refused():
    """By ``patch``, and by the attention for a model whose config names the sparse cache (a plain load)."""
    spelling = "x^3/16 + softmax window 3 + sparse 2"
    with pytest.raises(ValueError, match="own sliding window .*5 positions.*without the sparse cache"):
        hf_knorm.patch(tiny_model("mistral"), spelling)
    model = hf_knorm.patch(tiny_model("mistral"), "x^3/16 + softmax window 3")
    model.config.hf_knorm = {**model.config.hf_knorm, "normalization": spelling}  # as a plain load builds it
    hold_normalization(model, hf_knorm.parse_normalization(spelling))
    with torch.no_grad(), pytest.raises(ValueError, match="own sliding window of 5 positions"):
        model(**tiny_inputs("mistral", length=12))
