"""KNorm compression in one call: ``knorm_generate`` and the ``knorm-text-generation`` pipeline (arXiv 2406.11430).

The pipeline follows kvpress's ``kv-press-text-generation`` convention: the *context* is prefilled and compressed,
the *question* is then appended uncompressed on top of the compressed cache and the answer is decoded from it, so a
needle test measures retrieval from a compressed context. With a chat template (the default when the tokenizer has
one) the user turn is ``context + "\\n\\n" + question``; the split falls just before ``"\\n\\n" + question``, so the
template's prefix belongs to the (compressed) context and its suffix (end of turn, assistant header) to the question.
The protocol itself is :func:`answer_after_context`, which the needle benchmark (``hf_knorm.evaluation.needle``)
runs too, so the benchmarks measure the public pipeline's path.

The authors' own protocol differs (question processed on the uncompressed pass, layers 0-1 uncompressed: their
l2compress code; docs/knorm.md); ``layer_ratios={0: 0.0, 1: 0.0}`` reproduces the layer part.
"""

from __future__ import annotations

import copy

import torch
from transformers import Pipeline

from ..balancing.balance import key_scales, value_scales
from ..compat import cache_kwargs
from .cache import KNormCache
from .ragged import ragged_attention_for
from .reconstruction import compress_by_reconstruction
from .defaults import CACHE_OPTIONS, SCORE_BASES, merged_options


def knorm_cache_for(model, score_basis: str | None = None, *, recorded_defaults: bool = True,
                    **options) -> KNormCache:
    """A :class:`KNormCache` for ``model``: its config (validation, sliding layers) and, if asked, its key scales.

    Args:
        model (PreTrainedModel): A supported decoder (``hf_knorm.models.architectures.SUPPORTED_ARCHITECTURES``),
            patched or not, balanced or not.
        score_basis ({"cached", "original"}): ``"cached"`` scores the keys and values as cached (the paper's method).
            ``"original"`` scores ``k * s`` and ``v / t``: for a model balanced per channel (keys ``k / s``, values
            ``v * t``) the keys and values the unbalanced model would have had, so every score keeps the tokens the
            unbalanced model would keep. For an unbalanced model both are the same; per-layer balancing (one scalar
            per layer) changes no score's ranking either. Default: the model's recorded default
            (:func:`hf_knorm.eviction.defaults.set_knorm_defaults`), else ``"cached"``.
        recorded_defaults (bool): Start from the options recorded in the model's config
            (:func:`hf_knorm.eviction.defaults.set_knorm_defaults`). ``False`` uses only what is passed (a benchmark
            naming every option).
        **options: :class:`KNormCache` options (``compression_ratio``, ``score``, ``budget``, ``sink_tokens``, ...),
            over the model's recorded defaults (a passed ratio or budget replaces the recorded sizing as a whole).
    """
    if recorded_defaults:
        score_basis, options = merged_options(model.config, score_basis, options)
    score_basis = score_basis or "cached"
    if score_basis not in SCORE_BASES:
        raise ValueError(f"score_basis must be one of {SCORE_BASES}, got {score_basis!r}.")
    original = score_basis == "original"
    return KNormCache(config=model.config, key_scales=key_scales(model.config) if original else None,
                      value_scales=value_scales(model.config) if original else None, **options)


def check_unpadded(attention_mask: torch.Tensor | None) -> None:
    """Raise if ``attention_mask`` (B, n) contains padding: KNorm eviction breaks the padding-mask bookkeeping."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "KNorm compression does not support padded batches (eviction breaks the padding mask). Generate one "
            "sequence at a time, or batch prompts of equal length without padding."
        )


@torch.no_grad()
def knorm_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   score_basis: str | None = None, tokenizer=None, chat_template: bool | None = None,
                   **kwargs) -> torch.Tensor:
    """``model.generate`` with the prompt's KV cache compressed by KNorm.

    Args:
        model (PreTrainedModel): A supported decoder-only model.
        input_ids (torch.Tensor): (B, n) prompt ids, unpadded.
        attention_mask (torch.Tensor, optional): (B, n); must be all ones.
        score_basis ({"cached", "original"}): See :func:`knorm_cache_for`.
        tokenizer, chat_template: Needed by ``score="kvzip"`` only (its reconstruction prompt is text,
            :func:`hf_knorm.eviction.reconstruction.compress_by_reconstruction`). With it the prompt but its last
            token is prefilled, scored by the reconstruction and compressed; ``generate`` then starts from the last
            token (it needs one new token to start from).
        **kwargs: :class:`KNormCache` options (``compression_ratio``, ``score``, ``budget``, ``sink_tokens``,
            ``recent_window``, ``layer_ratios``, ``decoding_budget``, ``head_budget``, ``head_floor``,
            ``layer_budget``); everything else goes to ``model.generate`` (``max_new_tokens``,
            ``do_sample``, ...).

    Returns:
        torch.Tensor: (B, n + new) the sequences, as ``model.generate`` returns them.
    """
    if "cache" in kwargs or "past_key_values" in kwargs:
        raise ValueError("knorm_generate builds its own KNormCache; pass cache options instead of a cache.")
    check_unpadded(attention_mask)
    options = {name: kwargs.pop(name) for name in CACHE_OPTIONS if name in kwargs}
    cache = knorm_cache_for(model, score_basis=score_basis, **options)
    if cache.settings.deferred:
        _check_tokenizer(tokenizer)
        if input_ids.shape[1] < 2:
            raise ValueError("score='kvzip' compresses the prompt but its last token: give at least 2 prompt tokens.")
        context_ids = input_ids[:, :-1]
        with ragged_attention_for(model, cache):
            model(input_ids=context_ids, **cache_kwargs(cache), use_cache=True)
        compress_by_reconstruction(model, cache, context_ids, tokenizer, chat_template)
    with ragged_attention_for(model, cache):  # head_budget="heads": the attention that masks per head
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache), **kwargs)


@torch.no_grad()
def append_tokens(model, cache: KNormCache, input_ids: torch.Tensor) -> None:
    """Run (B, m) new tokens through ``model`` onto ``cache`` (uncompressed): in one forward if every layer stores
    the same count, else one token per forward (per-layer ratios; see ``KNormCache.is_uniform``)."""
    if input_ids.shape[1] == 0:
        return
    steps = [input_ids] if cache.is_uniform() else list(input_ids.split(1, dim=1))
    for step in steps:
        model(input_ids=step, **cache_kwargs(cache), use_cache=True)


def generate_after(model, cache: KNormCache, context_ids: torch.Tensor, new_ids: torch.Tensor, **generate_kwargs):
    """Append ``new_ids`` (B, m >= 1) to a cache holding ``context_ids`` (B, n) and generate; returns the new tokens.

    With a uniform cache ``generate`` feeds ``new_ids`` itself; otherwise all but the last are fed one by one first.
    """
    if not cache.is_uniform():
        append_tokens(model, cache, new_ids[:, :-1])
    ids = torch.cat([context_ids, new_ids], dim=1)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), **generate_kwargs)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def answer_after_context(model, cache: KNormCache, context_ids: torch.Tensor, question_ids: torch.Tensor, *,
                         prefilled=None, tokenizer=None, chat_template: bool | None = None,
                         **generate_kwargs) -> torch.Tensor:
    """The kvpress protocol, once: the context is compressed into ``cache``, the question appended uncompressed on top
    of it, and the answer decoded. The ``knorm-text-generation`` pipeline and the needle benchmark both run this.

    Args:
        model (PreTrainedModel): The decoder.
        cache (KNormCache): An empty cache (:func:`knorm_cache_for`); holds the compressed context afterwards.
        context_ids (torch.Tensor): (B, n) the context, compressed.
        question_ids (torch.Tensor): (B, m >= 1) the question (and any answer prefix), not compressed.
        prefilled (DynamicCache, optional): The context already run through ``model`` into a plain cache; it is then
            compressed into ``cache`` (:meth:`KNormCache.prefill_from`) instead of running the context again. Same
            result (a KNormCache's prefill attends the whole context): a benchmark prefills once for many caches.
        tokenizer, chat_template: For ``score="kvzip"``: the context is then scored by the reconstruction pass
            (:func:`hf_knorm.eviction.reconstruction.compress_by_reconstruction`) before the question; ignored by
            the other scores.
        **generate_kwargs: ``model.generate`` arguments (``max_new_tokens``, ``do_sample``, ``pad_token_id``, ...).

    Returns:
        torch.Tensor: (B, new) the answer's token ids.
    """
    return answer_questions(model, cache, context_ids, [question_ids], prefilled=prefilled, tokenizer=tokenizer,
                            chat_template=chat_template, **generate_kwargs)[0]


def _check_tokenizer(tokenizer) -> None:
    """Fail before the prefill when ``score="kvzip"`` has no tokenizer for its reconstruction prompt."""
    if tokenizer is None:
        raise ValueError("score='kvzip' needs the tokenizer (its reconstruction prompt is text): pass tokenizer=.")


def fork_cache(cache: KNormCache) -> KNormCache:
    """An independent copy of ``cache`` (its stored tensors copied; its settings and config shared, they are read
    only): a question appended to the copy leaves ``cache`` as it was."""
    memo = {id(cache.settings): cache.settings}
    if cache.config is not None:
        memo[id(cache.config)] = cache.config
    return copy.deepcopy(cache, memo)


@torch.no_grad()
def answer_questions(model, cache: KNormCache, context_ids: torch.Tensor, questions: list[torch.Tensor], *,
                     prefilled=None, tokenizer=None, chat_template: bool | None = None,
                     **generate_kwargs) -> list[torch.Tensor]:
    """Compress once, ask many: the context is prefilled and compressed into ``cache`` once (scores included), then
    each question is appended to a copy of the compressed cache (:func:`fork_cache`; the last question to ``cache``
    itself) and answered. For a query-agnostic score this gives every question the answer of
    :func:`answer_after_context` run on it alone (tested), without recomputing the context or the scores.

    Args:
        questions (list of torch.Tensor): (B, m_i >= 1) ids of each question (and answer prefix), not compressed.
        Others: as :func:`answer_after_context`.

    Returns:
        list of torch.Tensor: per question, (B, new) the answer's ids.
    """
    if not questions:
        raise ValueError("answer_questions needs at least one question.")
    if cache.settings.deferred:
        _check_tokenizer(tokenizer)
    with ragged_attention_for(model, cache):  # head_budget="heads": the attention that masks per head
        if prefilled is None:
            model(input_ids=context_ids, **cache_kwargs(cache), use_cache=True)  # prefill: compressed here
        else:
            cache.prefill_from(prefilled)
        if cache.settings.deferred:
            compress_by_reconstruction(model, cache, context_ids, tokenizer, chat_template)
        answers = []
        for index, question_ids in enumerate(questions):
            target = cache if index == len(questions) - 1 else fork_cache(cache)
            answers.append(generate_after(model, target, context_ids, question_ids, **generate_kwargs))
        return answers


def encode_prompt(tokenizer, context: str, question: str, answer_prefix: str = "",
                  chat_template: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids (1, n), question ids (1, m)) of the kvpress protocol: :func:`split_prompt`, then the question
    text followed by ``answer_prefix`` (the text the answer starts with), each tokenized without special tokens."""
    context_text, question_text = split_prompt(tokenizer, context, question, chat_template)
    encode = lambda text: tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return encode(context_text), encode(question_text + answer_prefix)


def split_prompt(tokenizer, context: str, question: str, chat_template: bool | None = None) -> tuple[str, str]:
    """Split the prompt into (context text, question text); the first is compressed, the second is not."""
    if chat_template is None:
        chat_template = getattr(tokenizer, "chat_template", None) is not None
    if not chat_template:
        return context, "\n\n" + question + "\n"
    suffix = "\n\n" + question
    full = tokenizer.apply_chat_template([{"role": "user", "content": context + suffix}], tokenize=False,
                                         add_generation_prompt=True)
    cut = full.rindex(suffix)
    return full[:cut], full[cut:]


class KNormTextGenerationPipeline(Pipeline):
    """``pipeline("knorm-text-generation", model=..., tokenizer=...)``: answer a question about a compressed context.

    Call: ``pipe(context, question=..., compression_ratio=0.5, max_new_tokens=16)`` -> ``{"answer": str}``; with a
    list of questions, ``question=[q1, q2, ...]`` -> ``[{"answer": str}, ...]``: the context is compressed once and
    each question answered from a copy of that cache (:func:`answer_questions`). Other
    keywords: the :class:`KNormCache` options, ``score_basis``, ``chat_template`` (default: use the tokenizer's),
    ``answer_prefix`` (text the answer starts with, kept out of the answer), and ``model.generate`` arguments
    (``do_sample``, ``temperature``, ...). Batch size 1 (each context has its own cache).
    """

    _pipeline_calls_generate = True

    def _sanitize_parameters(self, question=None, chat_template=None, answer_prefix="", score_basis=None, **kwargs):
        preprocess = dict(question=question, chat_template=chat_template, answer_prefix=answer_prefix)
        cache_options = {name: kwargs.pop(name) for name in CACHE_OPTIONS if name in kwargs}
        forward = dict(cache_options=cache_options, score_basis=score_basis, chat_template=chat_template,
                       generate_kwargs=kwargs)
        return preprocess, forward, {}

    def preprocess(self, context: str, question=None, chat_template=None, answer_prefix: str = ""):
        several = isinstance(question, (list, tuple))
        questions = list(question) if several else [question]
        if not isinstance(context, str) or not questions or not all(isinstance(q, str) and q for q in questions):
            raise ValueError(
                "knorm-text-generation takes a context string and a question: pipe(context, question='...'), or "
                "several: pipe(context, question=['...', '...'])."
            )
        encoded = [encode_prompt(self.tokenizer, context, q, answer_prefix, chat_template) for q in questions]
        context_ids = encoded[0][0]
        if any(not torch.equal(ids, context_ids) for ids, _ in encoded):
            raise ValueError("The questions split the prompt differently (the chat template puts the question "
                             "before the context?): ask them one at a time.")
        return {"context_ids": context_ids, "question_ids": [q for _, q in encoded] if several else encoded[0][1]}

    def _forward(self, inputs, cache_options, score_basis, generate_kwargs, chat_template=None):
        context_ids = inputs["context_ids"].to(self.model.device)
        cache = knorm_cache_for(self.model, score_basis=score_basis, **cache_options)
        kwargs = dict(generate_kwargs)
        if self.tokenizer.pad_token_id is None and "pad_token_id" not in kwargs:
            kwargs["pad_token_id"] = self.tokenizer.eos_token_id
        several = isinstance(inputs["question_ids"], list)
        questions = [ids.to(self.model.device) for ids in (inputs["question_ids"] if several else
                                                           [inputs["question_ids"]])]
        new_ids = answer_questions(self.model, cache, context_ids, questions, tokenizer=self.tokenizer,
                                   chat_template=chat_template, **kwargs)
        return {"new_ids": [ids[0] for ids in new_ids], "several": several,
                "stored_tokens": cache.stored_tokens()}

    def postprocess(self, outputs):
        answers = [{"answer": self.tokenizer.decode(ids, skip_special_tokens=True).strip()}
                   for ids in outputs["new_ids"]]
        return answers if outputs["several"] else answers[0]


TASK = "knorm-text-generation"
"""The pipeline task :func:`register_pipeline` registers."""


def register_pipeline() -> None:
    """Register the ``knorm-text-generation`` task with Transformers' pipeline registry (a public extension point).

    Done on ``import hf_knorm``: ``pipeline("knorm-text-generation", ...)`` is the user's first call and runs no
    plugin code before it looks the task up. It adds one task name and changes no other task. Idempotent; a task of
    that name already registered with another pipeline class is refused rather than replaced or silently kept.

    Raises:
        ValueError: ``knorm-text-generation`` is registered with another pipeline class.
    """
    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    held = PIPELINE_REGISTRY.supported_tasks.get(TASK)
    if held is None:
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=KNormTextGenerationPipeline, pt_model=AutoModelForCausalLM
        )
    elif held.get("impl") is not KNormTextGenerationPipeline:
        raise ValueError(f"The pipeline task {TASK!r} is already registered with {held.get('impl')!r}; hf_knorm's "
                         f"{KNormTextGenerationPipeline.__name__} needs the name.")

