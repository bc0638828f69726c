"""``RecurrentStateLayer``: one decoder layer's linear-attention state, the cache layer a ``p = 1`` model (``x/1``,
``x/16``, ``x/sqrtN``) decodes with.

With ``p = 1`` the attention output of a new token is ``(scaling / c) * q^T S`` with ``S = sum_j k_j v_j^T`` over the
tokens before it and itself (:mod:`hf_knorm.attention.linear_kernel`), so a layer needs ``S``, a ``D x D_v`` matrix
per KV head (fp32), and for ``x/sqrtN`` the count of valid tokens, whatever the length of the context.

The layer's ``update`` hands it over to the plugin's attention (:func:`hf_knorm.attention.taps.hand_over_state`),
which reads the state and writes the new one: the layer is a
:class:`~hf_knorm.attention.taps.StateHandover`. The windowed layer (:mod:`.window_cache`) builds on this one, and the
cache (:mod:`.cache`) on both; this module imports neither.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ..attention.taps import hand_over_state

__all__ = ["RecurrentStateLayer"]


class RecurrentStateLayer(DynamicLayer):
    """One layer's state: ``state`` ``(B, H_kv, D, D_v)`` fp32 (``sum k v^T`` of every valid token so far) and
    ``count`` ``(B,)`` (valid tokens so far); ``cumulative_length`` counts every token, padded or not.

    ``keys``/``values`` stay empty (Transformers' generic cache code reads them).

    Args:
        layer_idx: the decoder layer.
    """

    is_croppable = False
    window = 0
    """No softmax window is kept beside the state (:class:`~.window_cache.WindowStateLayer` keeps ``W``)."""
    sparse = 0
    """No sparse cache is kept (:class:`~.sparse_cache.SparseWindowStateLayer` keeps ``K`` pairs)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cumulative_length = 0
        self.state: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.key: torch.Tensor | None = None  # the key tensor of the step being handed over

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take a step's ``(B, H_kv, q, D)`` states: hand the state over to the attention, return the step's states."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.key = key_states
        hand_over_state(self)
        return key_states, value_states

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The state and the count before the step (``None`` before the first step)."""
        return self.state, self.count

    def write(self, state: torch.Tensor, count: torch.Tensor) -> None:
        """Store the state and the count after the step (called by the attention)."""
        self.state, self.count, self.key = state, count, None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the step's own tokens, offset by every token before them."""
        return query_length, self.cumulative_length

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes held by the state and the count."""
        return sum(tensor.nbytes for tensor in (self.state, self.count) if tensor is not None)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "A recurrent state cannot be cropped (past tokens are summed into it): assisted and speculative decoding "
            "need a K/V cache. Pass cache=DynamicCache() to generate."
        )

    def reset(self) -> None:
        super().reset()
        self.cumulative_length, self.state, self.count, self.key = 0, None, None, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda tensor: tensor[indices])

    def _select(self, fn) -> None:
        if self.state is not None:
            self.state, self.count = fn(self.state), fn(self.count)
