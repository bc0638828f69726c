"""Norm statistics gathered inside the attention function: attention-matrix norms and per-channel K/V norms.

While a :class:`NormRecorder` is active (``with recorder:``), every call of the plugin's attention function reports
to it, for its layer:

- the Frobenius norm of each (batch item, query head) attention matrix, post-normalization and post-mask (the
  quantity "Rethinking Softmax" tracks: softmax keeps it <= sqrt(N));
- per-channel sums of squares of the keys (post-RoPE, as cached) and of the values, over the real (unpadded) tokens,
  all KV heads side by side: channel ``h * head_dim + d``.

Statistics describe prefill-style forward passes (keys = the tokens of the batch); during cached decoding the keys
include the cache, so record on plain forward passes. Use :func:`hf_knorm.record_norms` to record a model that is
not patched (it patches it with ``softmax`` for the duration, which equals the model's own attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.masks import attended_keys
from ..attention.taps import activate_recorder, deactivate_recorder


@dataclass
class LayerNorms:
    """Accumulated statistics of one attention layer.

    Attributes:
        key_sq, value_sq: fp64 ``(H_kv * D,)`` sums of squares per channel over ``tokens`` real tokens.
        tokens: how many real key tokens were summed.
        frobenius: one fp32 ``(B, H_q)`` tensor of attention-matrix Frobenius norms per recorded call.
    """

    key_sq: torch.Tensor | None = None
    value_sq: torch.Tensor | None = None
    tokens: int = 0
    frobenius: list[torch.Tensor] = field(default_factory=list)

    def key_channel_norms(self) -> torch.Tensor:
        """``(H_kv * D,)`` L2 norm of each key channel over the recorded tokens."""
        return self.key_sq.sqrt()

    def value_channel_norms(self) -> torch.Tensor:
        """``(H_kv * D,)`` L2 norm of each value channel over the recorded tokens."""
        return self.value_sq.sqrt()

    def attention_frobenius(self) -> torch.Tensor:
        """All recorded Frobenius norms, flattened over calls, batch items and heads."""
        return torch.cat([f.flatten() for f in self.frobenius])


class NormRecorder:
    """Collects :class:`LayerNorms` per attention layer while active.

    Args:
        layers: the attention modules in layer order (``hf_knorm.models.architectures.attention_modules``); a call from
            a module not in the list is an error.
        keys_values: record K/V channel statistics (a pass over keys per call).
        attention: record attention-matrix Frobenius norms.

    Examples:
        >>> recorder = NormRecorder([m for _, m in attention_modules(model)])
        >>> with recorder:
        ...     model(**batch)
        >>> recorder.layers[0].key_channel_norms()
    """

    def __init__(self, layers: list[torch.nn.Module], keys_values: bool = True, attention: bool = True):
        self._index = {id(module): i for i, module in enumerate(layers)}
        self.layers = [LayerNorms() for _ in layers]
        self.keys_values = keys_values
        self.attention = attention
        self._token = None

    def __enter__(self) -> NormRecorder:
        self._token = activate_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        deactivate_recorder(self._token)

    def records(self, module) -> bool:
        """Whether ``module`` is one of the layers this recorder was built for."""
        return id(module) in self._index

    def record(self, module, key, value, allowed, frobenius_sq) -> None:
        """Called by the attention function.

        Shapes: key/value ``(B, H_kv, kv, D)``; allowed: the mask as the attention read it (bool ``(B or 1, 1 or H_q,
        q, kv)``, key padding ``(B, kv)`` or None: :mod:`hf_knorm.attention.masks`); frobenius_sq
        ``(B, H_q)`` squared Frobenius norms.
        """
        index = self._index.get(id(module))
        if index is None:
            raise RuntimeError(f"{type(module).__name__} is not one of the layers this NormRecorder was built for.")
        layer = self.layers[index]
        if self.attention:
            layer.frobenius.append(frobenius_sq.detach().sqrt().cpu())
        if not self.keys_values:
            return
        valid = attended_keys(allowed, key.shape[0], key.shape[2], key.device)  # (B, kv)
        weights = valid.to(torch.float64)[:, None, :, None]
        key_sq = (key.detach().double().square() * weights).sum(dim=(0, 2)).flatten().cpu()  # (H_kv * D,)
        value_sq = (value.detach().double().square() * weights).sum(dim=(0, 2)).flatten().cpu()
        layer.key_sq = key_sq if layer.key_sq is None else layer.key_sq + key_sq
        layer.value_sq = value_sq if layer.value_sq is None else layer.value_sq + value_sq
        layer.tokens += int(valid.sum())
