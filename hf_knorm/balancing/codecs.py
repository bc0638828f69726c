"""K/V compression codecs for teacher-forced evaluation: what attention reads instead of the exact keys and values.

Each codec is a callable ``(module, key, value) -> (key, value)`` for :class:`hf_knorm.attention.taps.KVTransform`
(shapes ``(B, H_kv, N, D)``, post-RoPE keys as cached). The channel axis is ``C = H_kv * D`` (heads side by side).

- :class:`JointLowRank`: TransMLA's use of balanced K/V (arXiv 2502.07864): per layer, the token vectors
  ``x = [k; v]`` (``2C``) are projected onto the top-``r`` eigenvectors of the calibration second moment
  ``E[x x^T]`` (uncentred PCA, as a linear latent cache would store them), ``x -> P P^T x``. If keys are 10x larger
  than values, the top directions are all key directions and values are lost first: balancing is what fixes that.
- :func:`per_token_groups`: integer quantization per token in groups of ``group`` consecutive channels (asymmetric
  min-max per group, KIVI/Transformers ``QuantizedCache`` style), K and V quantized separately. Scale-equivariant: a
  per-layer scalar on K (``layer`` balancing) cannot change it; per-channel balancing can.
- :func:`shared_absmax_fp8`: one absmax scale for K and V together per layer and forward pass, values cast to
  ``float8_e4m3fn``: the smaller of K and V falls towards fp8's subnormal range unless they are balanced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..attention.taps import KVTransform
from ..models.architectures import architecture_of, attention_modules
from ..recording.record_norms import routed_through_plugin

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, N, H * D)``: one row per token, heads side by side."""
    b, h, n, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, n, h * d)


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """``(B, N, H * D)`` -> ``(B, H, N, D)``."""
    b, n, c = x.shape
    return x.reshape(b, n, h, c // h).permute(0, 2, 1, 3)


def quantize_groups(x: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    """Fake-quantize the last axis of ``x`` in groups of ``group`` channels: asymmetric min-max, ``2^bits`` levels.

    ``x.shape[-1]`` must be a multiple of ``group``. Computed in fp32; returns ``x``'s dtype.
    """
    if x.shape[-1] % group:
        raise ValueError(f"{x.shape[-1]} channels do not split into groups of {group}.")
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}.")
    g = x.float().reshape(*x.shape[:-1], -1, group)
    low, high = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((g - low) / scale).round().clamp(0, 2**bits - 1)
    return (q * scale + low).reshape(x.shape).to(x.dtype)


def per_token_groups(bits: int, group: int = 64) -> Callable:
    """Codec: K and V each quantized per token with :func:`quantize_groups` over the ``H_kv * D`` channels."""

    def codec(module, key, value):
        h = key.shape[1]
        return (_heads(quantize_groups(_tokens(key), bits, group), h),
                _heads(quantize_groups(_tokens(value), bits, group), h))

    return codec


def shared_absmax_fp8(module, key, value):
    """Codec: one scale ``max(|K|, |V|) / 448`` for both, cast through ``float8_e4m3fn`` and back."""
    scale = torch.maximum(key.abs().amax(), value.abs().amax()).float().clamp_min(1e-30) / FP8_MAX
    def cast(x):
        return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    return cast(key), cast(value)


class JointLowRank:
    """Codec: per layer, project each token's ``[k; v]`` onto the top-``rank`` eigenvectors of its second moment.

    Build with :meth:`fit`; ``bases[i]`` is layer ``i``'s ``(2C, 2C)`` eigenvector matrix (columns by decreasing
    eigenvalue), so one fit serves every rank (:meth:`with_rank`).
    """

    def __init__(self, model: nn.Module, bases: list[torch.Tensor], rank: int | None = None):
        self._index = {id(module): i for i, (_, module) in enumerate(attention_modules(model))}
        self.bases = bases
        self.rank = rank

    @classmethod
    @torch.no_grad()
    def fit(cls, model: nn.Module, batches: list[dict]) -> JointLowRank:
        """Accumulate ``sum x x^T`` (fp64) per layer over ``batches`` (model-input dicts) and diagonalize it."""
        index = {id(module): i for i, (_, module) in enumerate(attention_modules(model))}
        moments: dict[int, torch.Tensor] = {}

        def accumulate(module, key, value):
            x = torch.cat([_tokens(key), _tokens(value)], dim=-1).reshape(-1, 2 * key.shape[1] * key.shape[3]).double()
            i = index[id(module)]
            moments[i] = moments.get(i, 0) + x.T @ x  # (2C, 2C)
            return key, value

        extra = {"use_cache": False} if architecture_of(model).causal else {}
        with routed_through_plugin(model), KVTransform(accumulate):
            for batch in batches:
                model(**batch, **extra)
        bases = []
        for i in range(len(index)):
            eigenvalues, vectors = torch.linalg.eigh(moments[i])  # ascending
            bases.append(vectors.flip(-1).float())
        return cls(model, bases)

    def with_rank(self, rank: int) -> JointLowRank:
        """The same bases, keeping ``rank`` of the ``2C`` directions."""
        if not 1 <= rank <= self.bases[0].shape[0]:
            raise ValueError(f"rank must be in 1..{self.bases[0].shape[0]}, got {rank}.")
        codec = JointLowRank.__new__(JointLowRank)
        codec._index, codec.bases, codec.rank = self._index, self.bases, rank
        return codec

    def __call__(self, module, key, value):
        if self.rank is None:
            raise ValueError("Choose a rank first: codec.with_rank(r).")
        h, c = key.shape[1], key.shape[1] * key.shape[3]
        basis = self.bases[self._index[id(module)]][:, : self.rank].to(key.device)  # (2C, r)
        x = torch.cat([_tokens(key), _tokens(value)], dim=-1).float()  # (B, N, 2C)
        x = (x @ basis) @ basis.T
        return _heads(x[..., :c], h).to(key.dtype), _heads(x[..., c:], h).to(value.dtype)
