"""Registration of the plugin's attention under the name ``"hf_knorm"`` with Transformers.

Two registrations, both class-wide and idempotent (done on ``import hf_knorm``): the attention function with
``AttentionInterface``, and a mask function under the same name with ``AttentionMaskInterface``: without it
Transformers hands a custom attention no mask at all. The mask function is Transformers' ``sdpa_mask`` with its
shortcuts disabled, so the attention always receives the explicit bool mask (causal, padding, sliding window) and
never ``None`` in place of "causal". Which model uses the function is decided per instance by
:func:`hf_knorm.patch`.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .interface import ATTENTION_NAME, hf_knorm_attention


def explicit_bool_mask(*args, **kwargs):
    """Transformers' ``sdpa_mask`` that always materializes the bool mask (True = attend)."""
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the attention and mask functions under ``"hf_knorm"`` (idempotent; done on ``import hf_knorm``)."""
    AttentionInterface.register(ATTENTION_NAME, hf_knorm_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, explicit_bool_mask)
