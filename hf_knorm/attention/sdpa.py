"""PyTorch's SDPA (``torch.nn.functional.scaled_dot_product_attention``) for every family that is a softmax over
modified logits (its :attr:`~hf_knorm.normalizations.Normalization.softmax_logits`, :class:`SoftmaxLogits`: softmax
itself, SSMax, softmax with a sink). Exact: the same weights as the chunked kernel (:mod:`.kernel`), outputs and
gradients (the learnable values' included, through autograd).

- **No modification** (softmax): SDPA as it is.
- **A row factor** ``softmax_j(s_h log(n_i) s_ij)`` (SSMax): each query row is multiplied by its own
  ``s_h log n_i`` (``n_i`` the keys row ``i`` may attend: ``i + 1`` under the implicit causal mask, the allowed keys of
  a padded or cached row), and an additive bias by the same factor.
- **A sink** ``e^s / (e^sigma_h + sum e^s)``: the sink is one more key, first, of value 0, that every
  row may attend. Its logit rides on one more head dimension: the queries get ``sigma_h / scale`` there (``scale``
  SDPA's: the scaling, or 1 after SSMax's factor), the keys 0, and the sink's key 1 (its other dimensions 0), so its
  score is ``sigma_h``; in bf16/fp16 on two dimensions, a high and a low part (:class:`SdpaCall`). Values get zero
  dimensions too: SDPA's CPU flash kernel takes equal head dimensions only (a query/key dimension of 65 against
  values of 64 runs its math fallback, 10x slower), and so does its CUDA flash kernel. Under the implicit
  causal mask a dummy query row goes first, so that SDPA's top-left ``is_causal`` gives row ``i`` the sink and keys
  ``0 .. i`` without a mask.

Masks: no mask, or the implicit causal one (``allowed`` ``None`` with ``causal``: top-left, keys cut to the queries,
the kernel's convention) run SDPA's ``is_causal``, with no ``N x N`` tensor: on the CPU its flash kernel, memory
linear in ``N``, which skips the blocks above the diagonal. An explicit bool mask (padding, a cache with more keys
than queries, where SDPA's top-left ``is_causal`` would be wrong) is passed as ``attn_mask``: the ``(B, 1, q, kv)``
mask :meth:`.masks.KeyPadding.dense` builds for the chunked kernel as well (``B * q * kv`` bytes). The CPU flash kernel
then computes every block (about twice the time of ``is_causal`` at 4,096 tokens), and first turns the bool mask
into an additive float mask, 4 bytes per entry (measured: 76 MiB over the inputs at 4,096 tokens against 12 MiB with
``is_causal``); so a large mask goes to SDPA in blocks of query rows (:data:`MASK_BLOCK_ELEMENTS`). An additive
float bias becomes a float mask (``-inf`` on masked pairs) of the same shape; for SSMax with a learned scale it is
scaled per query head, so ``(B, H_q, q, kv)``. A row with no key to attend gets 0 (the plugin's convention, not
softmax's 0/0): such rows are opened to every key for SDPA and their output zeroed, so no NaN reaches the backward
pass.

Not this path (:func:`sdpa_blocker`; the chunked kernel computes those calls): a softcap, attention dropout, returned
weights, recorded norms, code traced by ``torch.compile`` (the custom op of :mod:`.compiled` runs the chunked
kernel), and a softmax window's parts (:mod:`.window`).

Precision (:func:`sdpa_call`, a pure function of the device type, the dtype, the family's form and the mask's form):
on CUDA, bf16 and fp16 inputs go to SDPA as they are (its flash kernel multiplies bf16/fp16 operands and accumulates
in fp32; under ``is_causal`` with no mask it is the kernel SDPA picks), so the plugin's softmax is SDPA flash itself
and its error SDPA flash's own. SSMax's queries are multiplied by their row factor in fp32 and rounded once to the
inputs' dtype (one more rounding of each query element, relative ``2^-9`` in bf16); a sink's logit is split into a
bf16/fp16 pair (high and low part, on two of the extra head dimensions, padded to a multiple of 8 for the fused
kernels' alignment), so its score is exact to about ``2^-16`` relative. ``make device-check`` measures the error
against fp64 beside SDPA flash's own (issue 64's bound: at most 2x). Everywhere else (the CPU, fp32 and fp64 inputs)
the computation is in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype and autocast, as the chunked kernel's:
the CPU's exactness promise. Either way the learnable values' gradients come through autograd in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .full_precision import full_precision
from .kernel import _raw_params
from ..normalizations import Normalization
from ..normalizations.base import Parameters
from ..normalizations.routes import SoftmaxLogits

MASK_BLOCK_ELEMENTS = 1 << 22
"""Mask entries per SDPA call (read at call time). SDPA's CPU kernel turns a bool mask into an additive float one, 4
bytes per entry (64 MiB for 4,096 x 4,096): an explicit mask larger than this goes to SDPA in blocks of query rows
(each row is its own softmax), so that the float form exists for one block at a time (16 MiB)."""

MASK_FORMS = ("none", "causal", "explicit")
"""How a call's mask reaches SDPA: none (every key: a bidirectional call, one decoded row), the implicit top-left
causal mask (SDPA's ``is_causal``: no mask tensor, its flash kernel), or an explicit bool mask or additive bias
(``attn_mask``: SDPA's efficient or math kernel on CUDA, its flash kernel on the CPU)."""
LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Input dtypes SDPA computes in as they are on CUDA (:func:`sdpa_call`)."""
_ALIGNMENT = 8
"""Head dimensions SDPA's fused CUDA kernels take without padding them: multiples of 8."""

_ENABLE_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""SDPA groups the query heads itself from torch 2.5 on; before, K and V are repeated."""


@dataclass(frozen=True)
class SdpaCall:
    """How :func:`sdpa_attention` calls SDPA (:func:`sdpa_call`).

    Attributes:
        dtype: the operands' dtype (query, key, value and a float mask).
        is_causal: SDPA's own top-left causal mask, no mask tensor.
        sink_width: the extra head dimensions that carry a sink's logit (0: no sink). 1 in fp32/fp64 (the logit in
            the operands' precision); in bf16/fp16 at least 2 (its high and low part), up to a multiple of 8 of the
            head dimension plus it (the fused kernels' alignment; zeros past the two parts).
    """

    dtype: torch.dtype
    is_causal: bool
    sink_width: int


def sdpa_call(device_type: str, dtype: torch.dtype, form: SoftmaxLogits, mask_form: str, head_dim: int) -> SdpaCall:
    """How SDPA computes a call: a pure function of where and what (the tests call it with a stub device type).

    Args:
        device_type: the inputs' device type (``"cuda"``, ``"cpu"``, ...).
        dtype: the inputs' dtype.
        form: the family's :class:`SoftmaxLogits`.
        mask_form: one of :data:`MASK_FORMS`.
        head_dim: the query/key head dimension ``D``.

    Returns:
        On CUDA with bf16/fp16 inputs, operands in that dtype (SDPA's flash kernel: bf16/fp16 products, fp32
        accumulation); otherwise fp32 (fp64 for fp64 inputs), the chunked kernel's precision. ``is_causal`` for the
        implicit causal mask; the sink's extra width (see :class:`SdpaCall`).

    Raises:
        ValueError: an unknown mask form.
    """
    if mask_form not in MASK_FORMS:
        raise ValueError(f"SDPA's mask form is one of {', '.join(MASK_FORMS)}, not {mask_form!r}.")
    low = device_type == "cuda" and dtype in LOW_PRECISION
    operands = dtype if low else torch.promote_types(dtype, torch.float32)
    width = 0
    if form.sink is not None:
        width = (-(head_dim + 2)) % _ALIGNMENT + 2 if low else 1
    return SdpaCall(operands, mask_form == "causal", width)


def computes(normalization: Normalization) -> bool:
    """Whether SDPA computes ``normalization``: a softmax over modified logits (without a softmax window:
    :mod:`.window` composes its parts)."""
    return normalization.softmax_logits is not None and not normalization.window


def sdpa_blocker(normalization: Normalization, *, softcap: float | None, dropout: float, return_weights: bool,
                 recording: bool, compiling: bool) -> str:
    """Why SDPA cannot compute a call (``""`` when it can)."""
    if not computes(normalization):
        return f"{normalization.name} is not a softmax over modified logits"
    if softcap is not None:
        return "a softcap on the scores (SDPA has none)"
    if dropout > 0.0:
        return "attention dropout (the chunked kernel drops the normalized weights)"
    if return_weights:
        return "the attention weights were requested"
    if recording:
        return "the attention norms are recorded, which only the chunked kernel accumulates"
    if compiling:
        return "the call is traced by torch.compile (the custom op runs the chunked kernel: compiled.py)"
    return ""


@full_precision
def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    *,
    bias: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
    params: Parameters | None = None,
) -> torch.Tensor:
    """Attention with a softmax over modified logits (softmax, SSMax, a sink softmax) through SDPA.

    Args:
        query ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``H_q % H_kv == 0``.
        allowed: bool ``(B or 1, 1 or H_q, q, kv)`` (True = may attend), or ``None``: no mask, or with ``causal``
            (and ``q > 1``) a top-left causal mask with the keys cut to ``q``, as :func:`.kernel.chunked_attention`
            has it.
        normalization: a family with :attr:`~hf_knorm.normalizations.Normalization.softmax_logits`, without a window.
        bias: an additive float mask of ``allowed``'s shape, or ``None``.
        scaling: the score scale (default ``D ** -0.5``).
        params: the family's learnable values, ``(H_q,)`` each (SSMax's ``scale``, the sink's ``sink``).

    Returns:
        ``(B, q, H_q, D_v)`` in the query's dtype: computed by SDPA in bf16/fp16 for such inputs on CUDA, in fp32
        (fp64 for fp64 inputs) otherwise (:func:`sdpa_call`).

    Raises:
        ValueError: a family SDPA does not compute, head counts that do not group, a learnable value missing.
    """
    if not computes(normalization):
        raise ValueError(f"SDPA computes a softmax over modified logits without a window, not {normalization.name}.")
    form = normalization.softmax_logits
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    raw = _raw_params(normalization, params, query)  # (H_q,) each, in fp32 (fp64 for fp64 inputs)
    accumulate = torch.promote_types(query.dtype, torch.float32)  # the row factor, the sink's logit
    is_causal = allowed is None and causal and q_len > 1
    mask_form = "causal" if is_causal else "explicit" if allowed is not None or bias is not None else "none"
    call = sdpa_call(_device_type(query), query.dtype, form, mask_form, dim)
    compute = call.dtype
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    scaling = dim**-0.5 if scaling is None else float(scaling)
    if is_causal:  # top-left, keys cut to the queries (the kernel's convention)
        kv_len = min(kv_len, q_len)
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
    empty = None  # (B, 1 or H_q, q, 1): rows with no key, answered by 0
    if allowed is not None:
        allowed = allowed[..., :kv_len]
        bias = None if bias is None else bias[..., :kv_len]
        has_key = allowed.any(dim=-1, keepdim=True)
        if not bool(has_key.all()):
            empty = ~has_key
    scale = scaling
    if form.log_n_scale is not None:  # the factor and the product in fp32, rounded once to the operands' dtype
        factor = _row_factor(form, raw, allowed, is_causal, q_len, kv_len, accumulate, q.device)
        q = (query.to(accumulate) * (factor * scaling)).to(compute)
        bias = None if bias is None else bias.to(accumulate) * factor
        scale = 1.0
    if empty is not None:
        allowed = allowed | empty  # opened for SDPA (no 0/0), zeroed below
    mask = allowed
    if bias is not None:
        mask = bias.to(compute) if allowed is None else bias.to(compute).masked_fill(~allowed, float("-inf"))
    head_dim = v.shape[-1]
    if form.sink is not None:
        q, k, v, mask = _with_sink(form, raw, q, k, v, mask, scale, call, accumulate)
    output = _sdpa(q, k, v, mask, is_causal, scale, q_heads // kv_heads)
    if form.sink is not None:
        output = output[:, :, 1:] if is_causal else output
        output = output[..., :head_dim]
    if empty is not None:
        output = output.masked_fill(empty, 0.0)
    return output.transpose(1, 2).to(query.dtype)


def _device_type(tensor: torch.Tensor) -> str:
    """Where ``tensor`` is (a seam: the tests run the CUDA precision on CPU tensors)."""
    return tensor.device.type


def _row_factor(form: SoftmaxLogits, raw, allowed, is_causal: bool, q_len: int, kv_len: int, dtype,
                  device) -> torch.Tensor:
    """``s_h log n_i``, ``(B or 1, H_q or 1, q, 1)``: ``n_i`` the keys row ``i`` may attend (at least 1)."""
    if allowed is not None:
        counts = allowed.sum(dim=-1, keepdim=True, dtype=dtype).clamp_min(1.0)
    elif is_causal:
        counts = torch.arange(1, q_len + 1, device=device, dtype=dtype).clamp_max(kv_len)[None, None, :, None]
    else:
        counts = torch.full((1, 1, q_len, 1), float(kv_len), device=device, dtype=dtype)
    scale = form.head_scale(raw)
    return counts.log() * (scale[:, None, None] if isinstance(scale, torch.Tensor) else scale)


def _with_sink(form: SoftmaxLogits, raw, q, k, v, mask, scale: float, call: SdpaCall, accumulate: torch.dtype):
    """Queries, keys, values and mask with the sink (see the module docstring): one more key first, of value 0, whose
    score ``scale * (q_extra . k_extra)`` is ``sigma_h``: the queries carry ``sigma_h / scale`` on the extra head
    dimensions (in bf16/fp16 as a high and a low part, each against a 1 of the sink's key), every other key 0 there.
    One copy of each tensor."""
    batch, q_heads, q_len, dim = q.shape
    width = call.sink_width
    sink = form.sink_logits(raw, q_heads, q.new_empty((), dtype=accumulate)) / scale  # (H_q,)
    parts = [sink.to(q.dtype)]
    if width > 1:
        parts.append((sink - parts[0].to(accumulate)).to(q.dtype))  # what the high part's rounding left
    extra = F.pad(torch.stack(parts, dim=-1), (0, width - len(parts)))  # (H_q, width)
    q = torch.cat([q, extra[:, None, :].expand(batch, q_heads, q_len, width)], dim=-1)
    # under is_causal a dummy query row first: top-left causal then gives row i the sink and keys 0 .. i
    q = F.pad(q, (0, 0, int(call.is_causal), 0))
    k = F.pad(k, (0, width, 1, 0))  # zeros on the extra dimensions, and the sink's key first
    k[:, :, 0, dim:dim + len(parts)] = 1.0
    v = F.pad(v, (0, width if v.shape[-1] == dim else 0, 1, 0))  # the sink's value 0; head dims equal (flash)
    if not call.is_causal and mask is not None:  # the sink's column: always attended, score sigma_h (bias 0)
        column = (mask.new_ones if mask.dtype == torch.bool else mask.new_zeros)((*mask.shape[:-1], 1))
        mask = torch.cat([column, mask], dim=-1)
    return q, k, v, mask


def _sdpa(q, k, v, mask, is_causal: bool, scale: float, groups: int) -> torch.Tensor:
    """SDPA, over blocks of query rows when an explicit mask is large (:data:`MASK_BLOCK_ELEMENTS`)."""
    if groups > 1 and not _ENABLE_GQA:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    options = dict(enable_gqa=True) if groups > 1 and _ENABLE_GQA else {}
    rows = q.shape[-2] if mask is None or mask.shape[-2] == 1 else \
        max(1, MASK_BLOCK_ELEMENTS // max(1, mask[..., 0, :].numel()))
    if rows >= q.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **options)
    return torch.cat([F.scaled_dot_product_attention(q[..., start:start + rows, :], k, v,
                                                     attn_mask=mask[..., start:start + rows, :], scale=scale,
                                                     **options)
                      for start in range(0, q.shape[-2], rows)], dim=-2)
