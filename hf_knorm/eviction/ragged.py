"""A KNorm layer that keeps a different number of tokens in each KV head, stored compactly, and the attention that
reads it.

Storage (:class:`RaggedKNormLayer`): a flat packed store. ``keys`` and ``values`` are (N, D) with N = the kept pairs of
the layer, ordered by (batch row, head, position); ``lengths`` (B, H_kv) int64 says how many belong to each head (the
offsets are its running sum); ``positions`` (N,) int64 the absolute position of each (introspection only, counted by
``KNormCache.nbytes(include_positions=True)``). Bytes held by the cache: the kept pairs, ``2 * N * D * itemsize``,
plus the index overhead ``8 * B * H_kv`` bytes per layer (``lengths``).

Attention: Transformers' attention functions take rectangular (B, H_kv, S, D) keys with one mask for every head, so a
decoding step builds a **transient padded view** inside the layer's call: ``update`` returns (B, H_kv, max_len + q, D)
states, zero-filled after each head's kept tokens, and attaches a (B, H_kv, max_len + q) bool ``knorm_valid`` to the
returned keys; the attention registered as ``"knorm_ragged"`` (SDPA underneath) combines it with the model's mask. The
view is a temporary of the call: the cache keeps only the packed store. A model must therefore run with
``model.set_attn_implementation("knorm_ragged")`` (``hf_knorm.eviction.pipeline.knorm_generate`` does it for the call); the cache refuses
a ragged step under any other attention, loudly, rather than attend the padding.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .budgets import head_adaptive_keep
from .cache import KNormLayer, _check_unpadded_positions

__all__ = ["RAGGED_ATTENTION", "RaggedKNormLayer", "ragged_attention", "ragged_attention_for"]

RAGGED_ATTENTION = "knorm_ragged"


class RaggedKNormLayer(KNormLayer):
    """One layer of a ``KNormCache(head_budget="heads")``: per-head kept counts, packed (see the module docstring).

    Attributes:
        keys, values (torch.Tensor): (N, D), the kept pairs ordered by (batch row, head, position).
        lengths (torch.Tensor): (B, H_kv) int64, kept tokens per head.
        positions (torch.Tensor): (N,) int64 absolute positions.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty(0, dim)
        self.values = value_states.new_empty(0, value_states.shape[-1])
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def stored_length(self) -> int:
        """The longest head's kept count (the padded view's length)."""
        return int(self.lengths.max()) if self.is_initialized and self.lengths.numel() else 0

    def stored_per_head(self) -> torch.Tensor:
        return self.lengths.clone() if self.is_initialized else torch.zeros(0, 0, dtype=torch.long)

    def padded(self, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The transient view: keys, values (B, H_kv, L, D), positions (B, H_kv, L) (-1 in padding) and the
        (B, H_kv, L) bool ``valid``, L = the longest head (+ ``extra`` free slots after each head's tokens)."""
        batch, heads = self.lengths.shape
        length = self.stored_length() + extra
        valid = torch.arange(length, device=self.device) < self.lengths[..., None]  # (B, H_kv, L)
        where = valid.nonzero(as_tuple=True)  # computed once for the three tensors
        keys = self.keys.new_zeros(batch, heads, length, self.keys.shape[-1])
        values = self.values.new_zeros(batch, heads, length, self.values.shape[-1])
        positions = torch.full((batch, heads, length), -1, dtype=torch.long, device=self.device)
        keys[where], values[where], positions[where] = self.keys, self.values, self.positions
        return keys, values, positions, valid

    def _pack(self, keys, values, positions, keep) -> None:
        """Store the ``keep`` (B, H_kv, S) entries of padded (B, H_kv, S, D) states."""
        where = keep.nonzero(as_tuple=True)
        self.keys, self.values, self.positions = keys[where], values[where], positions[where]
        self.lengths = keep.sum(-1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               position_ids: torch.Tensor | None = None, **kwargs):
        """Append (B, H_kv, q, D) states per head; return the (B, H_kv, L + q, D) padded view (keys carry the bool
        ``knorm_valid`` (B, H_kv, L + q) when some slot is padding), then compress the prompt.

        The q new tokens of each head go right after its kept ones (slots ``lengths .. lengths + q - 1``); after the
        prompt q is 1 (the cache refuses more), so their order against the model's mask does not matter."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        start = self.cumulative_length
        self.cumulative_length += q_len
        full_keys, full_values, full_positions, old = self.padded(extra=q_len)
        slots = torch.arange(full_keys.shape[-2], device=self.device)
        full_valid = slots < (self.lengths + q_len)[..., None]  # (B, H_kv, L + q)
        new = (full_valid & ~old).nonzero(as_tuple=True)  # q slots per head, in (batch, head, slot) order
        full_keys[new] = key_states.reshape(-1, key_states.shape[-1])
        full_values[new] = value_states.reshape(-1, value_states.shape[-1])
        full_positions[new] = torch.arange(start, start + q_len, device=self.device).repeat(batch * heads)
        keep = full_valid
        if start == 0 and q_len > 0:
            _check_unpadded_positions(position_ids, q_len)
            self.prompt_length = q_len
            if self.settings.layer_budget == "uniform":
                order = self.settings.eviction_order(full_keys, full_values, full_positions, self.layer_idx,
                                                     self.cumulative_length)
                keep = head_adaptive_keep(order, self.settings.prompt_keep(self.layer_idx, q_len),
                                          self.settings.head_floor)
        self._pack(full_keys, full_values, full_positions, keep)
        if not bool(full_valid.all()):
            full_keys.knorm_valid = full_valid
        return full_keys, full_values

    def compress_prompt(self, keep: int, order: torch.Tensor | None = None) -> None:
        keys, values, positions, _ = self.padded()  # the prompt, whole: no padding yet
        order = self.prompt_order() if order is None else order
        self._pack(keys, values, positions, head_adaptive_keep(order, keep, self.settings.head_floor))

    def prompt_order(self) -> torch.Tensor:
        keys, values, positions, _ = self.padded()
        return self.settings.eviction_order(keys, values, positions, self.layer_idx, self.cumulative_length)

    def reset(self) -> None:
        super().reset()
        self.lengths = None

    def _select_rows(self, rows: torch.Tensor) -> None:
        keys, values, positions, valid = self.padded()
        rows = rows.to(self.device)
        self._pack(keys[rows], values[rows], positions[rows], valid[rows])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(torch.arange(self.lengths.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(torch.arange(self.lengths.shape[0])[indices])


def ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA attention (Transformers' ``sdpa_attention_forward``) that also hides the padding of a
    :class:`RaggedKNormLayer`'s view: ``key.knorm_valid`` (B, H_kv, S) bool, expanded to the query heads and AND-ed
    with the model's (B, 1, q, S) bool mask. Without it this is exactly SDPA."""
    if kwargs.get("softcap") is not None:
        raise ValueError("The knorm_ragged attention (SDPA) has no logit softcapping; head_budget='heads' does not "
                         "support this model (use head_budget='uniform').")
    valid = getattr(key, "knorm_valid", None)
    if valid is not None:
        groups = query.shape[1] // key.shape[1]
        heads = valid.repeat_interleave(groups, dim=1)[:, :, None, :]  # (B, H_q, 1, S)
        if attention_mask is None:
            attention_mask = heads
        else:
            attention_mask = attention_mask[..., : key.shape[-2]] & heads
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def ragged_attention_for(model, cache):
    """Run ``model`` with the ``"knorm_ragged"`` attention while the block runs if ``cache`` has per-head counts
    (``head_budget="heads"``); its own attention is given back afterwards, even on error. Otherwise does nothing."""
    if not any(isinstance(layer, RaggedKNormLayer) for layer in cache.layers):
        yield
        return
    original = model.config._attn_implementation
    model.set_attn_implementation(RAGGED_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
