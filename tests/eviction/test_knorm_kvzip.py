"""KVzip's context-reconstruction score (arXiv 2505.23416): the max-weight kernel against materialized weights, the
reconstruction's inputs, the importance and the kept set against the weights of Transformers' eager attention (fp64
tiny models: GQA llama, QK-norm qwen3, gemma3's sliding + full layers), generation end to end, and the refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from knorm_helpers import NEW, greedy, knorm_model, word_text, word_tokenizer
from tiny_models import tiny_model
from transformers import DynamicCache, pipeline

from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.budgets import head_adaptive_keep
from hf_knorm.eviction.cache import KNormCache, KNormLayer, kept_count
from hf_knorm.eviction.max_weight import attention_with_max_weights
from hf_knorm.eviction.pipeline import answer_after_context, encode_prompt, generate_after, knorm_generate
from hf_knorm.eviction.reconstruction import (FIRST_PROMPT, NEXT_PROMPT, _scoring, _Scoring,
                                              compress_by_reconstruction, reconstruction_chunks,
                                              reconstruction_importance, reconstruction_prompt)
from hf_knorm.eviction import ragged
from hf_knorm.eviction.ragged import RAGGED_ATTENTION
from hf_knorm.eviction.reference import reference_global_kept, reference_kvzip_importance, reference_max_weights
from hf_knorm.eviction.scores import KVzip, resolve_score, score_spelling

CONTEXT = 20
TEMPLATE = ("{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
            "{% if add_generation_prompt %} w5 w6{% endif %}")  # a chat template of the word tokenizer


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def fp64_model(model_type: str, attn_implementation: str = "sdpa"):
    model = knorm_model(model_type).double()
    model.set_attn_implementation(attn_implementation)
    return model


def context_ids(batch: int = 2, length: int = CONTEXT, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- the kernel -------------------------------------------------------------------------------------------------------
def sdpa_reference(query, key, value, mask, scaling=None):
    """PyTorch's SDPA on the keys and values repeated for the group (Transformers' ``repeat_kv`` order)."""
    group = query.shape[1] // key.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=mask, scale=scaling)


def qkv(group: int, rows: int = 9, length: int = 23, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = 2 * torch.randn(2, 2 * group, rows, 8, generator=generator, dtype=dtype)
    key = 2 * torch.randn(2, 2, length, 8, generator=generator, dtype=dtype)
    return query, key, torch.randn(2, 2, length, 6, generator=generator, dtype=dtype)  # D_v != D


def causal(rows: int, length: int, batch: int = 2) -> torch.Tensor:
    """Transformers' sdpa_mask for ``rows`` queries after ``length - rows`` cached keys: (B, 1, m, L) bool."""
    return torch.ones(rows, length, dtype=torch.bool).tril(diagonal=length - rows).expand(batch, 1, rows, length)


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 4, 7, None])
def test_fused_attention_equals_sdpa_and_the_materialized_softmax(group, rows):
    query, key, value = qkv(group)
    mask = causal(9, 23)
    padded = mask.clone()
    padded[1, :, :, :3] = False  # row 1 left-padded by 3 keys
    for scored, scaling, attention_mask in ((14, None, mask), (5, 0.7, mask), (23, None, mask), (14, None, padded)):
        out, importance = attention_with_max_weights(query, key, value, attention_mask, scored, scaling, rows=rows)
        assert out.dtype == importance.dtype == torch.float64
        assert out.shape == (2, 2 * group, 9, 6) and importance.shape == (2, 2, scored)
        torch.testing.assert_close(out, sdpa_reference(query, key, value, attention_mask, scaling), atol=1e-12,
                                   rtol=1e-10)
        torch.testing.assert_close(importance, reference_max_weights(query, key, scored, scaling, attention_mask),
                                   atol=1e-13, rtol=1e-12)
    assert float(importance[1, :, :3].abs().max()) == 0  # padding: seen by no row
    # no mask: causal with the queries at the end, as the mask above; the additive form of the mask gives the same
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~padded, torch.finfo(torch.float64).min)
    for same, other in (((mask, None), (mask, mask)), ((padded, None), (additive, None))):
        want = attention_with_max_weights(query, key, value, same[0], 14, rows=rows)
        got = attention_with_max_weights(query, key, value, other[0], 14, rows=rows)
        torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-12)
    # not causal: every key
    out, importance = attention_with_max_weights(query, key, value, None, 23, is_causal=False, rows=rows)
    torch.testing.assert_close(out, sdpa_reference(query, key, value, None), atol=1e-12, rtol=1e-10)
    every = torch.ones(1, 1, 9, 23, dtype=torch.bool)
    torch.testing.assert_close(importance, reference_max_weights(query, key, 23, None, every), atol=1e-13, rtol=1e-12)
    # the rows see their own keys causally: with the last query attending one huge own key, its weights vanish
    key[:, :, -1] = 50 * query[:, ::group, -1]
    assert float(attention_with_max_weights(query, key, value, mask, 14, rows=rows)[1][..., 0].min()) > 0


def test_fused_attention_in_fp32_and_bf16_fully_masked_rows_and_refusals():
    query, key, value = qkv(2, dtype=torch.float32)
    mask = causal(9, 23)
    out, importance = attention_with_max_weights(query, key, value, mask, 14)
    assert out.dtype == importance.dtype == torch.float32
    torch.testing.assert_close(out, sdpa_reference(query, key, value, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(importance.double(), reference_max_weights(query, key, 14), atol=1e-6, rtol=1e-5)
    low = [t.bfloat16() for t in (query, key, value)]
    out, importance = attention_with_max_weights(*low, mask, 14)  # fp32 softmax; the output rounded to bf16 once
    assert out.dtype == torch.bfloat16 and importance.dtype == torch.float32
    exact = sdpa_reference(*[t.double() for t in low], mask)
    torch.testing.assert_close(out.double(), exact, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(importance.double(), reference_max_weights(*low[:2], 14), atol=1e-6, rtol=1e-5)
    hidden = mask.clone()
    hidden[0, :, 2] = False  # a fully masked row gives zeros, as SDPA does
    out, importance = attention_with_max_weights(query, key, value, hidden, 14)
    torch.testing.assert_close(out, sdpa_reference(query, key, value, hidden), atol=1e-5, rtol=1e-5)
    assert float(out[0, :, 2].abs().max()) == 0
    hidden[1, :, 2] = False  # and a block of one row that no batch row lets see a key: zeros, the others unchanged
    for got, want in zip(attention_with_max_weights(query, key, value, hidden, 14, rows=1),
                         attention_with_max_weights(query, key, value, hidden, 14)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="scored <= L"):
        attention_with_max_weights(query, key, value, mask, 24)
    with pytest.raises(ValueError, match="evenly"):
        attention_with_max_weights(torch.randn(2, 3, 9, 8), key, value, mask, 14)
    with pytest.raises(ValueError, match="shared by the heads"):
        attention_with_max_weights(query, key, value, mask.expand(2, 4, 9, 23), 14)


# --- the reconstruction's inputs --------------------------------------------------------------------------------------
def test_chunks_follow_the_authors_prompts():
    tokenizer = word_tokenizer()
    prompt = reconstruction_prompt(tokenizer)  # no chat template: the user turn is the text, "\n" ends it
    encode = lambda text: tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(prompt.first_ids, encode("\n\n" + FIRST_PROMPT))
    assert torch.equal(prompt.next_ids, encode("\n\n" + NEXT_PROMPT)) and prompt.prefix_ids.numel() == 0
    ids = context_ids(length=12)
    chunks = reconstruction_chunks(ids, prompt, chunk_size=5, tail=2)
    suffix = prompt.suffix_ids.expand(2, -1)
    assert [c.shape[1] for c in chunks] == [prompt.first_ids.shape[1] + suffix.shape[1] + 5,
                                            prompt.next_ids.shape[1] + 2 + suffix.shape[1] + 5,
                                            prompt.next_ids.shape[1] + 2 + suffix.shape[1] + 2]
    assert torch.equal(chunks[0], torch.cat([prompt.first_ids.expand(2, -1), suffix, ids[:, :5]], dim=1))
    assert torch.equal(chunks[2], torch.cat([prompt.next_ids.expand(2, -1), ids[:, 8:10], suffix, ids[:, 10:]], dim=1))

    tokenizer.chat_template = TEMPLATE  # the template's prefix is not repeated; its assistant header ends the prompt
    prompt = reconstruction_prompt(tokenizer)
    assert prompt.prefix_ids.tolist() == [[1]] and prompt.suffix_ids.tolist() == [[2, 5, 6]]
    with_prefix = torch.cat([torch.ones(2, 1, dtype=torch.long), ids], dim=1)
    chunks = reconstruction_chunks(with_prefix, prompt, chunk_size=100, tail=8)
    assert torch.equal(chunks[0], torch.cat([prompt.first_ids.expand(2, -1), prompt.suffix_ids.expand(2, -1), ids], 1))
    plain = reconstruction_prompt(tokenizer, chat_template=False)  # the prefix token is then repeated too
    assert torch.equal(reconstruction_chunks(with_prefix, plain, 100, 8)[0],
                       torch.cat([plain.first_ids.expand(2, -1), plain.suffix_ids.expand(2, -1), with_prefix], 1))


# --- importance and kept set against eager attention's weights --------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_importance_and_kept_set_equal_the_eager_weights_reference(model_type):
    model = fp64_model(model_type)
    ids = context_ids()
    chunks = reconstruction_chunks(ids, reconstruction_prompt(word_tokenizer()), chunk_size=8, tail=3)
    assert len(chunks) == 3  # chunked: every chunk attends the whole context
    cache = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    assert all(layer.keys.shape[-2] == CONTEXT for layer in cache.layers if isinstance(layer, KNormLayer))
    importance = reconstruction_importance(model, cache, chunks)

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = reference_kvzip_importance(eager, ids, chunks)
    scored = [i for i, layer in enumerate(cache.layers) if isinstance(layer, KNormLayer)]
    assert sorted(importance) == scored and scored  # gemma3: the sliding layer is not scored
    keep = kept_count(CONTEXT, 0.5)
    cache.compress_prompts(importance)
    for index in scored:
        assert importance[index].dtype == torch.float64
        # eager attention returns its softmax in fp32: the reference is exact to ~1e-7
        torch.testing.assert_close(importance[index], reference[index], atol=1e-6, rtol=1e-6)
        ranked = reference[index].sort(dim=-1, descending=True, stable=True)
        assert float((ranked.values[..., keep - 1] - ranked.values[..., keep]).min()) > 1e-5  # no near-tie at the cut
        assert torch.equal(cache.kept_positions(index), ranked.indices[..., :keep].sort(dim=-1).values)


def reconstruction_logits(model, ids, chunk, scored=None):
    """The logits of one reconstruction forward of ``chunk`` after ``ids`` prefilled into a plain cache: under the
    model's own attention, or (``scored``: layer index -> prompt length) under the scoring ``knorm_capture`` attention,
    with the importance it gathered."""
    cache = model(input_ids=ids, **cache_kwargs(DynamicCache()), use_cache=True).past_key_values
    if scored is None:
        return model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).logits, None
    scoring = _Scoring(scored)
    with _scoring(model, scoring):
        logits = model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).logits
    return logits, scoring.importance


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_the_scoring_attention_gives_the_sdpa_forward(model_type):
    """The reconstruction's forward through the one-pass attention (scored layers) and Transformers' SDPA (gemma3's
    sliding layer) gives the logits of the model under SDPA: fp64, 1e-10."""
    model = fp64_model(model_type)
    ids = context_ids()
    (chunk,) = reconstruction_chunks(ids, reconstruction_prompt(word_tokenizer()), chunk_size=64, tail=3)
    cache = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    scored = {layer.layer_idx: CONTEXT for layer in cache.layers if isinstance(layer, KNormLayer)}
    want, _ = reconstruction_logits(model, ids, chunk)
    got, importance = reconstruction_logits(model, ids, chunk, scored)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert sorted(importance) == sorted(scored) and model.config._attn_implementation == "sdpa"


def test_the_scoring_attention_on_the_default_model(default_model_and_tokenizer):
    """SmolLM2-135M-Instruct in fp32, a 1-chunk reconstruction of the sample text in its chat template: the logits of
    the forward equal SDPA's to 1e-4 (fp32 rounding through 30 layers), the importance equals the eager attention's
    weights to 1e-6."""
    from hf_knorm.assets.texts import SAMPLE_TEXT

    model, tokenizer = default_model_and_tokenizer
    ids = encode_prompt(tokenizer, SAMPLE_TEXT, "?")[0]
    (chunk,) = reconstruction_chunks(ids, reconstruction_prompt(tokenizer), chunk_size=2048, tail=8)
    scored = dict.fromkeys(range(model.config.num_hidden_layers), ids.shape[1])
    want, _ = reconstruction_logits(model, ids, chunk)
    got, importance = reconstruction_logits(model, ids, chunk, scored)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = reference_kvzip_importance(eager, ids, [chunk])
    for index in scored:
        torch.testing.assert_close(importance[index].double(), reference[index], atol=1e-6, rtol=1e-4)


def test_batch_rows_are_scored_independently():
    model = fp64_model("llama")
    ids = context_ids(batch=2)
    prompt = reconstruction_prompt(word_tokenizer())
    batched = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=ids, **cache_kwargs(batched), use_cache=True)
    together = reconstruction_importance(model, batched, reconstruction_chunks(ids, prompt, 8, 3))
    for row in range(2):
        alone = KNormCache(0.5, score="kvzip", config=model.config)
        model(input_ids=ids[row:row + 1], **cache_kwargs(alone), use_cache=True)
        single = reconstruction_importance(model, alone, reconstruction_chunks(ids[row:row + 1], prompt, 8, 3))
        for index in together:
            torch.testing.assert_close(together[index][row:row + 1], single[index], atol=1e-12, rtol=1e-10)


def _reference_greedy(model, prompt_ids, kept, new):
    """Greedy decoding from a plain cache holding the prefill of ``prompt_ids[:, :-1]`` cut to ``kept`` positions
    (per layer (B, H_kv, k)), the last prompt token then fed at its true position (what knorm_generate does)."""
    n = prompt_ids.shape[1] - 1
    full = model(input_ids=prompt_ids[:, :-1], **cache_kwargs(DynamicCache()), use_cache=True).past_key_values
    data = []
    for layer, index in zip(full.layers, kept):
        gather = index[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        data.append((layer.keys.gather(2, gather), layer.values.gather(2, gather)))
    cache, token, tokens = DynamicCache(data), prompt_ids[:, -1:], []
    for step in range(new):
        position = torch.full_like(token, n + step)
        out = model(input_ids=token, position_ids=position, **cache_kwargs(cache), use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def test_knorm_generate_decodes_from_the_reference_kept_set():
    model = fp64_model("llama")
    tokenizer = word_tokenizer()
    ids = context_ids(batch=1, length=CONTEXT + 1)
    out = knorm_generate(model, ids, compression_ratio=0.5, score=KVzip(chunk_size=8, tail=3), tokenizer=tokenizer,
                         max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    chunks = reconstruction_chunks(ids[:, :-1], reconstruction_prompt(tokenizer), 8, 3)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    keep = kept_count(CONTEXT, 0.5)
    kept = [r.sort(dim=-1, descending=True, stable=True).indices[..., :keep].sort(dim=-1).values
            for r in reference_kvzip_importance(eager, ids[:, :-1], chunks)]
    assert torch.equal(out[:, ids.shape[1]:], _reference_greedy(model, ids, kept, NEW))
    uniform = knorm_generate(model, ids, compression_ratio=0.5, tokenizer=tokenizer, max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.shape == uniform.shape


def test_pipeline_runs_the_reconstruction_with_the_chat_template():
    model = fp64_model("llama")
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    context, question = word_text(CONTEXT, seed=4), word_text(3, seed=5)
    generate = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(context, question=question, compression_ratio=0.5, score="kvzip", **generate)["answer"]

    context_ids, question_ids = encode_prompt(tokenizer, context, question)
    assert context_ids[0, 0] == 1  # the template's prefix belongs to the compressed context
    cache = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=context_ids, **cache_kwargs(cache), use_cache=True)
    importance = compress_by_reconstruction(model, cache, context_ids, tokenizer)
    expected = answer_after_context(model, KNormCache(0.5, score="kvzip", config=model.config), context_ids,
                                    question_ids, tokenizer=tokenizer, pad_token_id=0, **generate)
    assert answer == tokenizer.decode(expected[0], skip_special_tokens=True).strip()
    keep = kept_count(context_ids.shape[1], 0.5)
    for index, scores in importance.items():  # the prefix token is scored too (it is in the cache)
        assert scores.shape[-1] == context_ids.shape[1]
        assert torch.equal(cache.kept_positions(index),
                           scores.topk(keep, dim=-1).indices.sort(dim=-1).values)


def test_head_budgets_and_protections_apply_to_the_reconstruction_score():
    model = fp64_model("llama")
    tokenizer = word_tokenizer()
    ids = context_ids(batch=1)
    chunks = reconstruction_chunks(ids, reconstruction_prompt(tokenizer), 8, 3)
    plain = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=ids, **cache_kwargs(plain), use_cache=True)
    importance = reconstruction_importance(model, plain, chunks)

    heads = KNormCache(0.5, score=KVzip(chunk_size=8, tail=3), head_budget="heads", config=model.config)
    model(input_ids=ids, **cache_kwargs(heads), use_cache=True)
    compress_by_reconstruction(model, heads, ids, tokenizer)
    keep = kept_count(CONTEXT, 0.5)
    for index, scores in importance.items():
        chosen = head_adaptive_keep(-scores, keep, 0.2)
        positions, valid = heads.layers[index].padded()[2:]
        assert torch.equal(positions[valid], torch.arange(CONTEXT).expand_as(chosen)[chosen])

    protected = KNormCache(budget=6, sink_tokens=2, recent_window=2, score=KVzip(chunk_size=8, tail=3),
                           config=model.config)
    model(input_ids=ids, **cache_kwargs(protected), use_cache=True)
    compress_by_reconstruction(model, protected, ids, tokenizer)
    for index, scores in importance.items():
        free = scores[..., 2:CONTEXT - 2].topk(2, dim=-1).indices + 2
        expected = torch.cat([torch.tensor([0, 1, CONTEXT - 2, CONTEXT - 1]).expand(1, 2, 4), free], -1)
        assert torch.equal(protected.kept_positions(index), expected.sort(dim=-1).values)


def test_layer_ratios_and_schedules_apply_to_the_reconstruction_score():
    model = fp64_model("llama")
    tokenizer = word_tokenizer()
    ids = context_ids(batch=1)
    score = KVzip(chunk_size=8, tail=3)
    ratios = KNormCache(layer_ratios={0: 0.0, 1: 0.75}, score=score, config=model.config)
    model(input_ids=ids, **cache_kwargs(ratios), use_cache=True)
    importance = compress_by_reconstruction(model, ratios, ids, tokenizer)
    assert ratios.kept_positions(0).tolist() == [[list(range(CONTEXT))] * 2]
    keep = kept_count(CONTEXT, 0.75)
    assert torch.equal(ratios.kept_positions(1), importance[1].topk(keep, dim=-1).indices.sort(dim=-1).values)
    question = torch.tensor([[5, 6, 7]])  # per-layer counts: the question goes one token at a time
    out = generate_after(model, ratios, ids, question, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 3) and ratios.stored_tokens() == [CONTEXT + 5, keep + 5]

    dispersion = KNormCache(0.5, score=score, layer_budget="dispersion", config=model.config)
    model(input_ids=ids, **cache_kwargs(dispersion), use_cache=True)
    compress_by_reconstruction(model, dispersion, ids, tokenizer)
    counts = dispersion.stored_tokens()
    assert sum(counts) == 2 * kept_count(CONTEXT, 0.5)
    for index, count in enumerate(counts):  # each layer keeps its share, chosen by the reconstruction's importance
        assert torch.equal(dispersion.kept_positions(index),
                           importance[index].topk(count, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("floor, sinks", [(0.0, 0), (0.5, 2)])
def test_the_global_budget_keeps_the_best_pairs_of_the_whole_cache(floor, sinks):
    """``layer_budget="global"`` (KVzip's pair-level eviction): the kept pairs are the plain-loop reference's (one
    threshold over every layer and head, each head's floor first, protected tokens kept), the total is the ratio's,
    the heads keep different counts, and decoding goes on from the ragged store."""
    ragged.register()
    model = fp64_model("llama", RAGGED_ATTENTION)
    tokenizer = word_tokenizer()
    ids = context_ids(batch=1)
    cache = KNormCache(0.5, score=KVzip(chunk_size=8, tail=3), head_budget="heads", head_floor=floor,
                       layer_budget="global", sink_tokens=sinks, config=model.config)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    importance = compress_by_reconstruction(model, cache, ids, tokenizer)
    expected = reference_global_kept([importance[index] for index in sorted(importance)], 0.5, floor,
                                     sink_tokens=sinks)
    counts = []
    for index in sorted(importance):
        positions = cache.kept_positions(index)
        assert [[[p for p in head if p >= 0] for head in row] for row in positions.tolist()] == expected[index]
        counts += cache.stored_per_head(index).flatten().tolist()
    assert sum(counts) == len(importance) * 2 * kept_count(CONTEXT, 0.5) and len(set(counts)) > 1
    assert min(counts) >= max(sinks, math.ceil(floor * kept_count(CONTEXT, 0.5)))
    out = generate_after(model, cache, ids, torch.tensor([[5, 6]]), max_new_tokens=3, min_new_tokens=3,
                         do_sample=False, pad_token_id=0)
    assert out.shape == (1, 3) and cache.get_seq_length() == CONTEXT + 2 + 2


def test_balancing_changes_no_kvzip_choice():
    """K/V balancing folds ``s`` into the key and query projections, so ``q k^T`` and the reconstruction's weights
    do not change: a balanced model keeps the unbalanced model's pairs, in either score basis."""
    from tiny_models import tiny_inputs

    import hf_knorm
    from hf_knorm.eviction.pipeline import knorm_cache_for

    model = knorm_model("llama")
    balanced = copy.deepcopy(model)
    calibration = [tiny_inputs("llama", batch=1, length=64, seed=s) for s in range(2)]
    hf_knorm.balance_kv(balanced, None, calibration, mode="channel", alpha=1.0, progress=False, min_tokens=1)
    assert hf_knorm.balancing.balance.key_scales(balanced.config) is not None
    ids = context_ids(batch=1)
    results = {}
    for name, m in (("plain", model.double()), ("balanced", balanced.double())):
        for basis in ("cached", "original"):
            cache = knorm_cache_for(m, score_basis=basis, compression_ratio=0.5, score=KVzip(chunk_size=8, tail=3))
            m(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            importance = compress_by_reconstruction(m, cache, ids, word_tokenizer())
            results[name, basis] = importance, [cache.kept_positions(i) for i in sorted(importance)]
    plain, kept = results["plain", "cached"]
    for key, (importance, positions) in results.items():
        for index in importance:
            torch.testing.assert_close(importance[index], plain[index], atol=1e-6, rtol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(positions, kept)), key


# --- names and refusals -----------------------------------------------------------------------------------------------
def test_spelling_and_refusals():
    assert resolve_score("kvzip") == KVzip() and resolve_score("kvzip+chunk_size512") == KVzip(chunk_size=512)
    assert score_spelling(KVzip(tail=4)) == "kvzip+tail4"
    with pytest.raises(ValueError, match="chunk_size"):
        KVzip(chunk_size=0)
    with pytest.raises(ValueError, match="decoding_budget"):
        KNormCache(0.5, score="kvzip", decoding_budget=8)
    model = knorm_model("llama")
    ids = context_ids(batch=1)
    cache = KNormCache(0.5, score="kvzip", config=model.config)
    with pytest.raises(ValueError, match="never compress"):  # generate without the reconstruction: refused, loudly
        greedy(model, ids, cache)
    with pytest.raises(ValueError, match="tokenizer"):
        knorm_generate(model, ids, compression_ratio=0.5, score="kvzip", max_new_tokens=2)
    with pytest.raises(ValueError, match="reconstruction pass"):
        KVzip()(None, None, None, 0)
    cache = KNormCache(0.5, score="kvzip", config=model.config)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    compress_by_reconstruction(model, cache, ids, word_tokenizer())
    with pytest.raises(ValueError, match="once"):
        compress_by_reconstruction(model, cache, ids, word_tokenizer())
    with pytest.raises(ValueError, match="deferred score"):
        KNormCache(0.5, config=model.config).compress_prompts({})
    gemma2 = tiny_model("gemma2")
    cache = KNormCache(0.5, score="kvzip", config=gemma2.config)
    gemma2(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    with pytest.raises(ValueError, match="softcap"):
        compress_by_reconstruction(gemma2, cache, ids, word_tokenizer())
    assert gemma2.config._attn_implementation == "eager"  # given back after the error


def test_perplexity_through_a_kvzip_cache_reconstructs_each_context_once(monkeypatch):
    """``perplexity_after_compression`` with KVzip rows: each ratio's loss equals a KVzip cache prefilled,
    compressed by its own reconstruction and read teacher-forced; the reconstruction runs once per window."""
    from hf_knorm.evaluation.perplexity import perplexity_after_compression
    from hf_knorm.eviction import reconstruction

    model, tokenizer = knorm_model("llama"), word_tokenizer()
    windows = [tokenizer(word_text(30, seed=seed), return_tensors="pt")["input_ids"][0] for seed in (11, 12)]
    context, score = 20, "kvzip+chunk_size8"
    variants = {f"r={ratio}": {"compression_ratio": ratio, "score": score} for ratio in (0.25, 0.5)}
    calls = []
    scores = reconstruction.reconstruction_scores
    monkeypatch.setattr(reconstruction, "reconstruction_scores", lambda *args: calls.append(1) or scores(*args))
    results = perplexity_after_compression(model, windows, context, variants, progress=False, tokenizer=tokenizer)
    assert len(calls) == len(windows)
    for name, options in variants.items():
        total = 0.0
        with torch.no_grad():
            for ids in windows:
                cache = KNormCache(options["compression_ratio"], score=score, config=model.config)
                model(input_ids=ids[None, :context], **cache_kwargs(cache), use_cache=True)
                reconstruction.compress_by_reconstruction(model, cache, ids[None, :context], tokenizer)
                logits = model(input_ids=ids[None, context:], **cache_kwargs(cache), use_cache=True).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits, ids[context + 1:], reduction="sum").item()
        assert results[name].nll == pytest.approx(total / results[name].tokens, rel=1e-5), name
    assert results["r=0.25"].nll != pytest.approx(results["r=0.5"].nll, rel=1e-6)  # each ratio its own cache
    with pytest.raises(ValueError, match="pass tokenizer="):
        perplexity_after_compression(model, windows, context, variants, progress=False)
