"""KVzip's context reconstruction (Kim et al., arXiv 2505.23416): score a prefilled KNorm cache by the attention the
model pays to it while repeating the context, then compress it.

The protocol (the paper's, with the authors' prompts, github snu-mllab/KVzip ``model/wrapper.py``):

- the context, in the chat template's user turn, is prefilled into a :class:`~hf_knorm.KNormCache` with
  ``score="kvzip"``, which stores it whole (:attr:`EvictionSettings.deferred <hf_knorm.eviction.settings.
  EvictionSettings.deferred>`);
- the context tokens after the template's prefix are cut into chunks of ``chunk_size``; chunk ``c`` is fed as
  ``"\\n\\nRepeat the previous context exactly."`` (chunk 0) or ``"\\n\\nRepeat the part of the previous context
  exactly, starting with"`` plus the previous chunk's last ``tail`` tokens (later chunks), then the template's end of
  the user turn and assistant header, then the chunk itself (teacher-forced), each chunk's forward attending the full
  cached context plus its own tokens (causally) and nothing of the other chunks;
- in every full-attention layer, each cached pair's importance is the largest softmax weight any reconstruction query of
  its KV head's group gives it, over all chunks, computed with the layer's attention output in one pass over the
  scores (:func:`hf_knorm.eviction.max_weight.attention_with_max_weights`, from the post-RoPE queries and keys the
  attention receives, by the ``"knorm_capture"`` attention below);
- the cache keeps the most important pairs per KV head (:meth:`hf_knorm.KNormCache.compress_prompts`: the same budgets,
  protections and schedules as every score).

Two differences from the authors' code, both on the side of the definition: their softmax for chunk ``c`` spans only
the sinks, chunk ``c``'s own span of the context and the repeated chunk, and only that span is scored by chunk ``c``;
here every row's softmax spans everything it attends and every chunk scores the whole context (max over chunks).

The reconstruction runs on a plain cache that reads the KNorm cache's stored prompt without copying it (sliding-window
layers are copied shallowly) and is dropped after each chunk; the KNorm cache itself is untouched until
``compress_prompts``. During the reconstruction the scored layers attend through
:func:`~hf_knorm.eviction.max_weight.attention_with_max_weights` (its output equals Transformers' SDPA attention's, to
rounding), the other layers (sliding windows) through Transformers' SDPA (``sdpa_attention_forward``): it needs softmax
attention, so models patched with another normalization, softcapped attention (Gemma 2) and attention sinks are
refused.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..compat import cache_kwargs
from .registered_attention import register_attention
from .cache import KNormCache, KNormLayer
from .max_weight import attention_with_max_weights

__all__ = ["CAPTURE_ATTENTION", "FIRST_PROMPT", "NEXT_PROMPT", "ReconstructionPrompt", "capture_attention",
           "compress_by_reconstruction", "reconstruction_chunks", "reconstruction_importance", "reconstruction_prompt",
           "reconstruction_scores", "shared_scoring"]

CAPTURE_ATTENTION = "knorm_capture"
FIRST_PROMPT = "Repeat the previous context exactly."
NEXT_PROMPT = "Repeat the part of the previous context exactly, starting with"


@dataclass
class _Scoring:
    """What the ``"knorm_capture"`` attention scores during a reconstruction: ``scored`` maps a layer index to its
    prompt length (the leading keys to score); ``importance`` gathers, per layer, the (B, H_kv, n) running maximum
    over the reconstruction's attention calls."""

    scored: dict[int, int]
    importance: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, index: int, weights: torch.Tensor) -> None:
        held = self.importance.get(index)
        self.importance[index] = weights if held is None else torch.maximum(held, weights)


_SCORING: contextvars.ContextVar[_Scoring | None] = contextvars.ContextVar("hf_knorm_capture", default=None)


@dataclass(frozen=True)
class ReconstructionPrompt:
    """The token ids around a reconstruction chunk, (1, k) int64 each.

    Attributes:
        prefix_ids: the chat template's text before the user's content (empty without a template); the context's
            tokens that match it are not repeated.
        first_ids: ``"\\n\\n" + FIRST_PROMPT``, before chunk 0.
        next_ids: ``"\\n\\n" + NEXT_PROMPT``, before the previous chunk's tail in later chunks.
        suffix_ids: the template's end of the user turn and assistant header (``"\\n"`` without a template).
    """

    prefix_ids: torch.Tensor
    first_ids: torch.Tensor
    next_ids: torch.Tensor
    suffix_ids: torch.Tensor


def reconstruction_prompt(tokenizer, chat_template: bool | None = None) -> ReconstructionPrompt:
    """The reconstruction's prompt pieces for ``tokenizer``, with its chat template unless ``chat_template=False``
    (default: use it when the tokenizer has one). The user turn is ``context + "\\n\\n" + instruction``, the
    convention of the ``knorm-text-generation`` pipeline (:func:`hf_knorm.eviction.pipeline.split_prompt`) and of
    kvpress."""
    if chat_template is None:
        chat_template = getattr(tokenizer, "chat_template", None) is not None
    instruction = "\n\n" + FIRST_PROMPT
    if chat_template:
        full = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                             add_generation_prompt=True)
        if instruction not in full:
            raise ValueError("The tokenizer's chat template changes the user's text (it trims it?): the "
                             "reconstruction prompt cannot be placed in it; pass chat_template=False.")
        cut = full.rindex(instruction)
        prefix, suffix = full[:cut], full[cut + len(instruction):]
    else:
        prefix, suffix = "", "\n"

    def encode(text):
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].reshape(1, -1).long()

    return ReconstructionPrompt(encode(prefix), encode(instruction), encode("\n\n" + NEXT_PROMPT), encode(suffix))


def reconstruction_chunks(context_ids: torch.Tensor, prompt: ReconstructionPrompt, chunk_size: int,
                          tail: int) -> list[torch.Tensor]:
    """The inputs of the reconstruction forwards, (B, m_c) each.

    Args:
        context_ids (torch.Tensor): (B, n) the prefilled context (template prefix included).
        prompt (ReconstructionPrompt): :func:`reconstruction_prompt`.
        chunk_size, tail (int): :class:`hf_knorm.eviction.scores.KVzip`'s.

    The repeated tokens are those after the longest run of leading tokens shared with ``prompt.prefix_ids``.
    """
    batch, n = context_ids.shape
    prefix = prompt.prefix_ids[0].to(context_ids.device)
    shared = 0
    while shared < min(n, prefix.numel()) and bool((context_ids[:, shared] == prefix[shared]).all()):
        shared += 1
    body = context_ids[:, shared:]
    if body.shape[1] == 0:
        raise ValueError("The context has no tokens after the chat template's prefix: there is nothing to reconstruct.")
    expand = lambda ids: ids.to(context_ids.device).expand(batch, -1)
    chunks = list(body.split(chunk_size, dim=1))
    inputs = []
    for index, chunk in enumerate(chunks):
        lead = [expand(prompt.first_ids)] if index == 0 else [expand(prompt.next_ids), chunks[index - 1][:, -tail:]
                                                               if tail else chunks[index - 1][:, :0]]
        inputs.append(torch.cat([*lead, expand(prompt.suffix_ids), chunk], dim=1))
    return inputs


def capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Transformers' attention interface during a reconstruction (:func:`_scoring`).

    A scored layer's (B, H_q, m, D) query, (B, H_kv, L, D) key and value (post-RoPE, the cache's keys included) go
    through :func:`~hf_knorm.eviction.max_weight.attention_with_max_weights`: its output is returned as SDPA's
    would be, (B, m, H_q, D_v), and the largest weights of the layer's prompt keys are added to the active
    :class:`_Scoring`. Other layers (sliding windows, or no reconstruction active) run Transformers' SDPA attention.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("score='kvzip' computes softmax weights without logit softcapping; this model (Gemma 2?) "
                         "softcaps its attention. Use another score.")
    scoring = _SCORING.get()
    index = getattr(module, "layer_idx", None)
    if scoring is None or index not in scoring.scored:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("score='kvzip' computes plain softmax weights; this model adds attention sinks or a position "
                         "bias to its attention. Use another score.")
    if kwargs.get("dropout", 0.0):
        raise ValueError("score='kvzip' runs the reconstruction without attention dropout: put the model in eval().")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and is_causal and 1 < query.shape[2] < key.shape[2]:  # SDPA would align it top-left
        raise ValueError("score='kvzip' got a causal attention call with more keys than queries and no mask; "
                         "Transformers builds one for the reconstruction's cache (is the model's mask custom?).")
    output, weights = attention_with_max_weights(query, key, value, attention_mask, scoring.scored[index],
                                                 kwargs.get("scaling", getattr(module, "scaling", None)), is_causal)
    scoring.add(index, weights)
    return output.transpose(1, 2).contiguous(), None


@contextmanager
def _scoring(model, scoring: _Scoring):
    """Run ``model`` with the ``"knorm_capture"`` attention scoring into ``scoring`` while the block runs; the model's
    own attention is given back afterwards, even on error."""
    original = model.config._attn_implementation
    token = _SCORING.set(scoring)
    register_attention(CAPTURE_ATTENTION, capture_attention, sdpa_mask, "KVzip's reconstruction (score='kvzip')")
    model.set_attn_implementation(CAPTURE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
        _SCORING.reset(token)


def _reading_cache(cache: KNormCache) -> Cache:
    """A plain cache holding ``cache``'s stored prompt (full-attention layers read it without a copy; sliding layers
    are shallow copies): a reconstruction forward appends to it, not to ``cache``."""
    layers = []
    for layer in cache.layers:
        if isinstance(layer, KNormLayer):
            keys, values, _ = layer.prompt_slots()
            plain = DynamicLayer()
            plain.lazy_initialization(keys, values)
            plain.keys, plain.values = keys, values
            layers.append(plain)
        else:
            layers.append(copy.copy(layer))  # Transformers' layers replace their tensors on update, never write them
    return Cache(layers=layers)


def _check_model(model) -> None:
    config = model.config.get_text_config(decoder=True)
    normalization = (getattr(config, "hf_knorm", None) or {}).get("normalization")
    if normalization is not None:
        raise ValueError(f"score='kvzip' scores softmax attention weights; this model is patched with "
                         f"{normalization}, whose weights are not a softmax. Use another score with patched models.")


@torch.no_grad()
def reconstruction_importance(model, cache: KNormCache, chunks: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """KVzip's importance of every KNorm layer's stored prompt: layer index -> (B, H_kv, n) fp32 (fp64 for an fp64
    model), the largest softmax weight each cached pair receives from the reconstruction's queries (module
    docstring). ``cache`` holds its prompt uncompressed (a ``KNormCache(score="kvzip")`` after the prefill) and is not
    changed."""
    _check_model(model)
    if not cache.awaits_importance():
        raise ValueError("This KNormCache is not waiting for a reconstruction score: it needs score='kvzip' and is "
                         "scored once, right after the prefill.")
    scored = {layer.layer_idx: layer.prompt_length for layer in cache.layers if isinstance(layer, KNormLayer)}
    if not scored or any(layer.cumulative_length != layer.prompt_length or not layer.prompt_length
                         for layer in cache.layers if isinstance(layer, KNormLayer)):
        raise ValueError("The reconstruction needs a KNormCache holding exactly its prompt, uncompressed "
                         "(KNormCache(score='kvzip') right after the prefill).")
    return _importance(model, _reading_cache(cache), scored, chunks)


def _importance(model, reading: Cache, scored: dict[int, int], chunks: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run the reconstruction ``chunks`` on copies of ``reading`` (a plain cache holding the prompt) and return, per
    layer index of ``scored`` (-> its prompt length), the (B, H_kv, n) largest weight each cached pair receives."""
    scoring = _Scoring(scored)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with _scoring(model, scoring):
        for ids in chunks:
            model(input_ids=ids, **cache_kwargs(_copied(reading)), use_cache=True, **extra)
    missing = sorted(set(scored) - set(scoring.importance))
    if missing:
        raise ValueError(f"The reconstruction saw no attention call of layer(s) {missing}: the model does not attend "
                         "through Transformers' attention interface.")
    return scoring.importance


def _copied(reading: Cache) -> Cache:
    """A plain cache reading ``reading``'s tensors (no copy): each chunk appends to its own, then drops it."""
    return Cache(layers=[copy.copy(layer) for layer in reading.layers])


def _row_importance(model, cache: KNormCache, context_ids: torch.Tensor, prompt: ReconstructionPrompt,
                    chunk_size: int, tail: int) -> dict[int, torch.Tensor]:
    """KVzip's importance for a left-padded batch (:mod:`hf_knorm.eviction.rows`): each row's reconstruction runs on
    the row alone (its real context tokens and its cached pairs), as it would unbatched; returned in the padded
    layout, (B, H_kv, N) per layer, 0 on padding (never read: a row is ranked on its real slots only)."""
    layers = [layer for layer in cache.layers if isinstance(layer, KNormLayer)]
    if len(layers) != len(cache.layers):
        raise ValueError("score='kvzip' on a padded batch runs each row's reconstruction alone, which this model's "
                         "sliding-window layers do not support: generate one sequence at a time.")
    prompts = [layer.prompt_slots() for layer in layers]  # the padded layout, padding at position -1
    live = prompts[0][2][:, 0] >= 0  # (B, N): the same real slots in every layer before compression
    importance = {layer.layer_idx: positions.new_zeros(positions.shape, dtype=torch.float32)
                  for layer, (_, _, positions) in zip(layers, prompts)}
    for row in range(context_ids.shape[0]):
        slots = live[row].nonzero().squeeze(-1)
        reading = []
        for keys, values, _ in prompts:
            plain = DynamicLayer()
            keys, values = keys[row:row + 1, :, slots], values[row:row + 1, :, slots]
            plain.lazy_initialization(keys, values)
            plain.keys, plain.values = keys, values
            reading.append(plain)
        chunks = reconstruction_chunks(context_ids[row:row + 1, slots], prompt, chunk_size, tail)
        scored = {layer.layer_idx: slots.numel() for layer in layers}
        for index, weights in _importance(model, Cache(layers=reading), scored, chunks).items():
            importance[index] = importance[index].to(weights.dtype)
            importance[index][row:row + 1, :, slots] = weights
    return importance


def compress_by_reconstruction(model, cache: KNormCache, context_ids: torch.Tensor, tokenizer,
                               chat_template: bool | None = None) -> dict[int, torch.Tensor]:
    """Score ``cache``'s prefilled context by KVzip's reconstruction (:func:`reconstruction_scores`) and compress it.

    Returns:
        dict: the importance per KNorm layer, after ``cache`` is compressed by it. It does not depend on the
        compression ratio: another cache of the same settings but its ratio, prefilled with the same context, is
        compressed by it without a second reconstruction (``cache.compress_prompts(importance)``).
    """
    importance = reconstruction_scores(model, cache, context_ids, tokenizer, chat_template)
    cache.compress_prompts(importance)
    return importance


def shared_scoring(options: dict) -> str:
    """A key of a cache's options but its compression ratio: caches with equal keys, prefilled with one context, get
    the same reconstruction importance (it does not depend on the ratio), so a benchmark of several ratios computes it
    once per key (:func:`reconstruction_scores`)."""
    return repr(sorted((name, value) for name, value in options.items() if name != "compression_ratio"))


def reconstruction_scores(model, cache: KNormCache, context_ids: torch.Tensor, tokenizer,
                          chat_template: bool | None = None) -> dict[int, torch.Tensor]:
    """Score ``cache``'s prefilled context by KVzip's reconstruction (module docstring), leaving it uncompressed.

    Args:
        model (PreTrainedModel): The decoder the context was prefilled with (softmax attention).
        cache (KNormCache): A ``KNormCache(score="kvzip", ...)`` holding exactly the prefilled context.
        context_ids (torch.Tensor): (B, n) the context's ids, as prefilled; left-padded rows (a padded batch,
            :mod:`hf_knorm.eviction.rows`) are reconstructed one row at a time, each as it would be alone.
        tokenizer: The model's tokenizer (the reconstruction prompt is text).
        chat_template (bool, optional): Wrap the prompt in the tokenizer's chat template (default: when it has one).

    Returns:
        dict: the importance per KNorm layer (:func:`reconstruction_importance`); ``cache`` still holds the whole
        context.
    """
    score = cache.settings.score
    if not cache.settings.deferred:
        raise ValueError(f"The reconstruction score is for score='kvzip'; this cache's score is {score.name!r}.")
    if tokenizer is None:
        raise ValueError("score='kvzip' needs the tokenizer (its reconstruction prompt is text): pass tokenizer=.")
    prompt = reconstruction_prompt(tokenizer, chat_template)
    if any(getattr(layer, "row_lengths", None) is not None for layer in cache.layers):  # a padded batch: by row
        _check_model(model)
        if not cache.awaits_importance():
            raise ValueError("This KNormCache is not waiting for a reconstruction score: it needs score='kvzip' and "
                             "is scored once, right after the prefill.")
        importance = _row_importance(model, cache, context_ids, prompt, score.chunk_size, score.tail)
    else:
        chunks = reconstruction_chunks(context_ids, prompt, score.chunk_size, score.tail)
        importance = reconstruction_importance(model, cache, chunks)
    return importance


