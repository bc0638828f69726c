"""``generate`` on a ``p = 1`` model decodes with a :class:`~.cache.RecurrentStateCache` unless told otherwise.

However the model was made: patched by :func:`hf_knorm.patch`, loaded by :func:`hf_knorm.from_pretrained`, by plain
``AutoModelForCausalLM.from_pretrained`` or a pipeline, built by ``from_config`` from a patched config, copied. The
choice is made where ``generate`` builds its default cache (:func:`hf_knorm.compat.choose_default_generation_cache`,
registered by :func:`register` when the first ``p = 1`` model is made: by :func:`hf_knorm.patch` or when it is built
from its config; a process that makes none keeps Transformers' own method), from the model's config: a model that
runs the plugin's attention with a ``p = 1`` normalization (``x/1``, ``x/16``, ``x/sqrtN``, with or without a softmax
window) in every layer (:func:`~.cache.decodes_with_state`) gets a fresh ``RecurrentStateCache(config=model.config)``
and the step-end check of :func:`~.cache.watch_steps`. A model with a sparse cache beside its window (the default
conversion's ``... + sparse 256 (prefix_kv_diff) + clusters 600``) holds a large state, as many bytes as about 970
tokens' keys and values on the default model: a call whose sequences stay at or below that crossover
(:mod:`.crossover`) keeps Transformers' K/V cache, the same tokens in less memory. Without a sparse cache the state
is small (the crossover is ``W + D / 2`` tokens: 32 on the default model with ``x/1``, 96 with a window of 64), and
it is kept from the first token.

The call keeps the cache it asks for: its own (``cache=``, ``past_key_values=``), a ``cache_implementation``, none
(``use_cache=False``); and a call that rewinds its cache (assisted or prompt-lookup decoding, an assistant's own
call) keeps the ``DynamicCache``, which a state cannot replace (a state cannot be cropped).
"""

from __future__ import annotations

import torch.nn as nn

from ..attention.held import running_normalization
from ..compat import choose_default_generation_cache
from .cache import RecurrentStateCache, decodes_with_state, watch_steps
from .crossover import keeps_plain_cache

__all__ = ["default_cache", "register"]

CHOOSER = "hf_knorm_recurrent_state"


def default_cache(model: nn.Module, rewinds: bool, max_cache_length: int | None = None) -> RecurrentStateCache | None:
    """The cache ``generate`` decodes ``model`` with when the call asks for none: a :class:`RecurrentStateCache` when
    the model decodes with a state, the call does not rewind its cache and its sequences may grow past the crossover
    (``max_cache_length`` tokens: :mod:`.crossover`), else ``None`` (Transformers' own K/V cache, the smaller one
    there)."""
    if rewinds or not decodes_with_state(model.config):
        return None
    if max_cache_length is not None and below_crossover(model, max_cache_length):
        return None
    watch_steps(model)  # a layer that misses its state is an error at the step's end (idempotent)
    return RecurrentStateCache(config=model.config)


def below_crossover(model: nn.Module, max_cache_length: int) -> bool:
    """Whether ``model`` has a sparse cache beside its window and its plain K/V cache of ``max_cache_length`` tokens
    holds at most its state's bytes (:func:`.crossover.keeps_plain_cache`): the typed normalization its attention
    modules hold (:mod:`hf_knorm.attention.held`), the dimensions from its config."""
    normalization = next((held for held in map(running_normalization, model.modules()) if held is not None), None)
    if normalization is None or not normalization.sparse:
        return False  # without a sparse cache the state is kept from the first token (see the module docstring)
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return keeps_plain_cache(normalization, kv_heads, head_dim, model.dtype, max_cache_length)


def register() -> None:
    """Make ``generate`` ask :func:`default_cache` (idempotent; called by :func:`hf_knorm.patch` and the build hook of
    :mod:`hf_knorm.models.parameters` for the first ``p = 1`` model)."""
    choose_default_generation_cache(CHOOSER, default_cache)
