"""Run a model through the plugin's attention for a while: to record norm statistics or transform K/V."""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn as nn

from ..models.architectures import attention_modules
from ..models.patching import patch, patched_normalization, unpatch
from .statistics import NormRecorder


@contextmanager
def routed_through_plugin(model: nn.Module):
    """Inside the block, ``model``'s attention runs through the plugin's function.

    A patched model is left as it is. A model that is not patched is patched with ``softmax`` (the same function as
    its own attention, tested to fp32 tolerance) and unpatched afterwards, even on error.
    """
    temporary = patched_normalization(model) is None
    if temporary:
        patch(model, "softmax")
    try:
        yield model
    finally:
        if temporary:
            unpatch(model)


@contextmanager
def record_norms(model: nn.Module, keys_values: bool = True, attention: bool = True):
    """Record attention-matrix and K/V channel norms of the forward passes run inside the block.

    Examples:
        >>> with hf_knorm.record_norms(model) as recorder:
        ...     model(**batch)
        >>> recorder.layers[3].key_channel_norms()   # (H_kv * head_dim,)

    Yields:
        The :class:`~hf_knorm.recording.statistics.NormRecorder`, one ``LayerNorms`` per attention layer.
    """
    with routed_through_plugin(model):
        with NormRecorder([m for _, m in attention_modules(model)], keys_values, attention) as recorder:
            yield recorder
