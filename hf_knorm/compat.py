"""Where hf_knorm meets Transformers' internals or its differences between releases: everything of that kind, here.

Each entry names the Transformers behaviour it bridges, the releases it was checked on, and the test of the
compatibility suite (``pytest -m compat``, run on the oldest, a middle and the newest supported release by
``.ci/run``) that fails the day it stops working.
"""

from __future__ import annotations

import re

import transformers

# --- Transformers version differences ---
# Checked on every 5.x minor from 5.10 to 5.24 (sources), tested by the compatibility suite on 5.10.4, 5.17.0 and
# 5.24.0 (README "Supported Transformers versions").

SUPPORTED_TRANSFORMERS = ">=5.10,<6"
"""The supported range, as pyproject.toml declares it: every 5.x minor from 5.10 on, up to the next major."""
_OLDEST, _NEXT_MAJOR = (5, 10), (6, 0)

_CACHE_RENAMED = (5, 24)
"""5.24 renamed the cache argument of ``forward``/``generate`` and the output field from ``past_key_values`` to
``cache``. 5.24 still takes the old name with a deprecation warning (until 6.0); 5.10-5.23 ignore ``cache=`` in a
model's ``forward`` (it lands in ``**kwargs``) and ``generate`` refuses it as an unused model argument."""


def installed_transformers_version() -> str:
    """The version string of the Transformers that is imported (``transformers.__version__``)."""
    return transformers.__version__


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"5.24.0"`` or ``"5.25.0.dev0"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Cannot read a Transformers version from {version!r}.")
    return int(match[1]), int(match[2])


def check_transformers_version() -> None:
    """Refuse a Transformers release outside :data:`SUPPORTED_TRANSFORMERS`, at ``import hf_knorm``.

    Outside the range the package would fail later and deeper (4.57 at import: 4.x spells the config class
    ``PretrainedConfig``; 5.0-5.9 were never tried), or silently (a future major); this says so at import, with the
    fix. Tested by ``tests/test_compat_versions.py`` (the version read is monkeypatched, the package re-imported).

    Raises:
        ImportError: The installed release is older than 5.10 or of a later major version.
    """
    version = installed_transformers_version()
    if not _OLDEST <= _release(version) < _NEXT_MAJOR:
        raise ImportError(
            f"hf_knorm supports transformers{SUPPORTED_TRANSFORMERS} (every 5.x minor from 5.10 on); transformers "
            f"{version} is installed. Install a supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}'."
        )


def cache_keyword() -> str:
    """The keyword that passes a cache to a model's ``forward`` and to ``generate``: ``"cache"`` from 5.24 on,
    ``"past_key_values"`` before (see ``_CACHE_RENAMED``). Model outputs name their cache field the same way.
    Tested by ``test_the_cache_keyword_reaches_forward_and_generate``: a wrong keyword leaves the passed cache empty."""
    return "cache" if _release(installed_transformers_version()) >= _CACHE_RENAMED else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{keyword: cache}`` for ``model(..., **cache_kwargs(cache))`` and ``model.generate(..., **cache_kwargs(cache))``
    on every supported release (the keyword is :func:`cache_keyword`)."""
    return {cache_keyword(): cache}


def output_cache(outputs):
    """The cache a model's forward returned: ``outputs.cache`` from 5.24 on, ``outputs.past_key_values`` before."""
    return outputs[cache_keyword()]


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Per layer of a decoder ``config``: its attention type (``"full_attention"``, ``"sliding_attention"``, ...) and
    the keyword arguments its cache layer takes (``{"sliding_window": w}`` for a windowed layer).

    Transformers' ``cache_utils.get_layer_types_and_kwargs`` answers this from 5.14 on, returning one kwargs dict
    shared by all layers until 5.18 and a list of per-layer dicts from 5.19; 5.10-5.13 have no such function and
    ``DynamicCache(config=...)`` reads ``layer_types``, else ``sliding_window``/``attention_chunk_size``, inline (the
    fallback below does the same). Tested by ``test_layer_types_agree_with_transformers_own_cache``.
    """
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # 5.10-5.13
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            kind = "full_attention" if window is None else "sliding_attention"
            layer_types = [kind] * config.num_hidden_layers
        shared = getattr(config, "num_kv_shared_layers", None)
        if shared:
            layer_types = layer_types[:-shared]
        layer_kwargs = {} if window is None else {"sliding_window": window}
    else:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, dict):  # 5.10-5.18: one dict for every layer
        layer_kwargs = [dict(layer_kwargs) for _ in layer_types]
    return list(layer_types), list(layer_kwargs)


def attentions_being_collected() -> bool:
    """Whether the running forward collects attention weights through Transformers' output capturing.

    Some families (GPT-2) consume ``output_attentions`` before calling the attention function, which then cannot see
    the request; their weights are gathered by the hooks of ``transformers.utils.output_capturing``, whose private
    context variable ``_active_collector`` holds what is being collected. No public accessor exists (checked 5.10-5.24;
    the module appeared in 5.5). Tested by ``test_output_attentions_returns_post_normalization_weights[gpt2]`` (in the
    compatibility suite): if the variable goes, this import fails loudly instead of returning no weights.
    """
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get()
    return collected is not None and "attentions" in collected
