"""A KNorm layer that keeps a different number of tokens in each KV head, stored compactly, and the attention that
reads it.

Storage (:class:`RaggedKNormLayer`): one flat store per layer, **head-major**: ``keys`` and ``values`` are (C, D),
``positions`` (C,) int64; the kept pairs of each (batch row, KV head) are one contiguous slice of it, in position
order, ending at ``ends[b, h]`` (the head's first free slot) and ``lengths[b, h]`` long ((B, H_kv) int64 each). After each head's slice the
store leaves a little room, the same for every head: ``floor(CAPACITY_SLACK * mean kept per head)`` slots (2%, zero
below 50 tokens per head), so that decoding writes the new token of every head in place (one ``index_copy_`` each for
keys, values and positions) and the store is rebuilt, with fresh room, only when that room is used up (every ~2% of
the length: amortized). Bytes held by the cache (:meth:`~hf_knorm.eviction.cache.KNormCache.nbytes`): the store,
``2 * C * D * itemsize`` with C = kept pairs + room (at most 2% more), plus the index ``16 * B * H_kv`` bytes per layer
(``ends`` and ``lengths``). ``positions`` (introspection, ``KNormCache.kept_positions``) is counted by
``nbytes(include_positions=True)``.

Attention (the ``"knorm_ragged"`` function, :func:`ragged_attention`, Transformers' SDPA underneath):

- the prompt (the first forward through the cache) is rectangular, every head holds it whole: ``update`` returns the
  step's states and the attention is exactly SDPA;
- a decoding step (one token, the cache refuses more after the prompt) attends **per KV head on views of the store**:
  for each (batch row, KV head) the group's query heads (1, group, 1, D) against that head's slice (1, 1, L_h, D)
  (SDPA with ``enable_gqa``: no ``repeat_kv`` copy), no mask (a single query token sees every cached token of an
  unpadded batch). ``update`` returns the step's own (B, H_kv, 1, D) states carrying the views as ``knorm_ragged``;
  no padded (B, H_kv, max_len, D) tensor is built, in the call or after it;
- when every head of the layer holds the same count (e.g. ``head_floor=1``, or a layer that keeps its prompt whole),
  the store is a rectangle with a stride: ``update`` returns the (B, H_kv, L, D) view of it (no copy) and the
  attention is Transformers' own ``sdpa_attention_forward`` on it, the same call as the uniform cache's, so equal
  budgets give the uniform cache's logits bit for bit.

Padded batches (:mod:`hf_knorm.eviction.rows`): a left-padded prompt is stored whole, its padding at position ``-1``
(the layout of a uniform layer's padded prompt, which a deferred score's importance is given in), then each row is
compressed as its real tokens alone (:meth:`RaggedKNormLayer.compress_rows`; under ``layer_budget="global"`` the
cache ranks each row's pairs over every layer, :meth:`~hf_knorm.eviction.cache.KNormCache._finish_prompt`), padding
never kept. ``row_lengths`` (B,) counts each row's real tokens, so decoded tokens get their row's own positions. A
decoding step then attends each head's slice as for an unpadded batch: the slices hold real tokens only, so the mask
Transformers built for the padding is not read (:attr:`RaggedViews.padded_rows`), and the store is never handed to
SDPA as a rectangle.

A model must therefore run with ``model.set_attn_implementation("knorm_ragged")``
(``hf_knorm.eviction.pipeline.knorm_generate`` does it for the call); the cache refuses a ragged step under any other
attention, loudly, rather than attend only the new token. The name is registered with Transformers by the first
``KNormCache(head_budget="heads")`` (:func:`register`), not at import.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .budgets import head_adaptive_keep
from .registered_attention import register_attention
from .layer import KNormLayer, check_rows_budget
from .rows import live_mask, prompt_padding

__all__ = ["CAPACITY_SLACK", "RAGGED_ATTENTION", "RaggedKNormLayer", "RaggedViews", "ragged_attention",
           "ragged_attention_for", "register"]

RAGGED_ATTENTION = "knorm_ragged"
CAPACITY_SLACK = 0.02  # room left after each head's slice, as a fraction of the mean kept count per head (floored)


@dataclass(frozen=True)
class RaggedViews:
    """What a decoding step hands to :func:`ragged_attention`: the layer's store and each head's slice of it.

    Attributes:
        keys, values (torch.Tensor): (C, D) and (C, D_v), the layer's store (not a copy).
        spans (tuple of (int, int)): (start, length) per (batch row, KV head), row-major: B * H_kv entries.
        heads (int): H_kv.
        padded_rows (bool): the batch is left-padded; each slice holds its row's real tokens only, so the attention
            does not read the padding mask Transformers built.
    """

    keys: torch.Tensor
    values: torch.Tensor
    spans: tuple
    heads: int
    padded_rows: bool = False


def _room_for(total: int, heads: int) -> int:
    """Free slots left after each of ``heads`` slices holding ``total`` pairs: ``floor(CAPACITY_SLACK * mean)``."""
    return int(round(CAPACITY_SLACK * total, 6)) // max(1, heads)


class RaggedKNormLayer(KNormLayer):
    """One layer of a ``KNormCache(head_budget="heads")``: per-head kept counts, head-major (see the module docstring).

    Attributes:
        keys, values (torch.Tensor): (C, D), the store: each head's kept pairs in one slice, then some free room.
        positions (torch.Tensor): (C,) int64 absolute positions (``-1`` in the free room).
        ends, lengths (torch.Tensor): (B, H_kv) int64, where each head's slice ends (its first free slot) and how many
            pairs it holds; ``starts`` is ``ends - lengths``.
    """

    is_croppable = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "KNormCache(head_budget='heads') cannot be cropped: it takes one token per forward after the prompt, and "
            "assisted/speculative decoding verifies several at once. Use head_budget='uniform' (croppable after the "
            "prompt's compression) or a DynamicCache."
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty(0, dim)
        self.values = value_states.new_empty(0, value_states.shape[-1])
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.ends = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self._spans: list[list[int]] = [[0, 0] for _ in range(batch * heads)]  # (start, length), host-side mirror
        self._room = 0  # free slots left after every head's slice (the same for all)
        self._rectangular = True  # every head holds the same count and the same room: a strided (B, H, L, D) view
        self.is_initialized = True

    def stored_length(self) -> int:
        """The longest head's kept count."""
        return max((length for _, length in self._spans), default=0) if self.is_initialized else 0

    def stored_per_head(self) -> torch.Tensor:
        return self.lengths.clone() if self.is_initialized else torch.zeros(0, 0, dtype=torch.long)

    @property
    def starts(self) -> torch.Tensor:
        """(B, H_kv) int64: where each head's slice begins in the store."""
        return self.ends - self.lengths

    def capacity(self) -> int:
        """Slots of the store (kept pairs + free room)."""
        return self.keys.shape[0] if self.is_initialized else 0

    # --- the store ---------------------------------------------------------------------------------------------------
    def _slices(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into the store of every kept pair, ordered by (batch row, head, position), for the batch rows
        ``rows`` (all by default), and their (B', H_kv) counts."""
        starts = self.starts
        starts, lengths = (starts, self.lengths) if rows is None else (starts[rows], self.lengths[rows])
        counts = lengths.reshape(-1)
        head = torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts)  # (N,)
        first = counts.cumsum(0) - counts  # where each head begins in the packed order
        index = starts.reshape(-1)[head] + torch.arange(head.numel(), device=self.device) - first[head]
        return index, lengths

    def _store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> None:
        """Hold packed (N, D) pairs ordered by (batch row, head, position), ``lengths`` (B, H_kv) of them per head,
        leaving ``floor(CAPACITY_SLACK * mean count)`` free slots after each head's slice."""
        batch, heads = lengths.shape
        counts = lengths.reshape(-1)
        listed = counts.tolist()
        total = sum(listed)
        room = _room_for(total, len(listed))
        starts = counts.cumsum(0) - counts + room * torch.arange(len(listed), device=self.device)
        if room:
            head = torch.repeat_interleave(torch.arange(len(listed), device=self.device), counts)
            where = torch.arange(total, device=self.device) + room * head  # (N,) slots in the new store
            size = total + room * len(listed)
            self.keys = keys.new_empty(size, keys.shape[-1]).index_copy_(0, where, keys)
            self.values = values.new_empty(size, values.shape[-1]).index_copy_(0, where, values)
            self.positions = positions.new_full((size,), -1).index_copy_(0, where, positions)
        else:
            self.keys, self.values, self.positions = keys, values, positions
        self.lengths, self.ends = lengths.clone(), (starts + counts).reshape(batch, heads)
        self._spans = [[start, count] for start, count in zip(starts.tolist(), listed)]
        self._room = room
        self._rectangular = len(set(listed)) <= 1 and self.row_lengths is None  # padded rows: never a rectangle

    def _grow(self) -> None:
        """The room is used up: copy every head's slice into a new store with fresh room after each (one ``cat`` per
        tensor; the heads keep their order and counts)."""
        count = len(self._spans)
        room = max(1, _room_for(sum(length for _, length in self._spans), count))
        stores = []
        for store, fill in ((self.keys, None), (self.values, None), (self.positions, -1)):
            free = store.new_empty((room, *store.shape[1:])) if fill is None else store.new_full((room,), fill)
            stores.append(torch.cat([piece for start, length in self._spans
                                     for piece in (store[start:start + length], free)]))
        self.keys, self.values, self.positions = stores
        first = 0
        for span in self._spans:
            span[0], first = first, first + span[1] + room
        starts = torch.tensor([start for start, _ in self._spans], device=self.device).reshape(self.lengths.shape)
        self.ends = starts + self.lengths
        self._room = room

    def _pack(self, keys, values, positions, keep) -> None:
        """Store the ``keep`` (B, H_kv, S) entries of rectangular (B, H_kv, S, D) states."""
        where = keep.nonzero(as_tuple=True)
        self._store(keys[where], values[where], positions[where], keep.sum(-1))

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Rebuild the store from the batch rows ``rows`` (beam search, batch expansion and selection)."""
        index, lengths = self._slices(rows)
        if self.row_lengths is not None:
            self.row_lengths = self.row_lengths[rows]
        self._prompt_rows = [self._prompt_rows[row] for row in rows.tolist()]
        self._store(self.keys[index], self.values[index], self.positions[index], lengths)

    def padded(self, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A padded copy for introspection and the prompt's eviction (never used to attend a decoding step): keys,
        values (B, H_kv, L, D), positions (B, H_kv, L) (-1 in padding) and the (B, H_kv, L) bool ``valid``,
        L = the longest head (+ ``extra``)."""
        batch, heads = self.lengths.shape
        length = self.stored_length() + extra
        valid = torch.arange(length, device=self.device) < self.lengths[..., None]  # (B, H_kv, L)
        where = valid.nonzero(as_tuple=True)
        index, _ = self._slices()
        keys = self.keys.new_zeros(batch, heads, length, self.keys.shape[-1])
        values = self.values.new_zeros(batch, heads, length, self.values.shape[-1])
        positions = torch.full((batch, heads, length), -1, dtype=torch.long, device=self.device)
        keys[where], values[where], positions[where] = self.keys[index], self.values[index], self.positions[index]
        return keys, values, positions, valid

    # --- the Cache layer API -----------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               position_ids: torch.Tensor | None = None, **kwargs):
        """Take (B, H_kv, q, D) states. The prompt (the first call): return them as they are and store the kept ones
        (compressed now, or whole until the cache's layer schedule runs). A decoding step (q = 1): append the token to
        every head in place and return what the attention reads (module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        start = self.cumulative_length
        self.cumulative_length += q_len
        if start == 0:
            self.prompt_length = q_len
            positions = torch.arange(q_len, device=self.device).expand(batch, heads, q_len)
            keep = torch.ones(batch, heads, q_len, dtype=torch.bool, device=self.device)
            pads = prompt_padding(position_ids, q_len) if q_len > 0 else None
            self._prompt_rows = [q_len] * batch  # host-side: each row's prompt length
            if pads is not None:  # stored whole, padding at -1; each row compressed alone (module docstring)
                check_rows_budget(self.settings)
                self.row_lengths = q_len - pads
                self._prompt_rows = self.row_lengths.tolist()
                self._pack(key_states, value_states, (positions - pads[:, None, None]).clamp_min(-1), keep)
                if self.settings.layer_budget == "uniform" and not self.settings.deferred:
                    self.compress_rows()
                return key_states, value_states
            if self.settings.layer_budget == "uniform" and not self.settings.deferred and q_len > 0:
                order = self.settings.eviction_order(key_states, value_states, positions, self.layer_idx, q_len)
                keep = self._kept_of(order, q_len)
            self._pack(key_states, value_states, positions, keep)
            return key_states, value_states
        if q_len != 1:
            raise ValueError("KNormCache(head_budget='heads') takes one token per forward after the prompt; feed the "
                             "tokens one at a time (hf_knorm.eviction.pipeline.append_tokens does).")
        if self._room == 0:
            self._grow()
        slots = self.ends.view(-1)  # (B * H_kv,) the first free slot of each head
        self.keys.index_copy_(0, slots, key_states.reshape(-1, key_states.shape[-1]))
        self.values.index_copy_(0, slots, value_states.reshape(-1, value_states.shape[-1]))
        self._room -= 1
        real = None
        if self.row_lengths is None:
            self.positions.index_fill_(0, slots, start)
            self.ends += 1
            self.lengths += 1
            for span in self._spans:
                span[1] += 1
        else:  # a padded batch: each row's own position; a padding token is written into the room, not kept
            real = self._real_rows(position_ids)
            self.positions.index_copy_(0, slots, torch.where(real, self.row_lengths, -1).repeat_interleave(heads))
            self.row_lengths = self.row_lengths + real
            step = real.long()[:, None].expand(batch, heads)
            self.ends += step
            self.lengths += step
            for span, taken in zip(self._spans, step.reshape(-1).tolist()):
                span[1] += taken
        if self.settings.keeps_above_threshold:
            self._evict_leaving(key_states.shape[0], heads, start, real)
        if self._rectangular:  # every head alike: the store is a strided (B, H_kv, L, D) rectangle
            capacity, length = self._spans[0][1] + self._room, self._spans[0][1]
            size = batch * heads * capacity
            return (self.keys[:size].view(batch, heads, capacity, -1)[:, :, :length],
                    self.values[:size].view(batch, heads, capacity, -1)[:, :, :length])
        key_states.knorm_ragged = RaggedViews(self.keys, self.values, tuple(map(tuple, self._spans)), heads,
                                              padded_rows=self.row_lengths is not None)
        return key_states, value_states

    def _kept_of(self, order: torch.Tensor, length: int) -> torch.Tensor:
        """(B, H_kv, n) bool, the pairs a prompt of ``length`` tokens keeps given their eviction ``order``: those at
        or above the :attr:`~hf_knorm.eviction.settings.EvictionSettings.threshold` (protected ones included), or the
        layer's share spread over its heads (:func:`~hf_knorm.eviction.budgets.head_adaptive_keep`)."""
        if self.settings.keeps_above_threshold:
            return order <= -self.settings.threshold
        return head_adaptive_keep(order, self.settings.prompt_keep(self.layer_idx, length), self.settings.head_floor)

    def _evict_leaving(self, batch: int, heads: int, start: int, real: torch.Tensor | None) -> None:
        """Threshold pruning during decoding (KVzap's ``ThresholdPress``): a step's attention reads the last
        ``recent_window`` tokens and the query, as a ``decoding_budget`` cache's does; the pair that dropped out of
        them at the row's previous step (its position ``length - 2 - W``; every head still holds it, as the ``W + 1``
        after it) is scored once, from its key and value in every head, and removed from each head where its
        importance is below the threshold, before this step's attention. The ``W + 1`` pairs after it move one slot
        down (``O(W * D)`` per head, no rebuild; the head's room grows by one). Sinks are never scored, and neither
        are pairs the prefill ranked; a padded batch's row whose token this step was padding has nothing to score
        (``real``: :meth:`_real_rows`)."""
        window = self.settings.recent_window
        lengths = (self.row_lengths if self.row_lengths is not None
                   else torch.full((batch,), start + 1, dtype=torch.long, device=self.device))
        leaving = lengths - 2 - window  # (B,) the row position that left the window at the row's previous step
        decoded = lengths - torch.tensor(self._prompt_rows, device=self.device)  # (B,) tokens after each prompt
        due = (leaving >= self.settings.sink_tokens) & (decoded >= 2) & (self.lengths >= window + 2).all(-1)
        if real is not None:
            due &= real
        if not bool(due.any()):
            return
        slot = torch.where(due[:, None], self.ends - (window + 2), 0)  # (B, H_kv): where each head holds it
        keys, values = self.keys[slot][:, :, None], self.values[slot][:, :, None]  # (B, H_kv, 1, D)
        position = leaving.clamp_min(0)[:, None, None].expand(batch, heads, 1)
        below = self.settings.importance(keys, values, position, self.layer_idx)[..., 0] < self.settings.threshold
        drop = below & due[:, None]  # (B, H_kv)
        dropped = drop.reshape(-1).tolist()
        if not any(dropped):
            return
        after = (slot.reshape(-1)[drop.reshape(-1)] + 1)[:, None] + torch.arange(window + 1, device=self.device)
        moved, into = after.reshape(-1), (after - 1).reshape(-1)
        for store in (self.keys, self.values, self.positions):
            store[into] = store[moved]  # gathered first: the overlapping move is safe
        self.ends -= drop.long()
        self.lengths -= drop.long()
        for span, gone in zip(self._spans, dropped):
            span[1] -= gone
        self._rectangular = False

    def _real_rows(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """(B,) bool: which rows of a padded batch's one-token step are real (their position id continues the row),
        not padding (id 0, as a left-padded block of new tokens gives it: ``append_tokens`` feeds one at a time)."""
        if position_ids is None:
            return torch.ones_like(self.row_lengths, dtype=torch.bool)
        ids = position_ids.reshape(-1, position_ids.shape[-1])[:, -1].to(self.row_lengths.device)
        real = ids == self.row_lengths
        if not bool((real | (ids == 0)).all()):
            raise ValueError("KNormCache(head_budget='heads') got a token whose position id neither continues its row "
                             "nor marks padding (0): feed a padded batch's new tokens with the batch's attention mask "
                             "and the position ids generate derives from it.")
        return real

    def compress_prompt(self, keep: int, order: torch.Tensor | None = None) -> None:
        order = self.prompt_order() if order is None else order
        self.keep_prompt(head_adaptive_keep(order, keep, self.settings.head_floor))

    def keep_prompt(self, kept: torch.Tensor) -> None:
        """Keep the (B, H_kv, n) ``kept`` pairs of the stored prompt, any count per head (``layer_budget="global"``)."""
        keys, values, positions, _ = self.padded()  # the prompt, whole: no padding yet
        self._pack(keys, values, positions, kept)

    def prompt_order(self, importance: torch.Tensor | None = None) -> torch.Tensor:
        keys, values, positions, _ = self.padded()
        return self.settings.eviction_order(keys, values, positions, self.layer_idx, self.cumulative_length,
                                            importance)

    def prompt_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys, values, positions, _ = self.padded()  # the prompt, whole: every head holds it (a copy of the store)
        return keys, values, positions

    def row_orders(self, importance: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A padded batch's stored prompt, row by row: ``(slots, order)`` per row, its real slots (n_b,) in the
        prompt's padded layout and their eviction order (1, H_kv, n_b) computed on the row alone, as the row's own
        prompt would be (from ``importance`` (B, H_kv, N) in that layout when given)."""
        keys, values, positions = self.prompt_slots()
        orders = []
        for row, length in enumerate(self.row_lengths.tolist()):
            slots = (positions[row, 0] >= 0).nonzero().squeeze(-1)
            pick = lambda tensor: tensor[row:row + 1, :, slots]  # noqa: E731
            orders.append((slots, self.settings.eviction_order(
                pick(keys), pick(values), pick(positions), self.layer_idx, length,
                None if importance is None else pick(importance))))
        return orders

    def keep_rows(self, slots: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
        """Keep, in each row ``b`` of a padded batch's stored prompt, the (1, H_kv, n_b) ``kept[b]`` pairs of its real
        ``slots[b]`` (:meth:`row_orders`); the padding is dropped."""
        keys, values, positions = self.prompt_slots()
        keep = torch.zeros(positions.shape, dtype=torch.bool, device=self.device)
        for row, (where, mask) in enumerate(zip(slots, kept, strict=True)):
            keep[row, :, where] = mask[0]
        self._pack(keys, values, positions, keep)

    def compress_rows(self, importance: torch.Tensor | None = None) -> None:
        """A padded batch's stored prompt: each row keeps what it keeps alone (:meth:`_kept_of` on its own length:
        its share spread over its heads, or what passes the threshold)."""
        orders = self.row_orders(importance)
        lengths = self.row_lengths.tolist()
        self.keep_rows([slots for slots, _ in orders],
                       [self._kept_of(order, length) for (_, order), length in zip(orders, lengths)])

    def reset(self) -> None:
        super().reset()
        self.lengths = self.ends = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(beam_idx.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(torch.arange(self.lengths.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self.get_seq_length() > 0:
            self._select_rows(torch.arange(self.lengths.shape[0], device=self.device)[indices])


def _attend_per_head(query: torch.Tensor, views: RaggedViews, attention_mask, scaling, dropout: float):
    """One query token (B, H_q, 1, D) against each KV head's slice of the store: (B, 1, H_q, D_v)."""
    batch, query_heads, _, _ = query.shape
    if not views.padded_rows and attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The knorm_ragged attention attends every cached token of a decoding step; it got a mask "
                         "that hides some (a padded batch?), which KNormCache(head_budget='heads') does not support.")
    group = query_heads // views.heads
    out = []
    for index, (start, length) in enumerate(views.spans):
        row, head = divmod(index, views.heads)
        keys = views.keys[start:start + length].view(1, 1, length, -1)
        values = views.values[start:start + length].view(1, 1, length, -1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[row:row + 1, head * group:(head + 1) * group], keys, values, dropout_p=dropout, scale=scaling,
            enable_gqa=group > 1))  # (1, group, 1, D_v)
    return torch.cat(out, dim=1).reshape(batch, query_heads, 1, -1).transpose(1, 2).contiguous(), None


def ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA attention (Transformers' ``sdpa_attention_forward``) that also reads a :class:`RaggedKNormLayer`'s
    decoding step: when ``key`` carries ``knorm_ragged`` (:class:`RaggedViews`), the query token attends each KV head's
    slice of the store (module docstring). When ``key`` carries ``knorm_live`` (B, L) (a padded batch's step after
    its prompt, :mod:`hf_knorm.eviction.rows`), SDPA runs with :func:`~hf_knorm.eviction.rows.live_mask` in place of
    the mask Transformers built. Otherwise this is exactly SDPA."""
    if kwargs.get("softcap") is not None:
        raise ValueError("The knorm_ragged attention (SDPA) has no logit softcapping; head_budget='heads' does not "
                         "support this model (use head_budget='uniform').")
    views = getattr(key, "knorm_ragged", None)
    if views is not None:
        return _attend_per_head(query, views, attention_mask, kwargs.get("scaling"), kwargs.get("dropout", 0.0))
    live = getattr(key, "knorm_live", None)
    if live is not None:  # a padded batch after its prompt: the layer's own mask of real slots
        return sdpa_attention_forward(module, query, key, value, live_mask(live, query.shape[2]), **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def ragged_attention_for(model, cache, padded: bool = False):
    """Run ``model`` with the ``"knorm_ragged"`` attention while the block runs if ``cache`` has per-head counts
    (``head_budget="heads"``) or the batch is ``padded`` (each row keeps its own tokens, :mod:`hf_knorm.eviction.rows`);
    its own attention is given back afterwards, even on error. Otherwise does nothing."""
    if not padded and not any(isinstance(layer, RaggedKNormLayer) for layer in cache.layers):
        yield
        return
    register()
    original = model.config._attn_implementation
    model.set_attn_implementation(RAGGED_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


def register() -> None:
    """Register :func:`ragged_attention` (and Transformers' SDPA mask) under ``"knorm_ragged"`` with Transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface`` (public extension points, process-wide registries).

    Lazily: by the first ``KNormCache(head_budget="heads")`` (a cache that needs the attention) and by
    :func:`ragged_attention_for`; ``import hf_knorm`` registers nothing under this name. Idempotent; a name that
    already holds another function (someone else's ``"knorm_ragged"``) is refused rather than replaced.

    Raises:
        ValueError: ``"knorm_ragged"`` is registered with another attention or mask function.
    """
    register_attention(RAGGED_ATTENTION, ragged_attention, sdpa_mask, "hf_knorm's head budgets")
