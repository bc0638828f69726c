"""``generate`` on a ``p = 1`` model decodes with a :class:`~.cache.RecurrentStateCache` unless told otherwise.

:func:`hf_knorm.patch` (and so :func:`hf_knorm.from_pretrained`) gives a model patched with ``x/1``, ``x/16`` (any
``p = 1``) an instance-level ``generate``, as Transformers itself does for a ``custom_generate`` (a
``functools.partial`` over the model, which ``copy.deepcopy`` and pickling carry). It passes a fresh
``RecurrentStateCache`` when the call brings no cache of its own and does not ask for one (``cache_implementation``,
``use_cache=False``), and none of what a state cannot do (assisted or prompt-lookup decoding rewind the cache, which
a state cannot); then it calls the class's ``generate``. ``hf_knorm.unpatch`` removes it.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ..compat import cache_kwargs
from .cache import RecurrentStateCache, decodes_with_state

CACHE_ARGUMENTS = ("cache", "past_key_values")
REWINDING_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
"""``generate`` arguments of assisted and prompt-lookup decoding: they crop the cache, which a state cannot undo."""


def generate_with_state(*args, model: nn.Module, **kwargs):
    """``type(model).generate(model, ...)``, with a :class:`RecurrentStateCache` when :func:`wants_state`."""
    if wants_state(model, kwargs):
        kwargs.update(cache_kwargs(RecurrentStateCache(config=model.config)))
    return type(model).generate(model, *args, **kwargs)


def wants_state(model: nn.Module, kwargs: dict) -> bool:
    """Whether a ``generate`` call with ``kwargs`` on ``model`` should decode with a recurrent state."""
    if any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS + REWINDING_ARGUMENTS):
        return False
    generation_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    use_cache = kwargs.get("use_cache", getattr(generation_config, "use_cache", True))
    implementation = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    return use_cache is not False and implementation is None and decodes_with_state(model.config)


def install(model: nn.Module) -> None:
    """Give ``model`` the instance-level ``generate`` above (idempotent)."""
    if not is_installed(model):
        model.generate = functools.partial(generate_with_state, model=model)


def uninstall(model: nn.Module) -> None:
    """Remove it (the class's ``generate`` is used again)."""
    if is_installed(model):
        del model.__dict__["generate"]


def is_installed(model: nn.Module) -> bool:
    generate = model.__dict__.get("generate")
    return isinstance(generate, functools.partial) and generate.func is generate_with_state
