"""One layer of a :class:`~hf_knorm.eviction.cache.KNormCache` with the same count of tokens in every head (the
paper's budget, Devoto et al., arXiv 2406.11430): its store, its eviction at the prompt and while decoding, and the
rows of a left-padded batch (:mod:`hf_knorm.eviction.rows`). Head-adaptive budgets store each head's own count in
:class:`~hf_knorm.eviction.ragged.RaggedKNormLayer`, which builds on this class.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from . import rows
from .rows import is_padded_step, prompt_padding, step_lengths
from .settings import EvictionSettings

__all__ = ["KNormLayer", "check_rows_budget"]


class KNormLayer(DynamicLayer):
    """One layer of a :class:`KNormCache`: stores ``keys``/``values`` of shape (B, H_kv, S_kept, D).

    Built with the cache's shared :class:`~hf_knorm.eviction.settings.EvictionSettings` and its layer index; it reads
    nothing else. ``positions`` (B, H_kv, S_kept), int64, holds the position of every stored token (per head; tests and
    the decoding budget read it). ``cumulative_length`` counts every token ever seen, evicted or not (padding
    included). A left-padded batch (:mod:`hf_knorm.eviction.rows`) sets ``row_lengths`` (B,) int64, the real tokens
    each row has seen, and then ``positions`` are positions in the row, ``-1`` on dead slots; ``None`` otherwise.
    ``compressed_at`` is ``cumulative_length`` at the last step that evicted something (0 if none did):
    :meth:`crop` removes only tokens appended after it.
    """

    is_croppable = True

    def __init__(self, settings: EvictionSettings, layer_idx: int):
        super().__init__()
        self.settings, self.layer_idx = settings, layer_idx
        self.cumulative_length = 0
        self.positions: torch.Tensor | None = None
        self.prompt_length = 0
        self.row_lengths: torch.Tensor | None = None
        self.compressed_at = 0
        self.prompt_open = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        self.positions = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)

    def stored_length(self) -> int:
        """Tokens stored per head (after eviction; with a padded batch the widest row's, dead slots included)."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               position_ids: torch.Tensor | None = None, **kwargs):
        """Append (B, H_kv, q, D) states, return the full (B, H_kv, S_kept + q, D) states, then evict.

        ``position_ids`` (B, q), optional: the positions the model gave the new tokens. A prompt whose rows are
        left-padded (not 0..q-1 in every row), or a later left-padded block of tokens, switches the layer to per-row
        eviction (:mod:`hf_knorm.eviction.rows`); the states returned after the prompt then carry ``knorm_live``
        (B, S_kept + q) for the ``"knorm_ragged"`` attention.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        start = self.cumulative_length
        if start == 0 and q_len > 0:
            pads = prompt_padding(position_ids, q_len)
            if pads is not None:
                check_rows_budget(self.settings)
                self.row_lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        elif self.row_lengths is None and q_len > 1 and is_padded_step(position_ids, start, q_len):
            self.row_lengths = torch.full((batch,), start, dtype=torch.long, device=self.device)
        if self.row_lengths is not None:
            return self._update_rows(key_states, value_states, position_ids, start)
        self.cumulative_length += q_len
        new_positions = torch.arange(start, start + q_len, device=self.device).expand(batch, heads, q_len)
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        full_positions = torch.cat([self.positions, new_positions], dim=-1)
        keep = full_keys.shape[-2]
        if start == 0 and q_len > 0:  # the prompt: compressed once it has been attended in full
            self.prompt_length = q_len
            if self.settings.layer_budget != "uniform" or self.settings.deferred:  # compressed by the cache later
                self.keys, self.values, self.positions = full_keys, full_values, full_positions
                return full_keys, full_values
            keep = self.settings.prompt_keep(self.layer_idx, q_len)
        if self.settings.decoding_budget is not None:
            keep = min(keep, self.settings.decoding_budget)
        if keep < full_keys.shape[-2]:
            order = self.settings.eviction_order(full_keys, full_values, full_positions, self.layer_idx,
                                                 self.cumulative_length)
            index = order.topk(keep, dim=-1, largest=False).indices.sort(dim=-1).values  # (B, H_kv, keep)
            self.keys = full_keys.gather(2, index[..., None].expand(-1, -1, -1, full_keys.shape[-1]))
            self.values = full_values.gather(2, index[..., None].expand(-1, -1, -1, full_values.shape[-1]))
            self.positions = full_positions.gather(2, index)
            self.compressed_at = self.cumulative_length
        else:
            self.keys, self.values, self.positions = full_keys, full_values, full_positions
        return full_keys, full_values

    def _update_rows(self, key_states, value_states, position_ids, start: int):
        """:meth:`update` for a padded batch: each row's real tokens are appended and evicted as the row alone. After
        rows stacked with their prompt open (:meth:`stack_rows`), this step's tokens end the prompt: it is attended
        whole, then compressed."""
        batch, heads, q_len, _ = key_states.shape
        opened, self.prompt_open = self.prompt_open, False
        prompt = start == 0 or opened
        if start == 0:
            counts = q_len - prompt_padding(position_ids, q_len)
        elif q_len == 1:  # a decoding step: one real token per row (generate's positions continue every row)
            counts = torch.ones_like(self.row_lengths)
        elif position_ids is None:
            raise ValueError("This model does not give the cache its position ids (Transformers before 5.24, or a model "
                             "such as GPT-NeoX that calls Cache.update without them), so KNormCache cannot see the "
                             "padding of a step of several tokens onto a padded batch: append them one at a time, or "
                             "generate one sequence at a time.")
        else:
            counts = step_lengths(position_ids, self.row_lengths, q_len)
        new_positions = rows.new_positions(self.row_lengths, counts, heads, q_len)
        self.row_lengths = self.row_lengths + counts
        self.cumulative_length += q_len
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        full_positions = torch.cat([self.positions, new_positions], dim=-1)
        self.keys, self.values, self.positions = full_keys, full_values, full_positions
        lengths = self.row_lengths.tolist() if prompt or self.settings.decoding_budget is not None else None
        if prompt:
            self.prompt_length = self.cumulative_length
            if self.settings.deferred:  # compressed by the cache once the importance is known
                return full_keys, full_values
            self._evict_rows(lengths, [self.settings.prompt_keep(self.layer_idx, n) for n in lengths])
            if not opened:  # the prompt's own forward attends with Transformers' padding mask
                return full_keys, full_values
        elif lengths is not None:
            self._evict_rows(lengths, [self.settings.decoding_budget] * batch)
        returned = full_keys.view_as(full_keys)  # the live slots travel on this view, not on the stored tensor
        returned.knorm_live = full_positions[:, 0] >= 0
        return returned, full_values

    def _evict_rows(self, lengths: list[int], keeps: list[int], importance: torch.Tensor | None = None) -> None:
        """Keep at most ``keeps[b]`` real tokens in row ``b`` (:func:`hf_knorm.eviction.rows.select_rows`)."""
        if self.settings.decoding_budget is not None:
            keeps = [min(keep, self.settings.decoding_budget) for keep in keeps]
        live = (self.positions[:, 0] >= 0).sum(-1).tolist()
        if all(count <= keep for count, keep in zip(live, keeps)):
            return
        self.keys, self.values, self.positions = rows.select_rows(
            self.settings, self.layer_idx, self.keys, self.values, self.positions, lengths, keeps, importance)
        self.compressed_at = self.cumulative_length

    def stack_rows(self, rows_alone: list[DynamicLayer], width: int, prompt_open: bool = False) -> None:
        """Become the layer a left-padded batch of ``width`` columns leaves after its prompt, from the same layer of
        each row's cache after that row's context alone (one row each, unpadded): its slots after dead ones
        (:func:`~hf_knorm.eviction.rows.stack_slots`), ``row_lengths`` the rows' lengths, every token count
        ``width`` (the padding included, as a padded prompt counts it). ``prompt_open``: the rows are plain
        (uncompressed) layers holding the start of their prompts, which the next step ends (:meth:`_update_rows`)."""
        def slots(row):
            if isinstance(row, KNormLayer):
                return row.keys, row.values, row.positions
            positions = torch.arange(row.keys.shape[-2], device=row.keys.device)
            return row.keys, row.values, positions.expand(*row.keys.shape[:2], -1)

        keys, values, positions = rows.stack_slots([slots(row) for row in rows_alone])
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.positions = keys, values, positions
        self.row_lengths = torch.tensor([row.get_seq_length() for row in rows_alone], device=self.device)
        self.cumulative_length, self.prompt_length, self.prompt_open = width, 0 if prompt_open else width, prompt_open
        self.compressed_at = width if any(getattr(row, "compressed_at", 0) for row in rows_alone) else 0

    def prompt_order(self, importance: torch.Tensor | None = None) -> torch.Tensor:
        """Eviction order (B, H_kv, n) of the stored, not yet compressed prompt (low = kept); from ``importance``
        (B, H_kv, n) instead of the score when given (a deferred score's)."""
        return self.settings.eviction_order(self.keys, self.values, self.positions, self.layer_idx,
                                            self.cumulative_length, importance)

    def prompt_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored, not yet compressed prompt: keys and values (B, H_kv, n, D) and positions (B, H_kv, n), ``-1``
        on a padded batch's padding (views, not copies)."""
        return self.keys, self.values, self.positions

    def compress_prompt(self, keep: int, order: torch.Tensor | None = None) -> None:
        """Keep ``keep`` tokens per head of the stored prompt (a layer budget, applied by the cache once every layer
        holds its prompt); ``order`` is :meth:`prompt_order` if already computed."""
        if self.settings.decoding_budget is not None:
            keep = min(keep, self.settings.decoding_budget)
        if keep >= self.keys.shape[-2]:
            return
        order = self.prompt_order() if order is None else order
        index = order.topk(keep, dim=-1, largest=False).indices.sort(dim=-1).values  # (B, H_kv, keep)
        self.keys = self.keys.gather(2, index[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, index[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        self.positions = self.positions.gather(2, index)
        self.compressed_at = self.cumulative_length

    def compress_rows(self, importance: torch.Tensor | None = None) -> None:
        """A padded batch's stored prompt: keep each row's ``prompt_keep`` of its own length, chosen on the row alone
        (by ``importance`` (B, H_kv, S), a deferred score's, when given)."""
        lengths = self.row_lengths.tolist()
        self._evict_rows(lengths, [self.settings.prompt_keep(self.layer_idx, n) for n in lengths], importance)

    def stored_per_head(self) -> torch.Tensor:
        """Tokens stored per head, (B, H_kv) int64 (with a padded batch: each row's real tokens)."""
        if self.row_lengths is not None:
            return (self.positions >= 0).sum(-1)
        shape = self.positions.shape if self.is_initialized else (0, 0, 0)
        return torch.full(shape[:2], shape[2], dtype=torch.long)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the stored tokens plus the query, offset so the query's own tokens stay causal."""
        stored = self.stored_length()
        return stored + query_length, self.cumulative_length - stored

    def get_seq_length(self) -> int:
        """Absolute length (every token seen, evicted ones included): positions of new tokens stay true."""
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative count, Transformers' convention; assisted decoding
        drops the rejected draft tokens this way). Exact when they were all appended after the last eviction (the
        prompt's compression, or the last step a ``decoding_budget`` evicted at): they are then the last stored slots,
        and the cache is what it would be had they never come. Transformers' assisted ``generate`` runs the prompt
        and the first draft in one forward, which a compressing cache ranks together, so it is refused at its first
        crop (with ``compression_ratio=0`` nothing is evicted and every crop is exact).

        Raises:
            ValueError: a positive count, or more tokens than were appended since the last eviction (the tokens
                they displaced are gone).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"KNormCache.crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        remove = -tokens_to_remove
        if remove == 0 or not self.is_initialized:
            return
        appended = self.cumulative_length - self.compressed_at
        if remove > appended:
            raise ValueError(
                f"KNormCache cannot crop {remove} tokens from layer {self.layer_idx}: only the {appended} tokens "
                "appended since its last eviction can be removed exactly (the others were ranked with the tokens "
                "they displaced, which are gone). Transformers' assisted generate runs the prompt and the first "
                "draft in one forward, which this cache compresses together: use it with compression_ratio=0 or a "
                "DynamicCache. A verification loop of your own can crop the draft tokens it appended after the "
                "prompt's compression; decoding_budget evicts at every step, so drop it there."
            )
        if self.row_lengths is not None:
            self.row_lengths = self.row_lengths - (self.positions[:, 0, -remove:] >= 0).sum(-1)
        self.keys, self.values = self.keys[..., :-remove, :], self.values[..., :-remove, :]
        self.positions = self.positions[..., :-remove]
        self.cumulative_length -= remove

    def reset(self) -> None:
        super().reset()
        self.positions, self.prompt_length, self.row_lengths, self.compressed_at = None, 0, None, 0
        self.prompt_open = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.get_seq_length() > 0:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
            if self.row_lengths is not None:
                self.row_lengths = self.row_lengths.index_select(0, beam_idx.to(self.row_lengths.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.get_seq_length() > 0:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)
            if self.row_lengths is not None:
                self.row_lengths = self.row_lengths.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.get_seq_length() > 0:
            self.positions = self.positions[indices, ...]
            if self.row_lengths is not None:
                self.row_lengths = self.row_lengths[indices]


def check_rows_budget(settings: EvictionSettings) -> None:
    """Raise unless the layer budget of ``settings`` can compress a padded batch, whose rows differ in length:
    ``"uniform"`` (each layer, each row its own length's count) or ``"global"`` (each row over every layer)."""
    if settings.layer_budget not in ("uniform", "global"):
        raise ValueError(
            f"layer_budget={settings.layer_budget!r} shares one prompt length's budget between layers; a padded batch "
            "has a length per row. Use layer_budget='uniform' (or layer_ratios) or 'global' with padded batches, or "
            "generate one prompt at a time."
        )
