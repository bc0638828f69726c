"""A sparse cache's ties are broken by position: decoding chooses the pairs the full forward chose, on real text with
repeated tokens (``hf_knorm/normalizations/sparse_choice.py``, ``ranked``).

A repeated token's keys at the first layer differ only by their rotation: the same norm, so ``key_norm`` ties them; a
QK-norm model (Qwen3) gives every key about one norm. A decoded key is rounded differently from the full forward's
(~3e-7 of its norm at the default model's first layer, ~2e-6 deeper), so without a rule for ties the two chose
different pairs by rounding. A per-token score is ranked at bfloat16's 8 significant bits, and equal ranks go to the
older pair (``prefix_kv_diff``, the default, does not tie by construction and is ranked as it is). Checked here,
token by token after a short prompt, on the default model (SmolLM2-135M, 30 layers, fp32) and a tiny Qwen3:

- with the bounded cache (``RecurrentStateCache``), each layer's kept pairs after the last step are the ones the plain
  reference (:func:`~hf_knorm.attention.reference.sparse_split` on the full forward's own keys) chooses for the last
  query, and every step's logits are the full forward's: within 1e-4 on the tiny model; within 1e-2 on the default
  model, whose logits (of size ~30) decode within 1e-4 of its full forward unpatched and ~2e-3 patched (the part
  beside the window is RMS-normalized, which enlarges rounding in its small rows), where a pair chosen differently
  moves them by ~1;
- with the K/V cache (``DynamicCache``, the pairs chosen again from the cached keys at every step), the same logits;
- the text has ties: at the first layer, pairs of distinct positions whose raw scores differ (by rounding) and whose
  ranks are equal.
"""

import copy

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm import RecurrentStateCache
from hf_knorm.attention.reference import reference_scores, sparse_split, window_split
from hf_knorm.compat import cache_kwargs
from hf_knorm.normalizations.sparse_choice import token_scores
from hf_knorm.recurrent.sparse_cache import SparseWindowStateLayer

TEXT = ("The cat sat on the mat. The dog sat on the mat. The cat saw the dog, and the dog saw the cat. "
        "The cat sat on the mat again, and the dog sat on the mat again. ")
ATOL = 1e-4
DEFAULT_MODEL_ATOL = 1e-2
PROMPT = 6


def _decode(model, ids, cache):
    """The prompt's first ``PROMPT`` tokens at once, then one token a step: the logits of every position."""
    steps = []
    with torch.no_grad():
        for start, stop in [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, ids.shape[1])]:
            out = model(input_ids=ids[:, start:stop], attention_mask=torch.ones_like(ids[:, :stop]),
                        **cache_kwargs(cache), use_cache=True)
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


def _full_forward(model, ids):
    """The full forward's logits and its own keys and values, per layer ``[(B, H_kv, N, D)]``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits
    return logits, [(layer.keys, layer.values) for layer in cache.layers]


def _chosen_for_the_last_query(normalization, keys, values):
    """``(B, H_kv, N)`` bool: the pairs the reference puts in the sparse cache of the last query (what the bounded
    cache holds after its step)."""
    batch, heads, length, _ = keys.shape
    allowed = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    _, older = window_split(allowed, normalization.window, normalization.sinks)
    valid = torch.ones(batch, length, dtype=torch.bool)
    ranks = reference_scores(normalization.score, keys, values, valid)
    return sparse_split(older.expand(batch, heads, 1, length), ranks, normalization.sparse)[:, :, 0]


def _assert_decoding_chooses_what_the_full_forward_chose(model, ids, spelling, layers, atol=ATOL):
    model = hf_knorm.patch(model, spelling)
    normalization = hf_knorm.parse_normalization(spelling)
    full, pairs = _full_forward(model, ids)
    bounded = RecurrentStateCache(config=model.config)
    torch.testing.assert_close(_decode(model, ids, bounded), full, rtol=0, atol=atol)
    torch.testing.assert_close(_decode(model, ids, DynamicCache(config=model.config)), full, rtol=0, atol=atol)
    for index in layers:
        layer = bounded.layers[index]
        assert isinstance(layer, SparseWindowStateLayer)
        chosen = _chosen_for_the_last_query(normalization, *pairs[index])
        kept = layer.sparse_pairs
        for head in range(chosen.shape[1]):
            assert sorted(kept.position[0, head][kept.filled[0, head]].tolist()) == \
                chosen[0, head].nonzero().flatten().tolist(), (index, head)
    return pairs


def _tied_pairs(keys, values, score="key_norm") -> int:
    """Pairs of distinct positions (per KV head) whose raw scores differ and whose ranks are equal."""
    raw = token_scores(score, keys, values)[0]  # (H_kv, N)
    ranks = reference_scores(score, keys, values, torch.ones(1, keys.shape[2], dtype=torch.bool))[0]
    same_rank = ranks[:, :, None] == ranks[:, None, :]
    return int((same_rank & (raw[:, :, None] != raw[:, None, :])).sum()) // 2


@pytest.mark.parametrize("score", ["key_norm", "prefix_kv_diff"])
def test_the_default_model_decodes_what_its_full_forward_chose_on_repeated_text(default_model_and_tokenizer, score):
    base, tokenizer = default_model_and_tokenizer
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > 40 and ids[0].unique().numel() < ids.shape[1] * 0.6  # real text, many repeats
    spelling = f"x/1 + softmax window 4 + sinks 1 + sparse 4 ({score})"
    pairs = _assert_decoding_chooses_what_the_full_forward_chose(copy.deepcopy(base), ids, spelling,
                                                                 layers=(0, 1, 15, 29), atol=DEFAULT_MODEL_ATOL)
    if score == "key_norm":
        assert _tied_pairs(*pairs[0]) >= 10  # the repeated tokens' keys at the first layer


@pytest.mark.parametrize("score", ["key_norm", "prefix_kv_diff", "value_over_key"])
def test_a_qk_norm_model_decodes_what_its_full_forward_chose_on_repeated_text(score):
    """Qwen3 (QK-norm, its norms' weights at 1): every key has the norm ``sqrt(D)`` up to rounding, so under
    ``key_norm`` every pair ties and the cache keeps the oldest; the text is its bytes (a vocabulary of 128)."""
    ids = torch.tensor([list(TEXT.encode("ascii"))])
    model = tiny_model("qwen3")
    spelling = f"x/1 + softmax window 4 + sinks 1 + sparse 4 ({score})"
    pairs = _assert_decoding_chooses_what_the_full_forward_chose(model, ids, spelling, layers=(0, 1))
    if score == "key_norm":
        assert all(_tied_pairs(*layer) >= 100 for layer in pairs)
