"""Registration of the plugin's attention under the name ``"hf_knorm"`` with Transformers.

Three registrations, all class-wide and idempotent (done on ``import hf_knorm``):

- the attention function with ``AttentionInterface``;
- a mask function under the same name with ``AttentionMaskInterface`` (without it Transformers hands a custom
  attention no mask at all): :func:`.masks.hf_knorm_mask`, key padding ``(B, kv)`` for a plain causal call and the
  explicit bool mask (sliding window, packed sequences, a custom overlay) otherwise, never ``None`` in place of
  "causal";
- the name as one that saved configs keep: every config whose ``hf_knorm`` section names a normalization (what
  :func:`hf_knorm.patch` writes, and what a patched model's saved config brings back on load) saves
  ``"attn_implementation": "hf_knorm"`` into ``config.json``, whichever path saves it. This is the one place the
  marker is written (Transformers drops that key; the workaround is
  :func:`hf_knorm.compat.keep_attn_implementation_on_save`).

Which model uses the function is decided per instance by :func:`hf_knorm.patch`.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..compat import keep_attn_implementation_on_save
from .interface import ATTENTION_NAME, hf_knorm_attention
from .masks import hf_knorm_mask


def register() -> None:
    """Register the attention and mask functions under ``"hf_knorm"``, a name saved configs keep (idempotent; done on
    ``import hf_knorm``)."""
    AttentionInterface.register(ATTENTION_NAME, hf_knorm_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, hf_knorm_mask)
    keep_attn_implementation_on_save(ATTENTION_NAME, names_a_normalization)


def names_a_normalization(config: dict) -> bool:
    """Whether a serialized config's ``hf_knorm`` section names a normalization (the model runs the plugin)."""
    section = config.get(ATTENTION_NAME)
    return isinstance(section, dict) and section.get("normalization") is not None
