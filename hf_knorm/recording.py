"""``record_norms``: gather per-layer norm statistics from any supported model's forward passes."""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn as nn

from .architectures import attention_modules
from .norm_statistics import NormRecorder
from .patching import patch, patched_normalization, unpatch


@contextmanager
def record_norms(model: nn.Module, keys_values: bool = True, attention: bool = True):
    """Record attention-matrix and K/V channel norms of the forward passes run inside the block.

    A model that is not patched is patched with ``softmax`` for the duration (the same function as its own
    attention; tested to fp32 tolerance) and unpatched afterwards, even on error.

    Example:
        >>> with hf_knorm.record_norms(model) as recorder:
        ...     model(**batch)
        >>> recorder.layers[3].key_channel_norms()   # (H_kv * head_dim,)

    Yields:
        The :class:`~hf_knorm.norm_statistics.NormRecorder`, one ``LayerNorms`` per attention layer.
    """
    temporary = patched_normalization(model) is None
    if temporary:
        patch(model, "softmax")
    try:
        with NormRecorder([m for _, m in attention_modules(model)], keys_values, attention) as recorder:
            yield recorder
    finally:
        if temporary:
            unpatch(model)
