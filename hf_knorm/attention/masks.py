"""The masks the plugin's attention receives: an ``O(N)`` key-padding mask for plain causal calls, ``N x N`` otherwise.

Transformers builds each forward's mask through the mask function registered under the attention's name
(``AttentionMaskInterface``; without one a custom attention gets no mask at all). :func:`hf_knorm_mask` is that
function. It hands the attention one of two forms:

- **Key padding** ``(B, kv)`` bool (True = a real key) for a *plain causal* call: Transformers' own causal mask
  function with nothing added (no sliding window, no packed sequences, no ``or``/``and`` overlay, which Transformers
  signals by keeping ``allow_is_causal_skip``), queries at the bottom right of the keys (query ``i`` at key position
  ``kv - q + i``: a prefill, a decoding step, a chunk of a prompt after a cache), and a query offset that is a Python
  int (a static cache's offset is a tensor its graph must not read). It means exactly what the ``N x N`` mask would:
  query ``i`` attends key ``j`` iff ``j <= kv - q + i`` and key ``j`` is real. The same rule as SDPA's
  ``allow_is_causal_skip`` and flash-attention's 2-D mask: the mask is described, not built.
- **Explicit** bool ``(B, 1, q, kv)`` from Transformers' ``sdpa_mask`` with its shortcuts off, in every other case.

So the linear path (``p = 1``, :mod:`.linear_kernel`) never sees an ``N x N`` tensor on a causal model's forward,
``generate`` or training step, with or without padding, and needs no scan of a mask to know it is causal; the
quadratic kernel builds the ``N x N`` form (:meth:`KeyPadding.dense`) only where it needs it (padding, a cache). A 4-D mask a
user passes is handed over as it is (Transformers does not call the mask function for it).

The norm recorders read either form through :func:`attended_keys` and :func:`attending_rows`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask


def explicit_bool_mask(*args, **kwargs):
    """Transformers' ``sdpa_mask`` that always materializes the bool mask ``(B, 1, q, kv)`` (True = attend)."""
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(*args, **kwargs)


def hf_knorm_mask(*args, **kwargs) -> torch.Tensor:
    """The mask function registered under ``"hf_knorm"``: key padding ``(B, kv)`` for a plain causal call (see the
    module docstring), the explicit ``(B, 1, q, kv)`` bool mask otherwise. Takes ``sdpa_mask``'s keyword arguments
    (``batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
    allow_is_causal_skip, device``; the same from Transformers 5.10 to 5.24)."""
    if not args and _plain_causal(kwargs):
        return key_padding(kwargs["batch_size"], kwargs["kv_length"], kwargs.get("kv_offset", 0),
                           kwargs.get("attention_mask"), kwargs.get("device", "cpu"))
    return explicit_bool_mask(*args, **kwargs)


def _plain_causal(kwargs: dict) -> bool:
    """Whether the call asks for Transformers' causal mask alone, with queries at the bottom right of the keys."""
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    return (kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("allow_is_causal_skip", True)
            and kwargs.get("local_size") is None
            and isinstance(q_offset, int) and isinstance(kv_offset, int)
            and q_offset + kwargs["q_length"] == kv_offset + kwargs["kv_length"])


def key_padding(batch: int, kv_length: int, kv_offset: int, attention_mask: torch.Tensor | None,
                device) -> torch.Tensor:
    """``(B, kv)`` bool: which of the keys at positions ``kv_offset .. kv_offset + kv - 1`` are real, read from the
    2-D ``attention_mask`` ``(B, >= kv_offset + kv)`` as ``sdpa_mask`` reads it (padded with False past its end)."""
    if attention_mask is None:
        return torch.ones(batch, kv_length, dtype=torch.bool, device=device)
    padding = prepare_padding_mask(attention_mask.to(dtype=torch.bool), kv_length, kv_offset)
    return padding[:, kv_offset: kv_offset + kv_length].to(device).expand(batch, kv_length)


@dataclass(frozen=True)
class KeyPadding:
    """The key-padding form as one attention call reads it: ``key_valid`` ``(B, kv)`` bool (True = a real key), cut to
    the call's keys, and ``q_len`` queries at the bottom right of them; ``causal``: query ``i`` attends keys up to
    position ``kv - q + i`` (else every real key).

    ``source``: the ``(B, kv_mask)`` tensor :func:`hf_knorm_mask` returned, which every layer of a forward receives,
    and ``offset``, where key 0 sits in it (negative: real keys put before it); what :attr:`all_real` remembers its
    answers by, so the layers of one forward read the mask once (``None``: read per instance)."""

    key_valid: torch.Tensor
    q_len: int
    causal: bool
    source: torch.Tensor | None = field(default=None, compare=False, repr=False)
    offset: int = field(default=0, compare=False, repr=False)

    @classmethod
    def of(cls, mask: torch.Tensor, q_len: int, kv_len: int, causal: bool) -> KeyPadding:
        """From the ``(B, kv_mask)`` mask :func:`hf_knorm_mask` returned, aligned to ``kv_len`` keys at the right (a
        KNorm layer that keeps fewer keys than the mask was sized for keeps the newest ones)."""
        extra = mask.shape[-1] - kv_len
        key_valid = mask[:, extra:] if extra >= 0 else torch.cat([mask.new_ones(mask.shape[0], -extra), mask], dim=-1)
        return cls(key_valid.to(torch.bool), q_len, causal, source=mask, offset=extra)

    def first(self, count: int, q_len: int) -> KeyPadding:
        """The first ``count`` keys, with ``q_len`` queries at their bottom right (the same source: the answers of
        :attr:`all_real` stay shared)."""
        return KeyPadding(self.key_valid[:, :count], q_len, self.causal, source=self.source, offset=self.offset)

    @cached_property
    def all_real(self) -> bool:
        """Whether every key is real. Reads the values (eager mode only): once per instance, and with a ``source``
        once per forward, whatever the number of layers (:func:`read_once`): the whole source first (every key
        real: so is every cut of it), this cut's keys only where the source has padding."""
        if self.source is None:
            return bool(self.key_valid.all())
        source = self.source.to(torch.bool)
        if read_once(self.source, "all real", lambda: bool(source.all())):
            return True
        start, stop = max(0, self.offset), self.offset + self.key_valid.shape[-1]  # this cut, in the source
        return read_once(self.source, ("all real", start, stop), lambda: bool(source[:, start:stop].all()))

    def dense(self) -> torch.Tensor:
        """The ``(B, 1, q, kv)`` bool mask this stands for (what a path that needs it builds)."""
        batch, kv_len = self.key_valid.shape
        allowed = self.key_valid[:, None, None, :]
        if self.causal:
            device = self.key_valid.device
            rows = torch.arange(self.q_len, device=device)[:, None] + (kv_len - self.q_len)
            allowed = allowed & (torch.arange(kv_len, device=device)[None, :] <= rows)
        return allowed.expand(batch, 1, self.q_len, kv_len)

    def attended_keys(self) -> torch.Tensor:
        """``(B, kv)``: the keys some query attends (every real key: the last query sees them all)."""
        return self.key_valid

    def attending_rows(self) -> torch.Tensor:
        """``(B,)``: the queries that attend at least one key (causal: a real key at or before their position)."""
        if not self.causal:
            return self.key_valid.any(dim=-1).long() * self.q_len
        kv_len = self.key_valid.shape[-1]
        return (self.key_valid.cumsum(dim=-1)[:, kv_len - self.q_len:] > 0).sum(dim=-1)


def explicit_mask(mask: torch.Tensor | None, q_len: int, causal: bool = True) -> torch.Tensor | None:
    """``mask`` in the form any attention implementation takes: key padding ``(B, kv)`` becomes the bool
    ``(B, 1, q, kv)`` mask it stands for, anything else is returned as it is. For a module that receives the
    plugin's masks but attends with another implementation (the attention-transfer teacher runs SDPA on them)."""
    if mask is None or mask.dim() != 2:
        return mask
    return KeyPadding.of(mask, q_len, mask.shape[-1], causal).dense()


_read: tuple[weakref.ref, dict] | None = None  # (the last source read, its answers by question)


def read_once(source: torch.Tensor, question, read):
    """``read()``'s answer for ``source`` and ``question``, read once while the ``source`` tensor lives: the mask
    every layer of a forward receives lives for that forward, so its answers are read from the device once per
    forward instead of once per layer (as :func:`.paths.causal_key_validity` does for a 4-D mask; the mask is not
    changed in place while it lives: Transformers builds a new one per forward). Remembered for one source at a time
    (a weak reference: a new tensor is never mistaken for a dead one)."""
    global _read
    if _read is None or _read[0]() is not source:
        _read = (weakref.ref(source), {})
    answers = _read[1]
    if question not in answers:
        answers[question] = read()
    return answers[question]


Mask = torch.Tensor | KeyPadding | None
"""What the kernels and recorders take: a bool ``(B or 1, 1 or H_q, q, kv)`` mask, :class:`KeyPadding`, or ``None``."""


def kernel_mask(mask: Mask, compiling: bool = False) -> torch.Tensor | None:
    """``mask`` as the quadratic kernels take it (bool 4-D or ``None``): key padding becomes ``None`` where every key
    is real and the kernel's implicit causal mask is the same (as many queries as keys, or one query; not read while
    compiling), the ``(B, 1, q, kv)`` bool mask otherwise (only this path builds it)."""
    if not isinstance(mask, KeyPadding):
        return mask
    implicit = not mask.causal or mask.q_len in (1, mask.key_valid.shape[-1])
    if implicit and not compiling and mask.all_real:
        return None
    return mask.dense()


def attended_keys(mask: Mask, batch: int, kv_len: int, device) -> torch.Tensor:
    """``(B, kv)`` bool: key positions some query may attend (padding keys are attended by none); ``None``: every
    key."""
    if mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if isinstance(mask, KeyPadding):
        return mask.attended_keys().expand(batch, kv_len)
    return mask[..., :kv_len].any(dim=-2).any(dim=1).expand(batch, kv_len)


def attending_rows(mask: Mask, batch: int, heads: int, kv_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``(B, heads)``: the query rows that attend at least one key (``None``: every one of ``kv`` rows, a
    self-attention forward without a cache)."""
    if mask is None:
        return torch.full((batch, heads), float(kv_len), dtype=dtype, device=device)
    if isinstance(mask, KeyPadding):
        return mask.attending_rows().to(dtype)[:, None].expand(batch, heads)
    return mask[..., :kv_len].any(dim=-1).sum(dim=-1).to(dtype).expand(batch, heads)


@dataclass(frozen=True)
class CallLayout:
    """What a route for a whole call reads of the call besides its tensors (``backends.with_kernel``): ``mask`` as
    :func:`.interface.read_mask` gives it (:data:`Mask`), ``bias`` an additive float bias or ``None``, ``causal``, and
    the numbers of queries and keys."""

    mask: Mask
    bias: torch.Tensor | None
    causal: bool
    q_len: int
    kv_len: int
