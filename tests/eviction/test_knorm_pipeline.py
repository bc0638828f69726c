"""The kvpress protocol, written once: the ``knorm-text-generation`` pipeline on a tiny model, and the needle
benchmark's cells giving the pipeline's answers (they run the same function, ``answer_after_context``)."""

from __future__ import annotations

import pytest
import torch
from knorm_helpers import NEW, PROMPT, knorm_model, word_text, word_tokenizer
from transformers import DynamicCache, pipeline

from hf_knorm.compat import cache_kwargs
from hf_knorm.evaluation import needle
from hf_knorm.eviction.cache import KNormCache
from hf_knorm.eviction.pipeline import KNormTextGenerationPipeline, encode_prompt

GENERATE = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)  # no early end of sequence


@pytest.fixture(scope="module")
def tiny():
    return knorm_model("llama"), word_tokenizer()


@pytest.mark.compat
def test_pipeline_task_answers_from_the_compressed_context(tiny):
    model, tokenizer = tiny
    pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
    assert isinstance(pipe, KNormTextGenerationPipeline)
    context, question = word_text(PROMPT), word_text(3, seed=1)
    context_ids, question_ids = encode_prompt(tokenizer, context, question)
    ids = torch.cat([context_ids, question_ids], dim=1)
    assert context_ids.shape[1] == PROMPT and question_ids.shape[1] == 3  # no chat template: nothing added

    def decoded(out):
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(DynamicCache()),
                               **GENERATE)
        cache = KNormCache(0.9, config=model.config)
        model(input_ids=context_ids, **cache_kwargs(cache), use_cache=True)  # the context alone is compressed
        compressed = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                                    **GENERATE)
    assert cache.stored_tokens() == [PROMPT - int(0.9 * PROMPT) + 3 + NEW - 1] * 2
    assert pipe(context, question=question, compression_ratio=0.0, **GENERATE)["answer"] == decoded(plain)
    assert pipe(context, question=question, compression_ratio=0.9, **GENERATE)["answer"] == decoded(compressed)
    assert decoded(compressed) != decoded(plain)  # the compression is felt: the equality above is not vacuous


@pytest.mark.compat
def test_needle_cells_give_the_pipeline_answers(tiny, monkeypatch):
    """Every row equals the pipeline's answer; KVzip's rows of one score at two ratios reconstruct the context once
    (the pipeline reconstructs it for each call)."""
    model, tokenizer = tiny
    sample = dict(context=word_text(PROMPT, seed=2), question=word_text(2, seed=3), answer_prefix=" w5", expected="0")
    variants = [needle.Variant("r=0"), needle.Variant("r=0.9", {"compression_ratio": 0.9}),
                needle.Variant("kv_diff", {"compression_ratio": 0.5, "score": "kv_diff", "sink_tokens": 2}),
                needle.Variant("layer 0 kept", {"compression_ratio": 0.75, "layer_ratios": {0: 0.0}}),
                needle.Variant("kvzip", {"compression_ratio": 0.75, "score": "kvzip+chunk_size8"}),
                needle.Variant("kvzip 0.25", {"compression_ratio": 0.25, "score": "kvzip+chunk_size8"}),
                needle.Variant("kvzip sinks", {"compression_ratio": 0.75, "score": "kvzip+chunk_size8",
                                               "sink_tokens": 2})]
    reconstructions = []
    scores = needle.reconstruction_scores
    monkeypatch.setattr(needle, "reconstruction_scores", lambda *args: reconstructions.append(1) or scores(*args))
    answers = needle.answer_cell(model, tokenizer, sample, variants, max_new_tokens=NEW)
    assert len(reconstructions) == 2  # one per options but the ratio: kvzip, kvzip + sinks
    pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
    for variant in variants:
        answer = pipe(sample["context"], question=sample["question"], answer_prefix=sample["answer_prefix"],
                      max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.eos_token_id, **variant.options)
        assert answers[variant.name] == answer["answer"], variant.name
    assert len(set(answers.values())) > 1  # the variants differ, so each equality checks its own cache


@pytest.mark.parametrize("options", [{"score": "kv_diff", "compression_ratio": 0.5},
                                     {"score": "key_norm", "compression_ratio": 0.5, "head_budget": "heads"},
                                     {"score": "kvzip+chunk_size8", "compression_ratio": 0.5},
                                     {"score": "kvzip+chunk_size8", "compression_ratio": 0.5, "head_budget": "heads",
                                      "head_floor": 0.0, "layer_budget": "global"}],
                         ids=lambda options: options["score"] + ("+heads" if "head_budget" in options else "")
                         + ("+global" if "layer_budget" in options else ""))
def test_several_questions_are_answered_from_one_compressed_context(tiny, options):
    """Compress once, ask many: a list of questions gives, for a query-agnostic score, the answers of one call per
    question, with the context prefilled (and scored) once."""
    model, tokenizer = tiny
    context, questions = word_text(PROMPT, seed=6), [word_text(3, seed=s) for s in (7, 8, 9)]
    one_by_one = [pipe_answer for pipe_answer in (
        pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)(context, question=q, **options, **GENERATE)
        for q in questions)]
    context_forwards = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: context_forwards.append(kwargs["input_ids"].shape[1] == PROMPT), with_kwargs=True)
    try:
        pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
        together = pipe(context, question=questions, **options, **GENERATE)
    finally:
        hook.remove()
    assert together == one_by_one
    assert sum(context_forwards) == 1  # the context ran once; the questions and the answers ran on copies of its cache
    assert len({answer["answer"] for answer in one_by_one}) > 1  # the questions matter: the equality is not vacuous
    with pytest.raises(ValueError, match="question"):
        pipe(context, question=[questions[0], ""], **GENERATE)


def test_importance_given_to_a_cache_that_scores_at_the_prefill_is_refused(tiny):
    from hf_knorm.eviction.pipeline import answer_after_context, knorm_cache_for

    model, tokenizer = tiny
    context_ids, question_ids = encode_prompt(tokenizer, word_text(PROMPT, seed=4), word_text(2, seed=5))
    cache = knorm_cache_for(model, compression_ratio=0.5, score="kv_diff", recorded_defaults=False)
    with pytest.raises(ValueError, match="importance= is a reconstruction score's"):
        answer_after_context(model, cache, context_ids, question_ids, importance={0: torch.zeros(1, 2, PROMPT)},
                             **GENERATE)
