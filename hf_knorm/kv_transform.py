"""Rewrite the keys and values an attention layer reads, for evaluating K/V compression with teacher forcing.

While a transform is active (``with KVTransform(fn):``), the plugin's attention function replaces the ``key`` and
``value`` it receives by ``fn(module, key, value)`` before attending. Shapes: ``(B, H_kv, kv, D)`` in and out. This
is how a perplexity evaluation makes attention really read quantized or low-rank K/V in a single forward pass
(Transformers' own ``QuantizedCache`` hands attention the unquantized states at prefill). The model must be routed
through the plugin: use :func:`hf_knorm.recording.routed_through_plugin` for a model that is not patched.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch

TransformFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_ACTIVE: contextvars.ContextVar[TransformFn | None] = contextvars.ContextVar("hf_knorm_kv_transform", default=None)


def current_kv_transform() -> TransformFn | None:
    """The transform active in this context, if any."""
    return _ACTIVE.get()


class KVTransform:
    """Context manager activating ``fn(module, key, value) -> (key, value)`` for the plugin's attention calls."""

    def __init__(self, fn: TransformFn):
        self.fn = fn
        self._token = None

    def __enter__(self) -> KVTransform:
        self._token = _ACTIVE.set(self.fn)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)
