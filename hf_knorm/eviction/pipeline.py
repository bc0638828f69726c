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
from dataclasses import dataclass

import torch
from transformers import DynamicCache, Pipeline

from ..balancing.balance import key_scales, value_scales
from ..compat import cache_kwargs
from .cache import KNormCache, KNormLayer
from .ragged import ragged_attention_for
from .rows import check_left_padded, has_padding, left_pad, mask_positions
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
    cache = KNormCache(config=model.config, key_scales=key_scales(model.config) if original else None,
                       value_scales=value_scales(model.config) if original else None, **options)
    check_model = getattr(cache.settings.score, "check_model", None)  # a fitted score (KVzap) belongs to one model
    if check_model is not None:
        check_model(model)
    return cache


def _check_cache_saw_padding(cache: KNormCache) -> None:
    """Raise if a padded batch went through ``cache`` without its layers seeing the padding: the model did not hand
    ``Cache.update`` its position ids (Transformers before 5.24, GPT-NeoX; :func:`hf_knorm.compat.update_position_ids`),
    so the rows were evicted as one unpadded block."""
    if any(isinstance(layer, KNormLayer) for layer in cache.layers) and not cache.is_padded():
        raise ValueError("This model does not give the cache its position ids (Transformers before 5.24, or a model "
                         "such as GPT-NeoX that calls Cache.update without them), so KNormCache cannot see a padded "
                         "batch's padding: generate one sequence at a time.")


def padded_kwargs(attention_mask: torch.Tensor | None) -> dict:
    """The keywords of a forward over a left-padded batch (``attention_mask`` (B, n) and its ``position_ids``, as
    ``generate`` derives them); nothing for an unpadded one (the call is then the unpadded one, unchanged)."""
    if not has_padding(attention_mask):
        return {}
    return {"attention_mask": attention_mask, "position_ids": mask_positions(attention_mask)}


@torch.no_grad()
def knorm_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   score_basis: str | None = None, tokenizer=None, chat_template: bool | None = None,
                   **kwargs) -> torch.Tensor:
    """``model.generate`` with the prompt's KV cache compressed by KNorm.

    Args:
        model (PreTrainedModel): A supported decoder-only model.
        input_ids (torch.Tensor): (B, n) prompt ids, left-padded if the prompts differ in length.
        attention_mask (torch.Tensor, optional): (B, n), 0 on the left padding. A padded batch keeps each row's own
            tokens (:mod:`hf_knorm.eviction.rows`: a row's budget is of its own length, padding never kept) and
            generates what each prompt generates alone; the model attends with ``"knorm_ragged"`` for the call.
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
    options = {name: kwargs.pop(name) for name in CACHE_OPTIONS if name in kwargs}
    cache = knorm_cache_for(model, score_basis=score_basis, **options)
    padded = has_padding(attention_mask)
    if padded:
        check_left_padded(attention_mask)
    if cache.settings.deferred:
        _check_tokenizer(tokenizer)
        shortest = int(attention_mask.sum(-1).min()) if padded else input_ids.shape[1]
        if shortest < 2:
            raise ValueError("score='kvzip' compresses the prompt but its last token: give at least 2 prompt tokens "
                             "(in every row).")
        context_ids = input_ids[:, :-1]
        context_mask = attention_mask[:, :-1] if padded else None
        with ragged_attention_for(model, cache, padded):
            if padded and cache.can_stack_rows():
                prefill_rows(model, cache, context_ids, context_mask)
            else:
                model(input_ids=context_ids, **padded_kwargs(context_mask), **cache_kwargs(cache), use_cache=True)
        if padded:
            _check_cache_saw_padding(cache)
        compress_by_reconstruction(model, cache, context_ids, tokenizer, chat_template)
    elif padded and cache.can_stack_rows() and _one_sequence_per_row(model, kwargs) and \
            int(attention_mask.sum(-1).min()) >= 2:
        with ragged_attention_for(model, cache, padded):  # each prompt but its last token, row by row, left open
            prefill_rows(model, cache, input_ids[:, :-1], attention_mask[:, :-1], prompt_open=True)
    with ragged_attention_for(model, cache, padded):  # head budgets or padding: the attention that masks per head/row
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache), **kwargs)
    if padded:
        _check_cache_saw_padding(cache)  # raised rather than returned: the rows were not evicted as rows
    return out


def _one_sequence_per_row(model, generate_kwargs: dict) -> bool:
    """True when ``generate`` keeps one sequence per input row (no beams, one sequence returned, no assistant): only
    then can the rows be prefilled before ``generate`` (it expands the rows of its inputs, not of a filled cache)."""
    config = generate_kwargs.get("generation_config") or model.generation_config
    setting = lambda name, default: generate_kwargs.get(name, getattr(config, name, default))  # noqa: E731
    return (setting("num_beams", 1) or 1) == 1 and (setting("num_return_sequences", 1) or 1) == 1 and not (
        generate_kwargs.get("assistant_model") or setting("prompt_lookup_num_tokens", None))


@torch.no_grad()
def append_tokens(model, cache: KNormCache, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> None:
    """Run (B, m) new tokens through ``model`` onto ``cache`` (uncompressed): in one forward where the cache takes
    several tokens (:meth:`KNormCache.takes_several_tokens`), else one token per forward (per-layer ratios, head
    budgets; a padded batch's padding tokens are then read as padding by their position ids). ``attention_mask``
    (B, past + m): the whole batch's, for a left-padded one."""
    if input_ids.shape[1] == 0:
        return
    several = cache.takes_several_tokens()
    if has_padding(attention_mask) and not several and not cache.is_padded():
        raise ValueError("Left-padded tokens onto an unpadded KNormCache that takes one token per forward (per-layer "
                         "ratios or head budgets): pad the prompts too, or use one ratio for every layer and "
                         "head_budget='uniform'.")
    steps = [input_ids] if several else list(input_ids.split(1, dim=1))
    done = attention_mask.shape[1] - input_ids.shape[1] if attention_mask is not None else 0
    for step in steps:
        done += step.shape[1]
        mask = None if attention_mask is None else attention_mask[:, :done]
        positions = padded_kwargs(mask).get("position_ids")
        extra = {} if positions is None else {"attention_mask": mask, "position_ids": positions[:, -step.shape[1]:]}
        model(input_ids=step, **extra, **cache_kwargs(cache), use_cache=True)


def generate_after(model, cache: KNormCache, context_ids: torch.Tensor, new_ids: torch.Tensor,
                   context_mask: torch.Tensor | None = None, new_mask: torch.Tensor | None = None,
                   **generate_kwargs):
    """Append ``new_ids`` (B, m >= 1) to a cache holding ``context_ids`` (B, n) and generate; returns the new tokens.

    Where the cache takes several tokens per forward ``generate`` feeds ``new_ids`` itself; otherwise all but the
    last are fed one by one first. ``context_mask`` (B, n) and ``new_mask`` (B, m): the left padding of a batch of
    contexts and of new tokens (each row's real new tokens are its last ones; default: no padding).
    """
    mask = torch.cat([torch.ones_like(context_ids) if context_mask is None else context_mask,
                      torch.ones_like(new_ids) if new_mask is None else new_mask], dim=1)
    if not cache.takes_several_tokens():
        append_tokens(model, cache, new_ids[:, :-1], mask[:, :-1])
    ids = torch.cat([context_ids, new_ids], dim=1)
    with ragged_attention_for(model, cache, has_padding(mask)):
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), **generate_kwargs)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def answer_after_context(model, cache: KNormCache, context_ids: torch.Tensor, question_ids: torch.Tensor, *,
                         prefilled=None, tokenizer=None, chat_template: bool | None = None,
                         importance: dict[int, torch.Tensor] | None = None, **generate_kwargs) -> torch.Tensor:
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
        importance (dict, optional): For ``score="kvzip"``, the context's reconstruction importance already computed
            (:func:`answer_questions`).
        **generate_kwargs: ``model.generate`` arguments (``max_new_tokens``, ``do_sample``, ``pad_token_id``, ...).

    Returns:
        torch.Tensor: (B, new) the answer's token ids.
    """
    return answer_questions(model, cache, context_ids, [question_ids], prefilled=prefilled, tokenizer=tokenizer,
                            chat_template=chat_template, importance=importance, **generate_kwargs)[0]


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
                     context_mask: torch.Tensor | None = None, question_masks: list[torch.Tensor | None] | None = None,
                     importance: dict[int, torch.Tensor] | None = None, **generate_kwargs) -> list[torch.Tensor]:
    """Compress once, ask many: the context is prefilled and compressed into ``cache`` once (scores included), then
    each question is appended to a copy of the compressed cache (:func:`fork_cache`; the last question to ``cache``
    itself) and answered. For a query-agnostic score this gives every question the answer of
    :func:`answer_after_context` run on it alone (tested), without recomputing the context or the scores.

    Args:
        questions (list of torch.Tensor): (B, m_i >= 1) ids of each question (and answer prefix), not compressed.
        context_mask (torch.Tensor, optional): (B, n), 0 on the left padding of a batch of contexts of different
            lengths (each row is compressed as its context alone, :mod:`hf_knorm.eviction.rows`).
        question_masks (list of torch.Tensor, optional): per question (B, m_i), 0 on its left padding.
        importance (dict, optional): For ``score="kvzip"``: this context's reconstruction importance, already
            computed (:func:`hf_knorm.eviction.reconstruction.reconstruction_scores` on the same prefill, the same
            settings but the compression ratio, which it does not depend on): the cache is compressed by it, not
            scored again. A benchmark of several ratios reconstructs each context once.
        Others: as :func:`answer_after_context`.

    Returns:
        list of torch.Tensor: per question, (B, new) the answer's ids.
    """
    if not questions:
        raise ValueError("answer_questions needs at least one question.")
    if importance is not None and not cache.settings.deferred:
        raise ValueError(f"importance= is a reconstruction score's (score='kvzip'); this cache's score "
                         f"{cache.settings.score.name!r} compresses at the prefill.")
    if cache.settings.deferred and importance is None:
        _check_tokenizer(tokenizer)
    question_masks = question_masks or [None] * len(questions)
    padded = has_padding(context_mask) or any(has_padding(mask) for mask in question_masks)
    for mask in (context_mask, *question_masks):
        check_left_padded(mask)
    if padded and prefilled is not None:
        raise ValueError("answer_questions takes a prefilled cache for unpadded contexts only; pass the padded "
                         "contexts' ids and mask instead.")
    with ragged_attention_for(model, cache, padded):  # head budgets or padding: the attention that masks
        if prefilled is None and has_padding(context_mask) and cache.can_stack_rows():
            prefill_rows(model, cache, context_ids, context_mask)
        elif prefilled is None:  # prefill: compressed here
            model(input_ids=context_ids, **padded_kwargs(context_mask), **cache_kwargs(cache), use_cache=True)
        else:
            cache.prefill_from(prefilled)
        if has_padding(context_mask):
            _check_cache_saw_padding(cache)
        if cache.settings.deferred and importance is not None:
            cache.compress_prompts({index: scores.clone() for index, scores in importance.items()})
        elif cache.settings.deferred:
            compress_by_reconstruction(model, cache, context_ids, tokenizer, chat_template)
        answers = []
        for index, (question_ids, question_mask) in enumerate(zip(questions, question_masks)):
            target = cache if index == len(questions) - 1 else fork_cache(cache)
            answers.append(generate_after(model, target, context_ids, question_ids, context_mask, question_mask,
                                          **generate_kwargs))
        return answers


def prefill_rows(model, cache: KNormCache, context_ids: torch.Tensor, context_mask: torch.Tensor, *,
                 prompt_open: bool = False) -> None:
    """Prefill a left-padded batch of contexts into the empty ``cache`` one row at a time: each row's real tokens
    alone into a copy of ``cache`` (:func:`fork_cache`), compressed there as that context alone, then the rows
    stacked into ``cache`` (:meth:`KNormCache.stack_rows`), which then holds what the padded prefill would have left.
    The forward computes no padding (docs/results/knorm.md, "Padded batches").

    Args:
        context_ids (torch.Tensor): (B, n) left-padded contexts.
        context_mask (torch.Tensor): (B, n) their attention mask, 0 on the padding.
        prompt_open (bool): The contexts are each prompt but its last token: they are stored uncompressed (into a
            ``DynamicCache`` per row), and the next step, the prompts' last tokens, compresses each row as its whole
            prompt (``knorm_generate``).
    """
    alone = []
    for row in range(context_ids.shape[0]):
        row_cache = DynamicCache() if prompt_open else fork_cache(cache)
        ids = context_ids[row:row + 1, context_mask[row].bool()]
        model(input_ids=ids, **cache_kwargs(row_cache), use_cache=True)
        alone.append(row_cache)
    cache.stack_rows(alone, width=context_ids.shape[1], prompt_open=prompt_open)


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


@dataclass(frozen=True)
class EncodedPrompt:
    """One input of the ``knorm-text-generation`` pipeline, tokenized (what ``preprocess`` hands on).

    Attributes:
        context_ids (torch.Tensor): (1, n) the context, compressed.
        question_ids (tuple of torch.Tensor): (1, m_i) each question (and answer prefix), not compressed.
        several (bool): The call asked a list of questions (the answer is then a list).
    """

    context_ids: torch.Tensor
    question_ids: tuple
    several: bool


class KNormTextGenerationPipeline(Pipeline):
    """``pipeline("knorm-text-generation", model=..., tokenizer=...)``: answer a question about a compressed context.

    Call: ``pipe(context, question=..., compression_ratio=0.5, max_new_tokens=16)`` -> ``{"answer": str}``; with a
    list of questions, ``question=[q1, q2, ...]`` -> ``[{"answer": str}, ...]``: the context is compressed once and
    each question answered from a copy of that cache (:func:`answer_questions`). Other
    keywords: the :class:`KNormCache` options, ``score_basis``, ``chat_template`` (default: use the tokenizer's),
    ``answer_prefix`` (text the answer starts with, kept out of the answer), and ``model.generate`` arguments
    (``do_sample``, ``temperature``, ...).

    A list of contexts, ``pipe([c1, c2, ...], question=..., batch_size=8)``, runs ``batch_size`` of them at a time as
    one left-padded batch (:mod:`hf_knorm.eviction.rows`: each row keeps its own tokens, at a budget of its own
    length), giving what each context gives alone; the contexts of a batch ask the same number of questions. Batching
    needs the tokenizer's ``pad_token_id`` (Transformers' pipelines refuse to batch without one); the padding's side
    is the plugin's (left), whatever the tokenizer's.
    """

    _pipeline_calls_generate = True

    def _sanitize_parameters(self, question=None, chat_template=None, answer_prefix="", score_basis=None, **kwargs):
        preprocess = dict(question=question, chat_template=chat_template, answer_prefix=answer_prefix)
        cache_options = {name: kwargs.pop(name) for name in CACHE_OPTIONS if name in kwargs}
        forward = dict(cache_options=cache_options, score_basis=score_basis, chat_template=chat_template,
                       generate_kwargs=kwargs)
        return preprocess, forward, {}

    def preprocess(self, context: str, question=None, chat_template=None, answer_prefix: str = "") -> dict:
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
        return {"prompt": EncodedPrompt(context_ids, tuple(q for _, q in encoded), several)}

    def _forward(self, inputs, cache_options, score_basis, generate_kwargs, chat_template=None):
        batched = isinstance(inputs["prompt"], list)  # batch_size > 1: Transformers' collate lists the prompts
        prompts = inputs["prompt"] if batched else [inputs["prompt"]]
        if len({len(prompt.question_ids) for prompt in prompts}) > 1:
            raise ValueError("The contexts of a batch ask different numbers of questions; give each the same number, "
                             "or use batch_size=1.")
        device = self.model.device
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        kwargs = dict(generate_kwargs)
        if self.tokenizer.pad_token_id is None and "pad_token_id" not in kwargs:
            kwargs["pad_token_id"] = self.tokenizer.eos_token_id
        context_ids, context_mask = left_pad([prompt.context_ids[0].to(device) for prompt in prompts], pad_id)
        questions, question_masks = [], []
        for index in range(len(prompts[0].question_ids)):
            ids, mask = left_pad([prompt.question_ids[index][0].to(device) for prompt in prompts], pad_id)
            questions.append(ids)
            question_masks.append(mask)
        cache = knorm_cache_for(self.model, score_basis=score_basis, **cache_options)
        new_ids = answer_questions(self.model, cache, context_ids, questions, tokenizer=self.tokenizer,
                                   chat_template=chat_template, context_mask=context_mask,
                                   question_masks=question_masks, **kwargs)
        rows = [{"new_ids": [ids[row] for ids in new_ids], "several": prompt.several,
                 "stored_tokens": _stored_tokens(cache, row)} for row, prompt in enumerate(prompts)]
        if not batched:
            return rows[0]
        return {key: [row[key] for row in rows] for key in ("new_ids", "several", "stored_tokens")}

    def postprocess(self, outputs):
        answers = [{"answer": self.tokenizer.decode(ids, skip_special_tokens=True).strip()}
                   for ids in outputs["new_ids"]]
        return answers if outputs["several"] else answers[0]


def _stored_tokens(cache: KNormCache, row: int) -> list[int]:
    """Tokens batch row ``row`` stores per head, layer by layer (the longest head's; a padded row's own)."""
    if any(isinstance(layer, KNormLayer) for layer in cache.layers) and not cache.is_padded():
        return cache.stored_tokens()
    return [int(cache.stored_per_head(index)[row].max()) if isinstance(layer, KNormLayer) else stored
            for index, (layer, stored) in enumerate(zip(cache.layers, cache.stored_tokens()))]


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

