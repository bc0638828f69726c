"""``WindowStateLayer``: decode a ``p = 1`` model with a softmax window (``x/1 + softmax window W``) from the ``W``
last keys and values plus a constant-size state.

With a softmax window (:mod:`hf_knorm.attention.window`), a new token attends its ``W`` last positions by softmax and
every older key by ``x/c``. The older keys enter the output only through ``S = sum_j k_j v_j^T`` (and, for
``x/sqrtN``, their count), so a layer needs the ``W`` last keys and values and that state: ``W * 2 * D`` numbers per
KV head in the model's dtype plus ``D x D_v`` in fp32, whatever the length of the context (LoLCATs' decoding,
arXiv 2410.10254: a sliding-window K/V cache beside the linear-attention state).

How it runs. ``update`` returns the kept keys and values followed by the step's (``W + q`` at most) and hands the
layer over to the plugin's attention function (:mod:`hf_knorm.attention.taps`, paired by the key tensor's identity).
The attention computes the softmax part on those keys and the polynomial part from the state plus the keys that leave
the window in this step (the linear kernel continues the state), then ``write`` stores the new state and keeps the
``W`` last keys and values. A normalization with attention sinks (``+ sinks S``) also keeps each sequence's first
``S`` real keys and values (``keep_sinks``, called by the attention), which softmax weights beside the window.
``get_mask_sizes`` covers the kept keys and the step's, offset by every token before them,
so Transformers' causal and padding masks stay right.

A :class:`~.cache.RecurrentStateCache` built from a model's config makes these layers when its normalization has a
window (``RecurrentStateCache(config=model.config)``, what ``generate`` does); without a config its layers are pure
states, and the windowed attention refuses them.
"""

from __future__ import annotations

import torch

from ..attention.taps import hand_over_state
from .state import RecurrentStateLayer

__all__ = ["WindowStateLayer"]


class WindowStateLayer(RecurrentStateLayer):
    """One layer: ``keys``/``values`` ``(B, H_kv, min(W, tokens), D)``, the last ``W`` tokens' (padded ones too: the
    mask knows them); ``state`` ``(B, H_kv, D, D_v)`` fp32 and ``count`` ``(B,)`` of the valid tokens before them;
    ``cumulative_length`` counts every token.

    Args:
        layer_idx: the decoder layer.
        window: ``W``, the model's softmax window (``> 0``).
    """

    def __init__(self, layer_idx: int, window: int):
        if window <= 0:
            raise ValueError(f"A WindowStateLayer keeps a softmax window of W > 0 keys, got {window}; a model without "
                             "a window decodes with a RecurrentStateLayer.")
        super().__init__(layer_idx)
        self.window = window
        self.value: torch.Tensor | None = None  # the value tensor of the step being handed over
        self.sinks = None  # the attention sinks kept (hf_knorm.attention.window_parts.Sinks, absolute positions), if any
        self.sinks_complete = False  # every sequence holds its S sinks: later keys are never sinks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take a step's ``(B, H_kv, q, D)`` states; return the kept ones followed by them, ``(B, H_kv, kept + q,
        D)``, and hand the layer over to the attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.key = torch.cat([self.keys, key_states], dim=-2)
        self.value = torch.cat([self.values, value_states], dim=-2)
        hand_over_state(self)
        return self.key, self.value

    def write(self, state: torch.Tensor | None, count: torch.Tensor | None) -> None:
        """Store the state and the count of the keys older than the last ``W`` (called by the attention), and keep
        the last ``W`` keys and values of the step."""
        self.keys, self.values = self.key[:, :, -self.window:], self.value[:, :, -self.window:]
        self.state, self.count, self.key, self.value = state, count, None, None

    def keep_sinks(self, sinks, complete: bool = False) -> None:
        """Keep a model's attention sinks (called by the attention): each sequence's first ``S`` real keys and values
        ``(B, H_kv, S, D)``, their absolute positions and validity ``(B, S)``; ``S`` keys more per layer, whatever
        the length of the context. ``complete``: every sequence has its ``S`` (the next steps need no search)."""
        self.sinks, self.sinks_complete = sinks, complete

    def kept(self) -> int:
        """Keys and values kept from the steps before (``W`` once ``W`` tokens were seen)."""
        return self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the kept tokens and the step's, offset by every token before them."""
        kept = self.kept()
        return kept + query_length, self.cumulative_length - kept

    def nbytes(self) -> int:
        """Bytes held by the kept keys and values, the state and the count."""
        kept = (self.keys, self.values) if self.kept() else ()
        sinks = () if self.sinks is None else tuple(self.sinks)
        return super().nbytes() + sum(tensor.nbytes for tensor in kept + sinks)

    def reset(self) -> None:
        super().reset()
        self.value, self.sinks, self.sinks_complete = None, None, False

    def _select(self, fn) -> None:
        super()._select(fn)
        if self.kept():
            self.keys, self.values = fn(self.keys), fn(self.values)
        if self.sinks is not None:
            batch = self.sinks.keys.shape[0]
            self.sinks = type(self.sinks)(*(fn(tensor.expand(batch, *tensor.shape[1:])) for tensor in self.sinks))
