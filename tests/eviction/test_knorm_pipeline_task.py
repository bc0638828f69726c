"""The ``knorm-text-generation`` task on a tiny model with the default model's tokenizer: fast enough for the
compatibility suite (the same checks on the default model itself are in tests/evaluation/test_needle.py)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from knorm_helpers import tiny_pipeline

from hf_knorm.assets.texts import SAMPLE_TEXT
from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.pipeline import split_prompt

pytestmark = pytest.mark.compat
QUESTION = "How many steps did the keeper climb?"
FIXED = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)  # no early end of text


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


def test_uncompressed_answer_equals_plain_generate(pipe):
    answer = pipe(SAMPLE_TEXT, question=QUESTION, compression_ratio=0.0, **FIXED)["answer"]
    context_text, question_text = split_prompt(pipe.tokenizer, SAMPLE_TEXT, QUESTION)
    ids = pipe.tokenizer(context_text + question_text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = pipe.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    **cache_kwargs(tf.DynamicCache()), **FIXED)
    assert answer == pipe.tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_the_context_is_compressed_and_the_question_is_not(pipe):
    prompt = pipe.preprocess(SAMPLE_TEXT, question=QUESTION)["prompt"]
    context_ids = prompt.context_ids
    outputs = pipe._forward(pipe.preprocess(SAMPLE_TEXT, question=QUESTION),
                            cache_options={"compression_ratio": 0.5}, score_basis=None, generate_kwargs=dict(FIXED))
    question_and_answer = prompt.question_ids[0].shape[1] + 5 - 1
    kept = context_ids.shape[1] - context_ids.shape[1] // 2
    assert outputs["stored_tokens"] == [kept + question_and_answer] * 2
    torch.manual_seed(0)
    assert isinstance(pipe(SAMPLE_TEXT, question=QUESTION, compression_ratio=0.5, max_new_tokens=3,
                           do_sample=True)["answer"], str)
    with pytest.raises(ValueError, match="question"):
        pipe(SAMPLE_TEXT)


def test_the_reconstruction_prompt_in_the_default_chat_template(pipe):
    """score='kvzip' on SmolLM2's chat template: the reconstruction repeats the context's tokens after the template's
    prefix (system prompt, user header), prompted in the user turn and answered in the assistant turn."""
    from hf_knorm.eviction.reconstruction import FIRST_PROMPT, reconstruction_chunks, reconstruction_prompt

    tokenizer = pipe.tokenizer
    prompt = reconstruction_prompt(tokenizer)
    decode = lambda ids: tokenizer.decode(ids[0])
    assert decode(prompt.prefix_ids).startswith("<|im_start|>system") and decode(prompt.prefix_ids).endswith("user\n")
    assert decode(prompt.first_ids) == "\n\n" + FIRST_PROMPT
    assert decode(prompt.suffix_ids) == "<|im_end|>\n<|im_start|>assistant\n"
    context_ids = pipe.preprocess(SAMPLE_TEXT, question=QUESTION)["prompt"].context_ids
    assert torch.equal(context_ids[:, :prompt.prefix_ids.shape[1]], prompt.prefix_ids)  # the prefix is cut cleanly
    (chunk,) = reconstruction_chunks(context_ids, prompt, 2048, 8)
    assert decode(chunk) == "\n\n" + FIRST_PROMPT + "<|im_end|>\n<|im_start|>assistant\n" + SAMPLE_TEXT
    answer = pipe(SAMPLE_TEXT, question=[QUESTION, "Who?"], compression_ratio=0.5, score="kvzip", **FIXED)
    assert [sorted(a) for a in answer] == [["answer"], ["answer"]]
