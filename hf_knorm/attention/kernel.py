"""The attention kernel: any normalization, query-row chunks, memory linear in N in the forward and backward pass.

The B x H x N x N scores are never materialized. Queries are processed in row chunks of at most ``chunk_elements``
scores (every chunk holds whole rows, so softmax needs no running statistics; the default depends on the device:
:func:`default_chunk_elements`), and keys a chunk cannot attend (beyond the causal diagonal, outside a sliding window,
padding) are skipped. GQA groups the query heads of each KV head instead of repeating K and V.

No host synchronization per chunk: the key range of every chunk comes from the shapes (no mask, or the implicit
causal mask) or, with an explicit mask, from one pass over it for all chunks at once (``blocks.py``), read to the host
once per call. On CUDA, ``backends.py`` runs the polynomial normalizations on the Triton kernel instead.

Training uses :class:`_ChunkedAttention`, a hand-written backward in the FlashAttention style: each chunk's scores
are recomputed and dQ, dK, dV are accumulated chunk by chunk into preallocated buffers. With attention dropout, or
when differentiable weights are requested, autograd runs over the chunks instead (recomputed with
``torch.utils.checkpoint``). ``reference.py`` holds the plain formulation all of this is tested against.

Every family of :mod:`hf_knorm.normalizations` runs here: a chunk holds whole rows, so a family that normalizes
rows (softmax, softpick, SSMax) or reads its row in order (stick-breaking) computes its weights from the chunk alone,
with no running statistics. A family's learnable values (``params``: one per query head, the module's
``nn.Parameter``s) get their gradients from the same backward.

Gradients, with ``s`` the (softcapped) score, ``w = phi(s)`` and ``dW = dO V^T``:
    element-wise ``phi(s) = g(s) r(n)``: ``dS = dW * g'(s) r(n)`` on allowed pairs, 0 elsewhere (the family's
                                      :attr:`~hf_knorm.normalizations.Normalization.pointwise` derivative);
    softmax:                          ``dS = w * (dW - rowsum(dO * O))``;
    any other family:                 ``dS`` (and the parameters' gradients): the vector-Jacobian product of
                                      the chunk's recomputed weights (:func:`_family_backward`);
    softcap ``s = cap * tanh(r / cap)``: ``dR = dS * (1 - tanh^2)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .blocks import chunk_key_ranges
from .full_precision import autocast_off, full_precision
from ..normalizations import Normalization
from ..normalizations.base import Parameters

DEFAULT_CHUNK_ELEMENTS = 1 << 21  # scores per chunk on the CPU: 8 MiB in fp32; smaller chunks make small, slow matmuls
DEVICE_CHUNK_ELEMENTS = {"cuda": 1 << 25}
"""Scores per chunk on an accelerator: 128 MiB in fp32 (the backward holds ~5 such tensors). A GPU wants few, large
matmuls: at 32k keys and 9 heads, 2^21 scores are 7 query rows (~4,700 chunks a pass), 2^25 are 113. Not tuned on a
GPU yet (docs/results/attention.md, "Attention on a GPU")."""


def default_chunk_elements(device: torch.device) -> int:
    """Scores per chunk on ``device``: :data:`DEVICE_CHUNK_ELEMENTS`, else :data:`DEFAULT_CHUNK_ELEMENTS` (both read
    at call time)."""
    return DEVICE_CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS)


@dataclass
class _Plan:
    """What every chunk shares. Masks are 5-D: ``(B or 1, H_kv or 1, G or 1, q, kv)``."""

    allowed: torch.Tensor | None
    bias: torch.Tensor | None
    normalization: Normalization
    scaling: float
    softcap: float | None
    implicit_causal: bool
    trim_keys: bool
    rows: int
    q_len: int
    kv_len: int
    params: dict[str, torch.Tensor]  # the family's learnable values, (H_kv, G, 1, 1) each, in the compute dtype
    _layout: list | None = field(default=None, repr=False)

    def chunks(self, device):
        """Yield ``(start, stop, allowed, bias, lo, hi)`` per row chunk; masks cut to the attended keys ``lo:hi``."""
        for start, stop, lo, hi in self.layout():
            if self.allowed is not None:
                allowed = self.allowed[..., start:stop, lo:hi]
            elif self.implicit_causal:  # top-left causal, built per chunk
                allowed = (torch.arange(lo, hi, device=device) <= torch.arange(start, stop, device=device)[:, None])
                allowed = allowed[None, None, None]
            else:
                allowed = None
            bias = None if self.bias is None else self.bias[..., start:stop, lo:hi]
            yield start, stop, allowed, bias, lo, hi

    def layout(self) -> list[tuple[int, int, int, int]]:
        """``(start, stop, lo, hi)`` of every chunk: its rows and the keys it attends (computed once per call)."""
        if self._layout is None:
            bounds = self._bounds()
            ranges = self._key_ranges(bounds)
            self._layout = [(start, stop, *(ranges[index] if ranges is not None else (0, self.kv_len)))
                            for index, (start, stop) in enumerate(bounds)]
        return self._layout

    def most_scores(self) -> int:
        """The most scores per query head (and batch item) of any chunk: ``rows x keys``."""
        return max((stop - start) * (hi - lo) for start, stop, lo, hi in self.layout())

    def _bounds(self) -> list[tuple[int, int]]:
        """Each chunk's rows ``[start, stop)``, ``rows`` each. (Under the implicit causal mask, more rows for the first
        chunks, which attend few keys, so that each holds ``rows x kv`` scores, measured slower at 4,096 tokens on
        the CPU: 1.31x SDPA's time against 1.13x for x^3/16, in the same run.)"""
        return [(start, min(self.q_len, start + self.rows)) for start in range(0, self.q_len, self.rows)]

    def _key_ranges(self, bounds) -> list[list[int]] | None:
        """Each chunk's attended keys ``[lo, hi)`` (``None``: all keys for every chunk). Implicit causal: from the
        shapes; an explicit mask: one pass over it and one read to the host for the whole call."""
        if not self.trim_keys or (self.allowed is None and not self.implicit_causal):
            return None
        if self.allowed is None:  # top-left causal: row r attends keys 0..r
            return [[0, min(self.kv_len, stop)] for _, stop in bounds]
        return chunk_key_ranges(self.allowed, self.rows).tolist()


@full_precision
def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    *,
    bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    causal: bool = False,
    return_weights: bool = False,
    frobenius_sq: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    trim_keys: bool = True,
    params: Parameters | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with ``normalization``, processed in query-row chunks.

    Args:
        query: ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``H_q % H_kv == 0``.
        allowed: bool ``(B or 1, 1 or H_q, q, kv)``, True = may attend; ``None`` = no mask, or with ``causal`` (and
            q > 1) a top-left causal mask with keys cut to q, as in Transformers' sdpa path.
        normalization: what turns scores into weights.
        bias: optional additive float scores of the mask's shape (from an additive attention mask).
        scaling: score scale (default ``D ** -0.5``); softcap: ``tanh`` capping of the scores (Gemma2).
        dropout: dropout probability on the weights (0 outside training).
        return_weights: also return the ``(B, H_q, q, kv)`` weights (materializes them).
        frobenius_sq: optional ``(B, H_kv, G)`` accumulator; receives the squared Frobenius norm of each head's
            weight matrix (before dropout; no gradient), without materializing the matrix.
        chunk_elements: at most this many scores per chunk (default: :func:`default_chunk_elements` of the query's
            device, read at call time).
        trim_keys: skip the keys no row of a chunk may attend (beyond the causal diagonal, outside a sliding window).
            Finding them reads the mask's values: ``False`` where compiled code traces the kernel (``interface.py``;
            no graph break, the same result).
        params: the family's learnable values by name, ``(H_q,)`` each (:meth:`Normalization.learnable`), or
            ``None`` for a family without any; they get gradients like the query, key and value.

    Returns:
        ``(output (B, q, H_q, D_v) in the query dtype, weights or None)``; computed in fp32 (fp64 for fp64 inputs),
        under autocast too, forward and backward (:mod:`.full_precision`).
    """
    _refuse_window(normalization)
    raw = _raw_params(normalization, params, query)
    plan, q, k, v = _prepare(query, key, value, allowed, normalization, bias, scaling, softcap, causal,
                             chunk_elements, trim_keys, raw)
    batch, q_heads, q_len = query.shape[:3]
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *raw.values()))
    weights = None
    if not differentiable:
        output, weights = _forward(q, k, v, plan, query.dtype, return_weights, frobenius_sq)
    elif dropout == 0.0 and not return_weights:
        output = _ChunkedAttention.apply(q, k, v, plan, frobenius_sq, *raw.values())
    else:
        output, weights = _forward_autograd(q, k, v, plan, dropout, return_weights, frobenius_sq)
    output = output.reshape(batch, q_len, q_heads, -1).to(query.dtype)  # query head h reads kv head h // G
    if weights is not None:
        weights = weights.reshape(batch, q_heads, q_len, plan.kv_len)
    return output, weights


@full_precision
def chunked_forward(query, key, value, allowed, normalization, *, bias=None, scaling=None, softcap=None,
                    causal=False, params=None) -> torch.Tensor:
    """The inference forward of :func:`chunked_attention` (same arguments), output ``(B, q, H_q, D_v)`` in the
    compute dtype (fp32, fp64 for fp64 inputs): what :func:`chunked_backward` takes."""
    raw = _raw_params(normalization, params, query)
    plan, q, k, v = _prepare(query, key, value, allowed, normalization, bias, scaling, softcap, causal, raw=raw)
    output, _ = _forward(q, k, v, plan, q.dtype)
    batch, q_heads, q_len = query.shape[:3]
    return output.reshape(batch, q_len, q_heads, -1)


@full_precision
def chunked_backward(grad_output, query, key, value, output, allowed, normalization, *, bias=None, scaling=None,
                     softcap=None, causal=False, params=None) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`chunked_forward` with respect to ``query``, ``key``, ``value`` (in their dtypes) and then
    each of ``params`` (``(H_q,)``, in the order given), given its ``output`` and ``grad_output``
    ``(B, q, H_q, D_v)``: the same computation as the training path's backward."""
    raw = _raw_params(normalization, params, query)
    plan, q, k, v = _prepare(query, key, value, allowed, normalization, bias, scaling, softcap, causal, raw=raw)
    batch, kv_heads, groups, q_len, _ = q.shape
    as_groups = lambda t: t.to(q.dtype).reshape(batch, q_len, kv_heads, groups, -1)  # noqa: E731
    dq, dk, dv, dparams = _backward(q, k, v, as_groups(output), as_groups(grad_output), plan)
    pad = (0, 0, 0, key.shape[2] - plan.kv_len)  # keys an implicit causal mask cut get no gradient
    grads = (dq.reshape(query.shape).to(query.dtype), F.pad(dk, pad).to(key.dtype), F.pad(dv, pad).to(value.dtype))
    return grads + tuple(dparams[name].reshape(-1).to(raw[name].dtype) for name in raw)


def _refuse_window(normalization: Normalization) -> None:
    if normalization.window:
        raise ValueError(f"The chunked kernel computes one normalization over the mask; {normalization.name} needs its "
                         "softmax window: hf_knorm.attention.window.window_attention.")


def _raw_params(normalization: Normalization, params: Parameters | None, query: torch.Tensor) -> dict:
    """The family's learnable values, ``(H_q,)`` each in the compute dtype, in :meth:`Normalization.learnable`'s
    order.

    Raises:
        ValueError: one is missing or not one value per query head.
    """
    if normalization.window:
        raise ValueError(f"{normalization.name} weights keys by their position; compute it with "
                         "hf_knorm.attention.window.window_attention (the kernels take its two parts).")
    names = normalization.learnable()
    if not names:
        return {}
    compute = torch.promote_types(query.dtype, torch.float32)
    raw = {}
    for name in names:
        value = None if params is None else params.get(name)
        if value is None or tuple(value.shape) != (query.shape[1],):
            got = "nothing" if value is None else f"shape {tuple(value.shape)}"
            raise ValueError(f"{normalization.name} learns {name!r}, one value per query head ({query.shape[1]},); "
                             f"got {got}. A patched model's attention modules hold it (hf_knorm.patch).")
        raw[name] = value.to(compute)
    return raw


def _prepare(query, key, value, allowed, normalization, bias, scaling, softcap, causal, chunk_elements=None,
             trim_keys=True, raw=None):
    """The plan, and q ``(B, H_kv, G, q, D)``, k, v in the compute dtype (fp32, fp64 for fp64 inputs)."""
    _refuse_window(normalization)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    groups = q_heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    implicit_causal = allowed is None and causal and q_len > 1
    if implicit_causal:
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], min(kv_len, q_len)
    plan = _Plan(
        allowed=_grouped(allowed, kv_heads, groups, kv_len),
        bias=_grouped(bias, kv_heads, groups, kv_len),
        normalization=normalization,
        scaling=scaling,
        softcap=softcap,
        implicit_causal=implicit_causal,
        trim_keys=trim_keys,
        rows=max(1, (chunk_elements or default_chunk_elements(query.device)) // max(1, batch * q_heads * kv_len)),
        q_len=q_len,
        kv_len=kv_len,
        params={name: tensor.reshape(kv_heads, groups, 1, 1) for name, tensor in (raw or {}).items()},
    )
    # fp32 (fp64 for fp64 inputs): q/k/v are linear in N, so upcast copies are cheap next to the scores.
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.to(compute).reshape(batch, kv_heads, groups, q_len, head_dim)  # (B, H_kv, G, q, D): a view
    return plan, q, key.to(compute), value.to(compute)


def _forward(q, k, v, plan: _Plan, dtype, return_weights=False, frobenius_sq=None):
    """Inference: each chunk's scores written into one buffer reused by every chunk, normalized in place, and its
    output written into the ``(B, q, H_kv, G, D_v)`` output.

    One buffer, not a new tensor per chunk: a chunk's scores (8 MiB on the CPU) are larger than a core's cache, and a
    fresh allocation of that size is fresh pages, faulted in on every chunk."""
    batch, kv_heads, groups, _, dim = q.shape
    output = q.new_zeros(batch, plan.q_len, kv_heads, groups, v.shape[-1], dtype=dtype)
    weight_rows = []
    buffer = q.new_empty(batch * kv_heads * groups * plan.most_scores())
    for start, stop, allowed, bias, lo, hi in plan.chunks(q.device):
        rows = groups * (stop - start)
        shape = (batch, kv_heads, rows, hi - lo)
        scores = buffer[: batch * kv_heads * rows * (hi - lo)].view(shape)
        q_chunk = (q[:, :, :, start:stop] * plan.scaling).reshape(batch, kv_heads, rows, dim)
        torch.matmul(q_chunk, k[:, :, lo:hi].transpose(-1, -2), out=scores)
        scores = scores.view(batch, kv_heads, groups, stop - start, hi - lo)
        if plan.softcap is not None:
            scores.div_(plan.softcap).tanh_().mul_(plan.softcap)
        if bias is not None:
            scores.add_(bias)
        weights = plan.normalization.weights(scores, allowed, plan.params, inplace=True)
        output[:, start:stop] = _weighted_values(weights, v[:, :, lo:hi]).permute(0, 3, 1, 2, 4)
        _accumulate(frobenius_sq, weights)
        if return_weights:
            weight_rows.append(F.pad(weights, (lo, plan.kv_len - hi)))
    return output, (torch.cat(weight_rows, dim=3) if return_weights else None)


def _forward_autograd(q, k, v, plan: _Plan, dropout, return_weights, frobenius_sq):
    """Training with dropout or returned weights: autograd through the chunks (recomputed unless weights are kept)."""
    outputs, weight_rows = [], []
    for start, stop, allowed, bias, lo, hi in plan.chunks(q.device):
        args = (q[:, :, :, start:stop] * plan.scaling, k[:, :, lo:hi], v[:, :, lo:hi], allowed, bias)
        options = dict(normalization=plan.normalization, softcap=plan.softcap, dropout=dropout, params=plan.params)
        if return_weights:
            out, weights, normalized = _chunk_autograd(*args, **options)
            weight_rows.append(F.pad(weights, (lo, plan.kv_len - hi)))
        else:
            out, weights, normalized = checkpoint(_chunk_autograd, *args, **options, use_reentrant=False)
        _accumulate(frobenius_sq, normalized)  # the attention matrix itself, before dropout
        outputs.append(out.permute(0, 3, 1, 2, 4))  # (B, c, H_kv, G, D_v)
    return torch.cat(outputs, dim=1), (torch.cat(weight_rows, dim=3) if return_weights else None)


def _chunk_autograd(q, k, v, allowed, bias, *, normalization, softcap, dropout, params):
    """Returns ``(output, weights after dropout, weights before dropout)`` of one chunk."""
    scores, _ = _scores(q, k, bias, softcap)
    normalized = normalization.weights(scores, allowed, params)
    weights = F.dropout(normalized, p=dropout, training=True) if dropout > 0.0 else normalized
    return _weighted_values(weights, v), weights, normalized


class _ChunkedAttention(torch.autograd.Function):
    """Chunked forward, and a backward that recomputes each chunk's scores (no N x N activation is stored)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, frobenius_sq, *params):
        output, _ = _forward(q, k, v, plan, q.dtype, frobenius_sq=frobenius_sq)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, output = ctx.saved_tensors
        with autocast_off(grad_output.device.type):  # the caller's autocast state, not the forward's
            dq, dk, dv, dparams = _backward(q, k, v, output, grad_output, ctx.plan)
        return dq, dk, dv, None, None, *(grad.reshape(-1) for grad in dparams.values())


def _backward(q, k, v, output, grad_output, plan: _Plan):
    """dq ``(B, H_kv, G, q, D)``, dk, dv, and the parameters' gradients ``{name: (H_kv, G, 1, 1)}``: each chunk's
    scores recomputed; ``output`` and ``grad_output`` are ``(B, q, H_kv, G, D_v)``."""
    normalization = plan.normalization
    batch, kv_heads, groups, _, dim = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dparams = {name: torch.zeros_like(value) for name, value in plan.params.items()}
    for start, stop, allowed, bias, lo, hi in plan.chunks(q.device):
        rows = groups * (stop - start)
        q_chunk = q[:, :, :, start:stop] * plan.scaling
        scores, capped = _scores(q_chunk, k[:, :, lo:hi], bias, plan.softcap)  # (B, H_kv, G, c, n)
        grad_out = grad_output[:, start:stop].permute(0, 2, 3, 1, 4)  # (B, H_kv, G, c, D_v)
        grad_out_rows = grad_out.reshape(batch, kv_heads, rows, -1)
        grad_weights = (grad_out_rows @ v[:, :, lo:hi].transpose(-1, -2)).view_as(scores)
        if normalization.is_softmax:
            weights = normalization.weights(scores, allowed)
            out = output[:, start:stop].permute(0, 2, 3, 1, 4)
            row_dot = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dW * w) = dO . O
            grad_scores = weights * (grad_weights - row_dot)
        elif normalization.pointwise is not None:  # an element-wise weight: its derivative in closed form
            weights = normalization.weights(scores, allowed)
            grad_scores = grad_weights * normalization.pointwise.derivative(scores, allowed)
        else:
            weights, grad_scores, grad_params = _family_backward(scores, allowed, normalization, plan.params,
                                                                 grad_weights)
            for name, grad in grad_params.items():
                dparams[name] += grad
        dv[:, :, lo:hi] += weights.reshape(batch, kv_heads, rows, -1).transpose(-1, -2) @ grad_out_rows
        if capped is not None:
            grad_scores = grad_scores * (1 - capped.square())
        grad_scores = grad_scores.reshape(batch, kv_heads, rows, -1)
        dq[:, :, :, start:stop] = (grad_scores @ k[:, :, lo:hi]).view(batch, kv_heads, groups, -1, dim) * plan.scaling
        dk[:, :, lo:hi] += grad_scores.transpose(-1, -2) @ q_chunk.reshape(batch, kv_heads, rows, dim)
    return dq, dk, dv, dparams


def _family_backward(scores, allowed, normalization: Normalization, params: dict, grad_weights):
    """One chunk of a family without a hand-written derivative: the vector-Jacobian product of its weights.

    Returns ``(weights, dS, {name: d param (H_kv, G, 1, 1)})``; the chunk holds whole rows, so this is the
    family's exact gradient, and the memory is the chunk's. ``torch.func.vjp``, not ``torch.autograd.grad``: the
    compiled backward runs this inside a custom op (``compiled.py``), below autograd, where ``enable_grad`` records
    nothing.
    """
    names = list(params)

    def weights_of(scores, *values):
        return normalization.weights(scores, allowed, dict(zip(names, values)))

    weights, vjp = torch.func.vjp(weights_of, scores.detach(), *(value.detach() for value in params.values()))
    grads = vjp(grad_weights)
    grad_params = {name: grad.sum_to_size(params[name].shape) for name, grad in zip(names, grads[1:])}
    return weights, grads[0], grad_params


def _scores(q, k, bias, softcap):
    """Scores of one chunk: q ``(B, H_kv, G, c, D)`` (already multiplied by the scaling), k ``(B, H_kv, n, D)`` -> ``(B, H_kv, G, c, n)``.

    Returns the scores and, with a softcap, ``tanh(raw / cap)`` (the backward needs it).
    """
    batch, kv_heads, groups, rows, dim = q.shape
    scores = (q.reshape(batch, kv_heads, groups * rows, dim) @ k.transpose(-1, -2)).view(batch, kv_heads, groups, rows, -1)
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if bias is not None:
        scores = scores + bias
    return scores, capped


def _weighted_values(weights, v):
    """``(B, H_kv, G, c, n) @ (B, H_kv, n, D_v) -> (B, H_kv, G, c, D_v)``."""
    batch, kv_heads, groups, rows, n = weights.shape
    return (weights.reshape(batch, kv_heads, groups * rows, n) @ v).view(batch, kv_heads, groups, rows, -1)


def _accumulate(frobenius_sq, weights) -> None:
    if frobenius_sq is not None:
        frobenius_sq += weights.detach().square().sum(dim=(-2, -1)).to(frobenius_sq.dtype)


def _grouped(mask: torch.Tensor | None, kv_heads: int, groups: int, kv_len: int) -> torch.Tensor | None:
    """``(B, 1 or H_q, q, >=kv)`` -> ``(B, 1 or H_kv, 1 or G, q, kv)``, so one mask serves each group of query heads."""
    if mask is None:
        return None
    mask = mask[..., :kv_len]
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])
