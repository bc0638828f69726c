"""The one place KNorm relies on how Transformers calls ``Cache.update`` (to move into ``hf_knorm/compat.py``).

No public API hands a cache the position ids of the tokens it stores; :class:`~hf_knorm.KNormCache` needs them only
to refuse a padded batch (eviction breaks the padding-mask bookkeeping). The guard is best effort: where the positions
are not passed the check is skipped, and ``knorm_generate`` and the ``knorm-text-generation`` pipeline check the
attention mask themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def update_position_ids(update_kwargs: Mapping) -> torch.Tensor | None:
    """The (B, q) position ids a model passes along with its keys and values to ``Cache.update``, or ``None``.

    Transformers behaviour relied on (checked on 5.24): Llama-style attention modules (llama, mistral, qwen2/3,
    gemma2/3, phi3, gpt2) call ``cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)``, forwarding
    the attention's keyword arguments, which carry ``position_ids`` when the model is called by ``generate`` or with
    explicit ``position_ids``. GPT-NeoX calls ``update`` without them; Transformers 4.x passed a ``cache_kwargs`` dict
    (``sin``, ``cos``, ``cache_position``) instead. In those cases this returns ``None``.

    Args:
        update_kwargs: The keyword arguments ``Cache.update`` received.
    """
    forwarded = update_kwargs.get("kwargs")
    if not isinstance(forwarded, Mapping):
        return None
    return forwarded.get("position_ids")
