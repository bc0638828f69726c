"""Registering an eviction attention under its name with Transformers, lazily, once, never over someone else's.

The eviction code runs a plain softmax model for a while with an attention of its own (``"knorm_ragged"`` for
per-head cache budgets, ``"knorm_capture"`` for KVzip's reconstruction): Transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` are its public extension points, and process-wide registries. :func:`register_attention`
is called by the first call that needs the name (``import hf_knorm`` registers neither), is idempotent, and refuses
a name another library already holds (docs/compatibility.md, "What importing hf_knorm changes").
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface


def register_attention(name: str, attention: Callable, mask: Callable, needed_by: str) -> None:
    """Register ``attention`` and ``mask`` under ``name`` (nothing if they already are).

    Raises:
        ValueError: ``name`` holds another attention or mask function (``needed_by`` says what needs it).
    """
    for interface, function in ((AttentionInterface(), attention), (AttentionMaskInterface(), mask)):
        held = interface.get(name)
        if held is not None and held is not function:
            raise ValueError(f"{type(interface).__name__} already holds another {name!r} function "
                             f"({getattr(held, '__module__', '?')}.{getattr(held, '__qualname__', held)!s}); "
                             f"{needed_by} needs the name for their own attention.")
        if held is None:
            type(interface).register(name, function)
