"""The serialized marker: every config whose model runs the plugin's attention saves ``attn_implementation``.

Transformers keeps the attention implementation in ``config._attn_implementation_internal`` and drops that key when it
serializes a config (``PreTrainedConfig._remove_keys_not_serialized``), so ``config.json`` only says
``"attn_implementation": "hf_knorm"`` while a plain attribute of that name exists. :func:`hf_knorm.patch` sets one,
but a model loaded with plain ``from_pretrained`` does not have it: Transformers reads the key from ``config.json``
into the internal field and forgets the plain one. Saved again straight away (``model.save_pretrained``,
``model.push_to_hub``, a Trainer checkpoint), that model would lose the marker and load as softmax next time.

No hook of the loading path reaches a config that only Transformers has touched, so the fix sits where the key is
dropped: :func:`keep_marker_on_save` wraps ``_remove_keys_not_serialized`` so that a config dict whose internal
implementation is ``"hf_knorm"`` gets ``"attn_implementation": "hf_knorm"`` before the internal key is removed. The
marker is derived from the state the model actually runs in, at the one point every save path goes through
(``to_dict`` and ``to_diff_dict``, hence ``save_pretrained``, ``to_json_string`` and ``push_to_hub``; nested
sub-configs too, since the method recurses through itself). Configs of any other implementation serialize exactly
as before. This is the one class-level change the plugin makes (the attention itself is patched per instance); it
is installed on ``import hf_knorm`` and is idempotent.
"""

from __future__ import annotations

import functools

from transformers import PreTrainedConfig

from ..attention.interface import ATTENTION_NAME

_INTERNAL_KEY = "_attn_implementation_internal"
_WRAPPED = "__hf_knorm_keeps_marker__"


def keep_marker_on_save() -> None:
    """Make every config running ``"hf_knorm"`` attention serialize ``attn_implementation`` (idempotent)."""
    original = PreTrainedConfig._remove_keys_not_serialized
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _remove_keys_not_serialized(self, d):
        if d.get(_INTERNAL_KEY) == ATTENTION_NAME:
            d["attn_implementation"] = ATTENTION_NAME
        return original(self, d)

    setattr(_remove_keys_not_serialized, _WRAPPED, True)
    PreTrainedConfig._remove_keys_not_serialized = _remove_keys_not_serialized
