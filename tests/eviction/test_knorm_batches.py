"""Padded batches and ``crop`` for KNormCache (issue 65, item 2): a left-padded batch of prompts of different lengths
gives each row what its prompt gives alone (same greedy tokens, logits within 1e-4 in fp32 on the CPU, the same kept
positions), through ``knorm_generate``, ``model.generate`` and the pipeline; ``crop`` is exact for tokens appended
after the last eviction and refused, naming why, otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from knorm_helpers import NO_EOS, kept_lists, knorm_model, tiny_pipeline, word_text, word_tokenizer
from transformers import DynamicCache

from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.cache import KNormCache, kept_count
from hf_knorm.eviction.pipeline import answer_questions, knorm_cache_for, knorm_generate
from hf_knorm.eviction.ragged import ragged_attention_for
from hf_knorm.eviction.rows import left_pad, live_mask

LENGTHS = (21, 12, 17)  # the first is the longest: rows 1 and 2 are padded
ATOL = 1e-4  # fp32 on the CPU: a padded batch sums in another order than a single row (seen: <= 2e-6)
NEW = 5


def _config(model, **extra):
    config = copy.deepcopy(model.generation_config)
    config.update(**{**dict(eos_token_id=NO_EOS, pad_token_id=0, max_new_tokens=NEW, do_sample=False,
                            output_logits=True, return_dict_in_generate=True), **extra})
    return config


def _prompts(lengths=LENGTHS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (n,), generator=generator) for n in lengths]


def _assert_rows_equal_alone(model, prompts, generate_one, generate_batch):
    """``generate_batch(ids, mask)`` on the left-padded prompts against ``generate_one(ids)`` on each (each returns
    ``(output, cache or None)``): tokens equal, every step's logits within ATOL, and with the caches the kept positions
    of every KNorm layer equal (each row's real slots)."""
    ids, mask = left_pad(prompts, pad_id=0)
    batch, batch_cache = generate_batch(ids, mask)
    width = ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone, alone_cache = generate_one(prompt[None])
        assert torch.equal(batch.sequences[row, width:], alone.sequences[0, prompt.numel():])
        for step_batch, step_alone in zip(batch.logits, alone.logits, strict=True):
            torch.testing.assert_close(step_batch[row], step_alone[0], atol=ATOL, rtol=0)
        for index, layer in enumerate(alone_cache.layers if alone_cache is not None else []):
            if getattr(layer, "row_lengths", 0) is None and hasattr(layer, "positions"):  # a KNorm layer
                kept = batch_cache.kept_positions(index)[row]
                real = kept[kept >= 0].reshape(kept.shape[0], -1)
                assert torch.equal(real, alone_cache.kept_positions(index)[0])


@pytest.mark.parametrize("options", [dict(score="key_norm"), dict(score="kv_diff"),
                                     dict(score="kv_diff", decoding_budget=9, sink_tokens=2),
                                     dict(score="recent", recent_window=3), dict(score="random")],
                         ids=["key_norm", "kv_diff", "kv_diff-decoding_budget", "recent", "random"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])  # GQA; QK-norm; QK-norm and sliding
def test_knorm_generate_on_a_padded_batch_equals_each_prompt_alone(model_type, options):
    model = knorm_model(model_type)
    config = _config(model)

    def run(ids, mask=None):
        out = knorm_generate(model, ids, mask, compression_ratio=0.5, generation_config=config, **options)
        return out, None

    _assert_rows_equal_alone(model, _prompts(), run, run)
    assert model.config._attn_implementation == "sdpa"  # given back


@pytest.mark.parametrize("options", [dict(compression_ratio=0.5), dict(budget=8, score="kv_diff", recent_window=2),
                                     dict(compression_ratio=0.6, layer_ratios={0: 0.0})])
def test_model_generate_keeps_each_rows_own_tokens(options):
    """``model.generate`` with a KNormCache under the knorm_ragged attention: every row keeps the positions it keeps
    alone (a row's budget is of its own length; padding never kept), per-layer ratios included."""
    model = knorm_model("llama")
    config = _config(model)

    def run(ids, mask=None):
        cache = KNormCache(config=model.config, **options)
        mask = torch.ones_like(ids) if mask is None else mask
        with ragged_attention_for(model, cache, padded=True):
            return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(cache),
                                  generation_config=config), cache

    _assert_rows_equal_alone(model, _prompts(), run, run)
    ids, mask = left_pad(_prompts(), pad_id=0)
    cache = run(ids, mask)[1]
    counts = cache.stored_per_head(1)[:, 0].tolist()  # layer 1 is compressed: each row its own count
    if "budget" in options:
        assert counts == [8 + NEW - 1] * 3
    else:
        assert counts == [kept_count(n, options["compression_ratio"]) + NEW - 1 for n in LENGTHS]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_kvzip_on_a_padded_batch_reconstructs_each_row_alone(model_type):
    model = knorm_model(model_type)
    tokenizer = word_tokenizer()
    config = _config(model)
    prompts = [tokenizer(word_text(n, seed=n), return_tensors="pt")["input_ids"][0] for n in LENGTHS]

    def run(ids, mask=None):
        out = knorm_generate(model, ids, mask, compression_ratio=0.5, score="kvzip", tokenizer=tokenizer,
                             chat_template=False, generation_config=config)
        return out, None

    _assert_rows_equal_alone(model, prompts, run, run)


@pytest.mark.parametrize("options", [dict(score="kv_diff"), dict(score="kv_diff", head_budget="heads", head_floor=0.0)],
                         ids=["uniform", "heads"])
def test_padded_questions_after_padded_contexts(options):
    """The kvpress protocol on a batch: contexts and questions of different lengths, both left-padded (the
    questions' padding lands in the middle of each row), each row answered as alone; several questions too. Head
    budgets take the questions one token per forward, a row's padding token read as padding (not kept)."""
    model = knorm_model("qwen3")
    contexts, questions = _prompts((19, 11, 15)), _prompts((3, 6, 1), seed=2)
    others = _prompts((4, 2, 5), seed=3)
    generate = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    context_ids, context_mask = left_pad(contexts, 0)
    question_ids, question_mask = left_pad(questions, 0)
    other_ids, other_mask = left_pad(others, 0)
    cache = knorm_cache_for(model, compression_ratio=0.5, **options)
    batch = answer_questions(model, cache, context_ids, [question_ids, other_ids], context_mask=context_mask,
                             question_masks=[question_mask, other_mask], **generate)
    for row in range(3):
        alone = answer_questions(model, knorm_cache_for(model, compression_ratio=0.5, **options),
                                 contexts[row][None], [questions[row][None], others[row][None]], **generate)
        assert all(torch.equal(b[row], a[0]) for b, a in zip(batch, alone, strict=True))


@pytest.mark.parametrize("options", [dict(), dict(head_budget="heads", head_floor=0.0)], ids=["uniform", "heads"])
def test_beam_search_on_a_padded_batch_equals_each_prompt_alone(options):
    """Beam search on a padded batch: the rows are expanded to beams before the prompt (each beam a padded row of
    its own) and reordered within a row after it (``reorder_cache``; the head budgets' store repacks its rows); every
    row's best beam is the one alone."""
    model = knorm_model("llama")
    config = _config(model, num_beams=3, output_logits=False)

    def run(ids, mask=None):
        return knorm_generate(model, ids, mask, compression_ratio=0.5, score="kv_diff", generation_config=config,
                              **options)

    prompts = _prompts()
    ids, mask = left_pad(prompts, pad_id=0)
    batch = run(ids, mask)
    for row, prompt in enumerate(prompts):
        assert torch.equal(batch.sequences[row, ids.shape[1]:], run(prompt[None]).sequences[0, prompt.numel():])


def test_the_live_mask():
    live = torch.tensor([[False, True, True, True, True], [True, True, False, True, False]])
    mask = live_mask(live, 2)  # two stored slots then a 2-token step
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    assert mask[1, 0].tolist() == [[True, True, False, True, False], [True, True, False, True, False]]


def test_padded_batches_are_refused_where_they_cannot_be_exact():
    model = knorm_model("llama")
    ids, mask = left_pad(_prompts(), pad_id=0)
    generate = dict(max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="knorm_ragged"):  # Transformers' mask does not describe the rows
        model.generate(input_ids=ids, attention_mask=mask, cache=KNormCache(0.5, config=model.config), **generate)
    model.set_attn_implementation("knorm_ragged")  # what the error says: the name is registered by then
    try:
        model.generate(input_ids=ids, attention_mask=mask, cache=KNormCache(0.5, config=model.config), **generate)
    finally:
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="config=model.config"):
        model.generate(input_ids=ids, attention_mask=mask, cache=KNormCache(0.5), **generate)
    contexts = torch.stack([prompt[:12] for prompt in _prompts()])  # unpadded contexts, then padded questions
    with pytest.raises(ValueError, match="head budgets"):  # an unpadded per-head store would keep their padding
        answer_questions(model, knorm_cache_for(model, compression_ratio=0.5, head_budget="heads"), contexts, [ids],
                         question_masks=[mask], **generate)
    for budgets in (dict(layer_budget="skip_first"), dict(layer_budget="dispersion", head_budget="heads")):
        with pytest.raises(ValueError, match=f"layer_budget='{budgets['layer_budget']}'"):
            knorm_generate(model, ids, mask, compression_ratio=0.5, **budgets, **generate)
    import hf_knorm

    patched = hf_knorm.patch(knorm_model("llama"), normalization="x^3/16")
    with pytest.raises(ValueError, match="patched with x\\^3/16"):  # knorm_ragged would drop the patch
        knorm_generate(patched, ids, mask, compression_ratio=0.5, **generate)
    right = torch.flip(mask, dims=[1])  # right padding: refused from the mask, and from the position ids
    with pytest.raises(ValueError, match="left-padded"):
        knorm_generate(model, ids, right, compression_ratio=0.5, **generate)
    cache = KNormCache(0.5, config=model.config)
    with ragged_attention_for(model, cache, padded=True), pytest.raises(ValueError, match="not left-padded"):
        model.generate(input_ids=ids, attention_mask=right, **cache_kwargs(cache), **generate)


HEAD_BUDGETS = [dict(score="kv_diff", head_budget="heads"), dict(score="key_norm", head_budget="heads", head_floor=0.0),
                dict(score="kvzip", head_budget="heads", layer_budget="global", head_floor=0.0)]


@pytest.mark.parametrize("options", HEAD_BUDGETS, ids=["heads", "heads-floor0", "kvzip-global"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # GQA; QK-norm
def test_head_budgets_on_a_padded_batch_equal_each_prompt_alone(model_type, options):
    """``head_budget="heads"`` (and KVzip's ``layer_budget="global"``) on a left-padded batch: each row keeps, head by
    head, the positions it keeps alone (its own length's budget, ranked over every layer under the global one),
    and generates the same tokens, logits within ATOL, through ``model.generate`` and ``knorm_generate``."""
    from hf_knorm.eviction.reconstruction import compress_by_reconstruction

    model = knorm_model(model_type)
    config = _config(model)
    tokenizer = word_tokenizer()
    prompts = [tokenizer(word_text(n, seed=n), return_tensors="pt")["input_ids"][0] for n in LENGTHS]
    text = dict(tokenizer=tokenizer, chat_template=False)
    run = lambda ids, mask=None: (knorm_generate(model, ids, mask, compression_ratio=0.5,  # noqa: E731
                                                 generation_config=config, **text, **options), None)
    _assert_rows_equal_alone(model, prompts, run, run)

    def cache_after_prompt(ids, mask):
        cache = knorm_cache_for(model, compression_ratio=0.5, **options)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad(), ragged_attention_for(model, cache, padded=True):
            model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
            if cache.settings.deferred:
                compress_by_reconstruction(model, cache, ids, **text)
        return cache

    batch = cache_after_prompt(*left_pad(prompts, pad_id=0))
    ragged = False
    for row, prompt in enumerate(prompts):
        alone = cache_after_prompt(prompt[None], torch.ones_like(prompt[None]))
        for layer in range(len(model.model.layers)):
            kept = kept_lists(alone, layer)[0]
            assert kept_lists(batch, layer)[row] == kept
            ragged |= len({len(head) for head in kept}) > 1
    assert ragged  # the heads keep different counts: the per-head store is exercised


def test_kvzip_on_a_padded_batch_refuses_sliding_window_layers():
    model = knorm_model("gemma3_text")
    ids, mask = left_pad(_prompts(), pad_id=0)
    with pytest.raises(ValueError, match="sliding-window layers"):
        knorm_generate(model, ids, mask, compression_ratio=0.5, score="kvzip", tokenizer=word_tokenizer(),
                       chat_template=False, max_new_tokens=2, pad_token_id=0)


def test_a_model_that_hides_the_positions_from_the_cache(monkeypatch):
    """Transformers before 5.24 (and GPT-NeoX) call ``Cache.update`` without position ids: the cache cannot see a
    padded step's padding. A padded prompt's forward (a model with sliding-window layers) and a padded step of several
    tokens (left-padded questions) are refused instead of evicting rows as one block; ``knorm_generate`` on full
    attention layers never needs them (each prompt but its last token prefilled alone, then one token per row) and
    generates what each prompt generates alone."""
    import hf_knorm.eviction.cache as cache_module

    monkeypatch.setattr(cache_module, "update_position_ids", lambda kwargs: None)
    prompts = _prompts()
    ids, mask = left_pad(prompts, pad_id=0)
    model = knorm_model("gemma3_text")
    with pytest.raises(ValueError, match="does not give the cache its position ids"):
        knorm_generate(model, ids, mask, compression_ratio=0.5, max_new_tokens=2, pad_token_id=0)
    model = knorm_model("llama")
    config = _config(model)
    run = lambda ids, mask=None: (knorm_generate(model, ids, mask, compression_ratio=0.5,  # noqa: E731
                                                 generation_config=config), None)
    _assert_rows_equal_alone(model, prompts, run, run)
    questions, question_mask = left_pad(_prompts((3, 1, 2), seed=2), pad_id=0)
    with pytest.raises(ValueError, match="does not give the cache its position ids"):
        answer_questions(model, knorm_cache_for(model, compression_ratio=0.5), ids, [questions], context_mask=mask,
                         question_masks=[question_mask], max_new_tokens=2, pad_token_id=0)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


@pytest.mark.parametrize("options", [dict(score="key_norm"), dict(score="kv_diff"), dict(score="kvzip"),
                                     dict(score="kvzip", head_budget="heads", layer_budget="global", head_floor=0.0)],
                         ids=["key_norm", "kv_diff", "kvzip", "kvzip-global"])
def test_the_pipeline_on_a_list_of_contexts_equals_one_at_a_time(pipe, options):
    from hf_knorm.assets.texts import SAMPLE_TEXT

    words = SAMPLE_TEXT.split()
    contexts = [" ".join(words[:n]) for n in (40, 22, 31)]
    fixed = dict(compression_ratio=0.5, **options, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    questions = ["How many steps?", "Who climbed the stairs of the old tower?"]
    batched = pipe(contexts, question=questions, batch_size=3, **fixed)
    assert batched == [pipe(context, question=questions, **fixed) for context in contexts]
    one = "Which steps?"
    assert pipe(contexts, question=one, batch_size=2, **fixed) == [pipe(context, question=one, **fixed)
                                                                   for context in contexts]
    inputs = [pipe.preprocess(context, question=one) for context in contexts]
    outputs = pipe._forward({"prompt": [item["prompt"] for item in inputs]}, cache_options=fixed_cache(fixed),
                            score_basis=None, generate_kwargs=dict(max_new_tokens=4, min_new_tokens=4))
    for row, item in enumerate(inputs):  # each row's own stored count (its kept context, question and answer)
        alone = pipe._forward(item, cache_options=fixed_cache(fixed), score_basis=None,
                              generate_kwargs=dict(max_new_tokens=4, min_new_tokens=4))
        assert outputs["stored_tokens"][row] == alone["stored_tokens"]
        assert all(torch.equal(a, b) for a, b in zip(outputs["new_ids"][row], alone["new_ids"], strict=True))


def fixed_cache(fixed: dict) -> dict:
    return {name: fixed[name] for name in ("compression_ratio", "score", "head_budget", "layer_budget", "head_floor")
            if name in fixed}


@pytest.mark.parametrize("options", [dict(score="kv_diff"),
                                     dict(score="kvzap", head_budget="heads", layer_budget="global", head_floor=0.0,
                                          sink_tokens=4)], ids=["kv_diff", "kvzap-global"])
def test_default_model_batch_equals_each_prompt_alone(default_model_and_tokenizer, options):
    """SmolLM2-135M-Instruct at ratio 0.5, ``kv_diff`` and the shipped KVzap surrogate under KVzip's global budget
    (docs/knorm.md's choice): three prompts of 40-64 tokens in one left-padded batch."""
    from hf_knorm.assets.texts import SAMPLE_TEXT

    model, tokenizer = default_model_and_tokenizer
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt")["input_ids"][0]
    prompts = [ids[:64], ids[10:50], ids[5:57]]
    config = _config(model)

    def run(batch_ids, mask=None):
        return knorm_generate(model, batch_ids, mask, compression_ratio=0.5, generation_config=config,
                              **options), None

    batch_ids, mask = left_pad(prompts, pad_id=tokenizer.pad_token_id)
    batch = run(batch_ids, mask)[0]
    for row, prompt in enumerate(prompts):
        alone = run(prompt[None])[0]
        assert torch.equal(batch.sequences[row, batch_ids.shape[1]:], alone.sequences[0, prompt.numel():])
        for step_batch, step_alone in zip(batch.logits, alone.logits, strict=True):
            torch.testing.assert_close(step_batch[row], step_alone[0], atol=ATOL, rtol=0)


# --- crop ------------------------------------------------------------------------------------------------------------
def _step(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits


@pytest.mark.parametrize("options", [dict(compression_ratio=0.5), dict(compression_ratio=0.5, score="kv_diff")])
def test_crop_of_tokens_appended_after_compression_is_exact(options):
    """A verification step of 4 draft tokens onto a compressed cache, 3 of them cropped: the cache is then the one
    that got only the accepted token (same positions; states and next logits equal up to the fp32 noise of a
    4-token forward against a 1-token one)."""
    model = knorm_model("llama")
    prompt, draft = _prompts((20,))[0][None], _prompts((4,), seed=5)[0][None]
    drafted, accepted = KNormCache(config=model.config, **options), KNormCache(config=model.config, **options)
    for cache in (drafted, accepted):
        _step(model, cache, prompt)
    _step(model, drafted, draft)
    drafted.crop(-3)
    _step(model, accepted, draft[:, :1])
    assert drafted.get_seq_length() == accepted.get_seq_length() == 21
    for mine, theirs in zip(drafted.layers, accepted.layers):  # the accepted token came in a 4-token forward
        assert torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=0)
    following = draft[:, 1:3]
    torch.testing.assert_close(_step(model, drafted, following), _step(model, accepted, following), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="negative number"):
        drafted.crop(2)
    with pytest.raises(ValueError, match="only the 3 tokens appended since its last eviction"):
        drafted.crop(-4)  # would reach into the compressed prompt


def test_crop_of_a_padded_batch_keeps_each_rows_count():
    model = knorm_model("llama")
    ids, mask = left_pad(_prompts(), pad_id=0)
    cache = KNormCache(0.5, config=model.config)
    draft = torch.randint(4, 100, (3, 4))
    with ragged_attention_for(model, cache, padded=True), torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
        before = [layer.row_lengths.clone() for layer in cache.layers]
        full = torch.cat([mask, torch.ones_like(draft)], dim=1)
        model(input_ids=draft, attention_mask=full, position_ids=positions[:, -1:] + 1 + torch.arange(4),
              **cache_kwargs(cache), use_cache=True)
    cache.crop(-4)
    assert all(torch.equal(layer.row_lengths, rows) for layer, rows in zip(cache.layers, before))
    assert cache.get_seq_length() == ids.shape[1]


def test_assisted_generate():
    """Transformers' assisted generate runs the prompt and the first draft in one forward: with nothing evicted
    (ratio 0) every crop is exact and the tokens are a DynamicCache's; a compressing cache refuses at its first crop,
    naming why."""
    model = knorm_model("llama")
    prompt = _prompts((24,))[0][None]
    ids = torch.cat([prompt, prompt[:, :8]], dim=1)  # repeats: prompt lookup drafts something
    config = _config(model, max_new_tokens=8)
    plain = model.generate(input_ids=ids, **cache_kwargs(DynamicCache()), generation_config=config)
    assisted = model.generate(input_ids=ids, **cache_kwargs(KNormCache(config=model.config)),
                              generation_config=config, prompt_lookup_num_tokens=3)
    assert torch.equal(plain.sequences, assisted.sequences)
    with pytest.raises(ValueError, match="compresses together"):
        model.generate(input_ids=ids, **cache_kwargs(KNormCache(0.5, config=model.config)), generation_config=config,
                       prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("options", [dict(score="kv_diff"), dict(score="key_norm", sink_tokens=2, recent_window=3),
                                     dict(score="kvzip")], ids=["kv_diff", "key_norm-protected", "kvzip"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # GQA; QK-norm
def test_rows_prefilled_alone_and_stacked_hold_what_the_padded_prefill_holds(model_type, options):
    """``prefill_rows``: each context alone, then stacked (``KNormCache.stack_rows``), against one forward over the
    left-padded batch: the same kept positions and dead slots, row lengths and counts; keys and values within ATOL
    (a row alone sums in another order). A deferred score (kvzip) stores every row whole until it is scored."""
    from hf_knorm.eviction.pipeline import prefill_rows

    model = knorm_model(model_type)
    ids, mask = left_pad(_prompts(), pad_id=0)
    stacked = knorm_cache_for(model, compression_ratio=0.5, **options)
    padded = knorm_cache_for(model, compression_ratio=0.5, **options)
    with torch.no_grad(), ragged_attention_for(model, padded, True):
        prefill_rows(model, stacked, ids, mask)
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
              **cache_kwargs(padded))
    assert stacked.get_seq_length() == padded.get_seq_length() == ids.shape[1]
    for mine, theirs in zip(stacked.layers, padded.layers, strict=True):
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.row_lengths, theirs.row_lengths)
        assert (mine.prompt_length, mine.compressed_at) == (theirs.prompt_length, theirs.compressed_at)
        live = (mine.positions >= 0)[..., None]
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            torch.testing.assert_close(a * live, b * live, atol=ATOL, rtol=0)


def test_a_padded_batch_runs_no_padding_where_rows_can_be_stacked():
    """The context's forward sees each row's real tokens alone (no attention mask, no padding) on a model of full
    attention layers, through ``answer_questions`` and ``knorm_generate``; a model with sliding-window layers keeps one padded forward (Transformers' sliding layers are
    not stacked) and answers the same as each context alone either way."""
    contexts = _prompts((19, 11, 15))
    context_ids, context_mask = left_pad(contexts, 0)
    question = torch.tensor([[5, 6, 7]] * 3)
    generate = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for model_type, stacked in [("llama", True), ("gemma3_text", False)]:
        model = knorm_model(model_type)
        shapes = []
        model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
            (tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask") is not None)), with_kwargs=True)
        cache = knorm_cache_for(model, compression_ratio=0.5, score="kv_diff")
        assert cache.can_stack_rows() is stacked
        batch = answer_questions(model, cache, context_ids, [question], context_mask=context_mask, **generate)[0]
        prefill = [(shape, masked) for shape, masked in shapes if shape[1] > question.shape[1]]
        assert prefill == ([((1, 19), False), ((1, 11), False), ((1, 15), False)] if stacked else [((3, 19), True)])
        for row in range(3):
            alone = answer_questions(model, knorm_cache_for(model, compression_ratio=0.5, score="kv_diff"),
                                     contexts[row][None], [question[:1]], **generate)[0]
            assert torch.equal(batch[row], alone[0])
        # knorm_generate: each prompt but its last token alone (left open), then one token per row from the batch
        shapes.clear()
        knorm_generate(model, context_ids, context_mask, compression_ratio=0.5, score="kv_diff", **generate)
        assert [shape for shape, _ in shapes[:3 if stacked else 1]] == (
            [(1, 18), (1, 10), (1, 14)] if stacked else [(3, 19)])
        assert all(shape == (3, 1) for shape, _ in shapes[3 if stacked else 1:])


def test_stack_rows_refuses_what_is_not_one_context_alone_per_row():
    model = knorm_model("llama")
    ids, mask = left_pad(_prompts((9, 6)), pad_id=0)
    rows = []
    for row in range(2):
        cache = knorm_cache_for(model, compression_ratio=0.5)
        model(input_ids=ids[row:row + 1, mask[row].bool()], **cache_kwargs(cache), use_cache=True)
        rows.append(cache)
    with pytest.raises(ValueError, match="at most 5 tokens"):
        knorm_cache_for(model, compression_ratio=0.5).stack_rows(rows, width=5)
    with pytest.raises(ValueError, match="prefilled alone through 2 DynamicLayers"):  # open prompts are uncompressed
        knorm_cache_for(model, compression_ratio=0.5).stack_rows(rows, width=9, prompt_open=True)
    full = knorm_cache_for(model, compression_ratio=0.5).stack_rows(rows, width=9)
    with pytest.raises(ValueError, match="needs an empty KNormCache"):
        full.stack_rows(rows, width=9)
    with pytest.raises(ValueError, match="needs an empty KNormCache"):
        KNormCache(0.5).stack_rows(rows, width=9)  # no config: no layers to stack into
