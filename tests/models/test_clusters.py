"""Clusters beside the sparse cache in patched models (``... + sparse K (score) + clusters C``): codebooks fitted on the
model's keys (``hf_knorm/models/cluster_codebook.py``), saved and loaded with the weights, and decoding from the
bounded cache (``hf_knorm/recurrent/sparse_cache.py`` keeps the clusters' sums).

- The whole model against its twin whose attention is the plain reference: in tests/recurrent/test_sparse_cache.py
  (``test_models_equal_the_reference_attention``, its clustered cases).
- Decoding in chunks and token by token with the bounded cache equals the full forward, fp32 logits within 1e-4 (as
  tests/recurrent/test_sparse_cache.py); ``generate`` gives the full forward's greedy tokens, beams included.
- A saved model loads with the same codebooks and the same logits, bit for bit.
"""

import pytest
import torch
from card_values import expected_normalization, stated_normalization
from tiny_models import greedy_by_full_forward, tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm import RecurrentStateCache
from hf_knorm.attention import sparse
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.models.cluster_codebook import fit_cluster_codebook, set_clusters
from hf_knorm.models.sparse_cache_size import set_sparse_cache
from hf_knorm.models.window_mix import set_window_mix, window_mixes
from hf_knorm.recurrent.sparse_cache import SparseWindowStateLayer

CODEBOOK = "hf_knorm_cluster_codebook"
GREEDY = dict(do_sample=False, pad_token_id=0)
SPELLING = "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm) + clusters 4"


def _calibration(seed=5):
    return torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(seed))


def _prompts(batch=2, length=30, pad=3, seed=0):
    """Token ids without repeats in a row (a repeated token's keys tie at the first layer, up to rounding: see
    tests/recurrent/test_sparse_cache.py)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(125, generator=generator)[:length] + 3 for _ in range(batch)])
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = 0
    return ids, mask


def _codebooks(model) -> dict[str, torch.Tensor]:
    """The model's codebooks by parameter name (one per attention layer), cloned."""
    return {name: value.detach().clone() for name, value in model.named_parameters() if name.endswith(CODEBOOK)}


def _clustered(model_type="llama", spelling=SPELLING, dtype=torch.float32):
    model = hf_knorm.patch(tiny_model(model_type, dtype=dtype), spelling)
    return fit_cluster_codebook(model, _calibration())


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [256, 2])
def test_decoding_from_the_bounded_cache_equals_the_full_forward(model_type, rows, monkeypatch):
    """A left-padded prompt in two chunks, then 21 tokens one by one: pairs leave the window, the cache, join their
    clusters' sums; every real row's logits are the full forward's, and the sums count every pair of the state."""
    monkeypatch.setattr(sparse, "ROWS", rows)
    spelling = SPELLING if model_type == "llama" else SPELLING.replace("key_norm", "value_over_key")
    model = _clustered(model_type, spelling)
    ids, mask = _prompts()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
    cache = RecurrentStateCache(config=model.config)
    steps, done = [], 0
    with torch.no_grad():
        for size in (5, 4) + (1,) * 21:
            steps.append(model(input_ids=ids[:, done:done + size], attention_mask=mask[:, :done + size],
                               **cache_kwargs(cache), use_cache=True).logits)
            done += size
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], rtol=0, atol=1e-4)
    for layer in cache.layers:
        assert isinstance(layer, SparseWindowStateLayer) and layer.stored_pairs() == 3 + 1 + 2
        counts = layer.cluster_state.count  # (B, H_kv, C)
        assert counts.shape == (2, 2, 4) and (counts.sum(-1) == layer.count[:, None]).all()
        assert (layer.count == real.sum(dim=1) - 6).all()


def test_generate_gives_the_full_forwards_greedy_tokens_with_either_cache_and_beams():
    model = _clustered()
    ids, mask = _prompts(length=12)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, min_new_tokens=16,
                         max_new_tokens=16, **GREEDY)
    assert isinstance(output_cache(out), RecurrentStateCache)
    sequence = greedy_by_full_forward(model, ids, mask, 16)
    assert out.sequences.tolist() == sequence.tolist()
    with_kv_cache = model.generate(input_ids=ids, attention_mask=mask, min_new_tokens=16, max_new_tokens=16,
                                   **GREEDY, **cache_kwargs(DynamicCache()))
    assert with_kv_cache.tolist() == sequence.tolist()
    options = dict(GREEDY, num_beams=3, num_return_sequences=2, min_new_tokens=12, max_new_tokens=12)
    beams = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert beams.tolist() == model.generate(input_ids=ids, attention_mask=mask, **options,
                                            **cache_kwargs(DynamicCache())).tolist()


def test_a_clustered_model_travels_with_its_codebooks(tmp_path):
    model = _clustered("qwen3", SPELLING.replace("key_norm", "value_over_key"))
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model").eval()
    assert hf_knorm.patched_normalization(loaded) == hf_knorm.patched_normalization(model)
    want, got = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert sorted(got) == sorted(want) and len(_codebooks(loaded)) == model.config.num_hidden_layers
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids, mask = _prompts(length=12)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits,
                           model(input_ids=ids, attention_mask=mask).logits)


def test_fitting_is_deterministic_and_reads_the_keys_without_the_clusters():
    """Fitted twice on the same tokens (the second time with a fitted codebook in place): the same codebooks, since
    the keys are computed with the clusters off; another seed starts elsewhere."""
    model = _clustered()
    first = _codebooks(model)
    assert len(first) == model.config.num_hidden_layers
    assert all(value.abs().sum() > 0 for value in first.values())  # fitted, not the zeros patch adds
    fit_cluster_codebook(model, _calibration())
    again = _codebooks(model)
    assert sorted(again) == sorted(first)
    for name in first:
        assert torch.equal(again[name], first[name]), name
    assert hf_knorm.patched_normalization(model).endswith("clusters 4")  # the spelling is back
    fit_cluster_codebook(model, _calibration(), seed=1)
    elsewhere = _codebooks(model)
    assert sorted(elsewhere) == sorted(first)
    assert all(not torch.equal(elsewhere[name], first[name]) for name in first), "another seed, other codebooks"


def test_set_clusters_and_set_sparse_cache_keep_the_learned_values_and_the_codebooks():
    model = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm)")
    mixes = [torch.full((4,), 0.25 + layer) for layer in range(2)]
    set_window_mix(model, mixes)
    set_clusters(model, 4, _calibration())
    assert hf_knorm.patched_normalization(model) == SPELLING
    assert len(window_mixes(model)) == len(mixes)
    assert all(torch.equal(torch.tensor(a), b) for a, b in zip(window_mixes(model), mixes))
    codebooks = _codebooks(model)
    assert len(codebooks) == model.config.num_hidden_layers
    set_sparse_cache(model, 3)
    assert hf_knorm.patched_normalization(model).endswith("sparse 3 (key_norm) + clusters 4")
    kept = _codebooks(model)
    assert sorted(kept) == sorted(codebooks)
    for name in codebooks:
        assert torch.equal(kept[name], codebooks[name]), name
    set_clusters(model, 0)
    assert _codebooks(model) == {}
    assert len(window_mixes(model)) == len(mixes)
    assert all(torch.equal(torch.tensor(a), b) for a, b in zip(window_mixes(model), mixes))


def test_bad_requests_are_refused_with_what_to_do():
    ids, mask = _prompts(length=12)
    unfitted = hf_knorm.patch(tiny_model("llama"), SPELLING)
    with torch.no_grad(), pytest.raises(ValueError, match="never fitted.*fit_cluster_codebook"):
        unfitted(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        fit_cluster_codebook(unfitted, [[5, 6, 7]])
    no_cache = hf_knorm.patch(tiny_model("llama"), "x/1 + softmax window 3 + sinks 1")
    with pytest.raises(ValueError, match="sparse cache leaves"):
        set_clusters(no_cache, 4, _calibration())
    with pytest.raises(ValueError, match="no clusters"):
        fit_cluster_codebook(no_cache, _calibration())
    with pytest.raises(ValueError, match="not patched"):
        set_clusters(tiny_model("llama"), 4)
    with pytest.raises(ValueError, match="integer >= 0"):
        hf_knorm.parse_normalization("x/1 + softmax window 3 + sparse 2 + clusters -1")


def test_the_card_says_what_the_clusters_are(tmp_path):
    model = _clustered()
    hf_knorm.save_pretrained(model, tmp_path / "model")
    card = (tmp_path / "model" / "README.md").read_text()
    assert stated_normalization(card) == expected_normalization(hf_knorm.patched_normalization(model))
    assert stated_normalization(card)["clusters"] == 4
