"""The plugin's attention function: any :class:`~hf_knorm.normalizations.Normalization`, memory linear in N.

Registered with Transformers' ``AttentionInterface`` under the name ``"hf_knorm"`` (see ``patching.py``); each model
reads its normalization from its own config (``config.hf_knorm["normalization"]``), so two models in one process can
use different normalizations.

Memory: the B x H x N x N score tensor is never materialized. Queries are processed in row chunks of at most
``DEFAULT_CHUNK_ELEMENTS`` scores; in training each chunk is recomputed in the backward pass
(``torch.utils.checkpoint``), so neither pass keeps more than one chunk of scores alive. Keys a chunk cannot attend
(beyond the causal diagonal, outside a sliding window) are skipped. GQA is handled by grouping query heads over their
key-value head, never by repeating K and V. A plain reference lives in ``attention_reference.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .normalizations import Normalization, parse_normalization
try:  # Transformers' record of the outputs being captured (5.x); absent, only the kwarg is read
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover
    _active_collector = None

from .kv_transform import current_kv_transform
from .norm_statistics import current_recorder

ATTENTION_NAME = "hf_knorm"
DEFAULT_CHUNK_ELEMENTS = 1 << 20  # scores per chunk: 4 MiB in fp32 (larger chunks measured slower on CPU)


def hf_knorm_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``AttentionInterface`` entry point.

    Args:
        module: the calling attention module (reads ``module.config.hf_knorm``, ``is_causal``, ``training``).
        query: ``(B, H_q, q, D)``.
        key, value: ``(B, H_kv, kv, D)``, rotated and concatenated with the cache, not repeated for GQA.
        attention_mask: bool ``(B or 1, 1, q, kv)`` (True = attend) from the mask function registered with it,
            an additive float mask of that shape, or ``None``.
        scaling: score scale (default ``D ** -0.5``).
        dropout: attention dropout probability, applied to the weights when ``module.training``.
        **kwargs: ``softcap`` (Gemma2), ``output_attentions``, ``is_causal``; others are ignored.

    Returns:
        ``(output (B, q, H_q, D), weights (B, H_q, q, kv) or None)``; weights only with ``output_attentions=True``.
    """
    normalization = normalization_of(module)
    transform = current_kv_transform()
    if transform is not None:
        key, value = transform(module, key, value)
    recorder = current_recorder()
    frobenius_sq = None
    if recorder is not None:
        frobenius_sq = query.new_zeros(query.shape[0], key.shape[1], query.shape[1] // key.shape[1], dtype=torch.float32)
    output, weights = chunked_attention(
        query,
        key,
        value,
        attention_mask,
        normalization,
        scaling=scaling,
        softcap=kwargs.get("softcap"),
        dropout=dropout if module.training else 0.0,
        causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", False))),
        return_weights=_attentions_requested(kwargs),
        frobenius_sq=frobenius_sq,
    )
    if recorder is not None:
        recorder.record(module, key, value, attention_mask, frobenius_sq.reshape(query.shape[0], query.shape[1]))
    return output, weights


def _attentions_requested(kwargs: dict) -> bool:
    """Whether the caller records attention weights (``output_attentions=True``).

    Some families (GPT-2) consume ``output_attentions`` before calling the attention function; Transformers'
    output-capturing context then tells whether attentions are being collected.
    """
    if kwargs.get("output_attentions"):
        return True
    collected = _active_collector.get() if _active_collector is not None else None
    return collected is not None and "attentions" in collected


def normalization_of(module: torch.nn.Module) -> Normalization:
    """The normalization a patched model's config selects for ``module``."""
    section = getattr(module.config, "hf_knorm", None) or {}
    spelling = section.get("normalization")
    if spelling is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation='{ATTENTION_NAME}' but its config has no hf_knorm "
            "normalization. Call hf_knorm.patch(model, normalization=...) or load the model with hf_knorm.from_pretrained."
        )
    # A model loaded with plain from_pretrained lacks the serialized marker that patch() sets: restore it, so that
    # saving this model again can never produce a checkpoint that loads silently as softmax.
    module.config.__dict__.setdefault("attn_implementation", ATTENTION_NAME)
    return parse_normalization(spelling)


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    normalization: Normalization,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    causal: bool = False,
    return_weights: bool = False,
    frobenius_sq: torch.Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with ``normalization``, processed in query-row chunks.

    Args:
        query: ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``H_q % H_kv == 0``.
        attention_mask: see :func:`hf_knorm_attention`. With ``None`` and ``causal`` (and q > 1) the mask is causal
            and aligned top-left with keys cut to q, as in Transformers' sdpa path.
        normalization: what turns scores into weights.
        scaling: score scale (default ``D ** -0.5``); softcap: ``tanh`` capping of the scores (Gemma2).
        dropout: dropout probability on the weights (0 outside training).
        return_weights: also return the ``(B, H_q, q, kv)`` weights (materializes them).
        frobenius_sq: optional ``(B, H_kv, G)`` fp32 accumulator; receives the squared Frobenius norm of each
            head's weight matrix (no gradient), without materializing the matrix.
        chunk_elements: at most this many scores per chunk.

    Returns:
        ``(output (B, q, H_q, D_v) in the query dtype, weights in fp32 (fp64 for fp64 inputs) or None)``.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    groups = q_heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling

    allowed, bias = _split_mask(attention_mask)
    if allowed is None and causal and q_len > 1:
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], min(kv_len, q_len)
    allowed, bias = _grouped(allowed, kv_heads, groups, kv_len), _grouped(bias, kv_heads, groups, kv_len)

    # fp32 (fp64 for fp64 inputs) throughout: q/k/v are linear in N, so upcast copies are cheap next to the scores.
    compute = torch.promote_types(query.dtype, torch.float32)
    q = (query.to(compute) * scaling).reshape(batch, kv_heads, groups, q_len, head_dim)  # (B, H_kv, G, q, D), scaled
    k, v = key.to(compute), value.to(compute)
    rows = max(1, chunk_elements // max(1, batch * q_heads * kv_len))
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # Inference writes each chunk into the final (B, q, H_kv, G, D_v) layout; autograd needs a cat instead.
    output = None if differentiable else query.new_empty(batch, q_len, kv_heads, groups, v.shape[-1])
    outputs, weight_chunks = [], []
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        chunk_allowed = _chunk_mask(allowed, start, stop, causal and allowed is None and q_len > 1, kv_len, q.device)
        chunk_bias = None if bias is None else bias[..., start:stop, :]
        lo, hi = (0, kv_len) if return_weights else _attended_key_range(chunk_allowed, kv_len)
        if lo >= hi:  # no query of the chunk may attend anything (e.g. all padding)
            out = q.new_zeros(batch, kv_heads, groups, stop - start, v.shape[-1])
            weights = q.new_zeros(batch, kv_heads, groups, stop - start, kv_len)
        else:
            args = (
                q[:, :, :, start:stop],
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                None if chunk_allowed is None else chunk_allowed[..., lo:hi],
                None if chunk_bias is None else chunk_bias[..., lo:hi],
            )
            options = dict(normalization=normalization, softcap=softcap, dropout=dropout, inplace=not differentiable)
            if differentiable and not return_weights:  # recompute the chunk in backward instead of storing it
                out, weights = checkpoint(_chunk, *args, **options, use_reentrant=False)
            else:
                out, weights = _chunk(*args, **options)
        if return_weights:
            weight_chunks.append(weights)
        if frobenius_sq is not None:
            frobenius_sq += weights.detach().square().sum(dim=(-2, -1))
        if output is None:
            outputs.append(out.permute(0, 3, 1, 2, 4))  # (B, c, H_kv, G, D_v)
        else:
            output[:, start:stop] = out.permute(0, 3, 1, 2, 4)

    output = output if output is not None else torch.cat(outputs, dim=1).to(query.dtype)
    output = output.reshape(batch, q_len, q_heads, -1)  # (B, q, H_q, D_v): query head h = kv head h // G
    weights = torch.cat(weight_chunks, dim=3).reshape(batch, q_heads, q_len, kv_len) if return_weights else None
    return output, weights


def _chunk(q, k, v, allowed, bias, *, normalization, softcap, dropout, inplace):
    """One chunk of query rows.

    Shapes: q ``(B, H_kv, G, c, D)`` already scaled, k ``(B, H_kv, n, D)``, v ``(B, H_kv, n, D_v)``, allowed/bias
    ``(B or 1, H_kv or 1, G or 1, c, n)``. Returns output ``(B, H_kv, G, c, D_v)`` and weights ``(B, H_kv, G, c, n)``.
    ``inplace`` (inference only) lets the normalization overwrite the scores.
    """
    batch, kv_heads, groups, rows, dim = q.shape
    scores = q.reshape(batch, kv_heads, groups * rows, dim) @ k.transpose(-1, -2)  # (B, H_kv, G * c, n)
    scores = scores.view(batch, kv_heads, groups, rows, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    weights = normalization.weights(scores, allowed, inplace=inplace)
    if dropout > 0.0:
        weights = F.dropout(weights, p=dropout, training=True)
    output = weights.view(batch, kv_heads, groups * rows, -1) @ v  # (B, H_kv, G * c, D_v)
    return output.view(batch, kv_heads, groups, rows, -1), weights


def _grouped(mask: torch.Tensor | None, kv_heads: int, groups: int, kv_len: int) -> torch.Tensor | None:
    """``(B, 1 or H_q, q, >=kv)`` -> ``(B, 1 or H_kv, 1 or G, q, kv)``, so one mask serves each group of query heads."""
    if mask is None:
        return None
    mask = mask[..., :kv_len]
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])


def _split_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (bool allowed mask, additive float bias or None) from a bool or additive float mask."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    allowed = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(allowed, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)).float()  # (.., q, kv)
    return allowed, (bias if bool(bias.any()) else None)


def _chunk_mask(allowed, start, stop, causal, kv_len, device):
    """The bool mask of query rows ``start:stop``; built on the fly for an implicit top-left causal mask."""
    if allowed is not None:
        return allowed[..., start:stop, :]
    if not causal:
        return None
    rows = torch.arange(start, stop, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None, None]  # (1, 1, 1, c, kv)


def _attended_key_range(allowed: torch.Tensor | None, kv_len: int) -> tuple[int, int]:
    """The smallest key range ``[lo, hi)`` that holds every key some row of the chunk may attend."""
    if allowed is None:
        return 0, kv_len
    columns = allowed.reshape(-1, allowed.shape[-1]).any(dim=0).nonzero()
    if columns.numel() == 0:
        return 0, 0
    return int(columns[0]), int(columns[-1]) + 1
