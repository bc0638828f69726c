"""``generate`` on a ``p = 1`` model decodes with a :class:`~.cache.RecurrentStateCache` unless told otherwise.

However the model was made: patched by :func:`hf_knorm.patch`, loaded by :func:`hf_knorm.from_pretrained`, by plain
``AutoModelForCausalLM.from_pretrained`` or a pipeline, built by ``from_config`` from a patched config, copied. The
choice is made where ``generate`` builds its default cache (:func:`hf_knorm.compat.choose_default_generation_cache`,
registered by :func:`register` when the first ``p = 1`` model is made: by :func:`hf_knorm.patch` or when it is built
from its config; a process that makes none keeps Transformers' own method), from the model's config: a model that
runs the plugin's attention with a ``p = 1`` normalization (``x/1``, ``x/16``, ``x/sqrtN``, with or without a softmax
window) in every layer (:func:`~.cache.decodes_with_state`) gets a fresh ``RecurrentStateCache(config=model.config)``
and the step-end check of :func:`~.cache.watch_steps`.

The call keeps the cache it asks for: its own (``cache=``, ``past_key_values=``), a ``cache_implementation``, none
(``use_cache=False``); and a call that rewinds its cache (assisted or prompt-lookup decoding, an assistant's own
call) keeps the ``DynamicCache``, which a state cannot replace (a state cannot be cropped).
"""

from __future__ import annotations

import torch.nn as nn

from ..compat import choose_default_generation_cache
from .cache import RecurrentStateCache, decodes_with_state, watch_steps

__all__ = ["default_cache", "register"]

CHOOSER = "hf_knorm_recurrent_state"


def default_cache(model: nn.Module, rewinds: bool) -> RecurrentStateCache | None:
    """The cache ``generate`` decodes ``model`` with when the call asks for none: a :class:`RecurrentStateCache` when
    the model decodes with a state and the call does not rewind its cache, else ``None`` (Transformers' own)."""
    if rewinds or not decodes_with_state(model.config):
        return None
    watch_steps(model)  # a layer that misses its state is an error at the step's end (idempotent)
    return RecurrentStateCache(config=model.config)


def register() -> None:
    """Make ``generate`` ask :func:`default_cache` (idempotent; called by :func:`hf_knorm.patch` and the build hook of
    :mod:`hf_knorm.models.parameters` for the first ``p = 1`` model)."""
    choose_default_generation_cache(CHOOSER, default_cache)
