"""The quadratic attention of the element-wise families as fused Triton kernels: forward and backward, no N x N
tensor, no host round trip.

Every family whose weight is an element-wise function of its score times a factor of its row's key count
(:class:`~hf_knorm.normalizations.routes.Pointwise`, ``w = g(s) r(n)``: ``x^p/c`` of "Rethinking Softmax",
``relu(x)^p/c`` of ReLU attention and squared ReLU, with ``r`` a constant ``1/c``, ``1/n`` or ``1/sqrt(n)``) runs here;
the kernels read the family's declared form, never its type. FlashAttention's structure (Dao et al., arXiv 2205.14135
and 2307.08691) without its running maximum: these weights have no row normalization, so each key block adds
``g(s) V`` to a query block's fp32 accumulator, the row factor is applied once at the end, and nothing is
rescaled. One program computes one block of ``BLOCK_M`` query rows of one query head; K and V are read from the query
head's KV head ``h // G`` (GQA without repeating them). The backward recomputes each block's scores, as the PyTorch
kernel (``kernel.py``) does, in two kernels: dK and dV per key block (looping over the query heads of its group and
the query blocks that attend it), dQ per query block; no atomics.

With ``s`` the (softcapped, biased) score, ``u = s`` (``max(s, 0)`` rectified), ``r_i`` the row scale and
``t = tanh(raw / cap)``:

    forward:   ``o_i = r_i * sum_j u_ij^p v_j`` over allowed pairs;
    backward:  ``dS_ij = (dO_i . v_j) * p * u_ij^(p-1) * r_i`` (0 on masked pairs, and where ``s <= 0`` rectified),
               ``dR = dS * (1 - t^2)``,
               ``dq_i = scaling * sum_j dR_ij k_j``, ``dk_j = scaling * sum_i dR_ij q_i``,
               ``dv_j = sum_i r_i s_ij^p dO_i``.

Masks: an explicit bool mask ``(B or 1, 1 or H_q, q, kv)`` is read tile by tile (a sliding window, padding, packed
sequences: whatever Transformers built), and the key blocks each query block may attend (and the query blocks each
key block is attended by) are found on the device from it, before the launch, with no host synchronization
(:func:`block_ranges`, ``blocks.py``); without a mask and with ``causal``, the top-left causal mask (keys cut to
``q``, as in Transformers' sdpa path) is computed from indices. An additive float bias of the mask's shape is added to the scores.
The row rules ``1/n`` and ``1/sqrt(n)`` count each row's allowed keys in the forward and keep the row scales for the
backward.

Precision: scores and weights in fp32; every sum accumulates in fp32. For bf16 inputs the products take bf16
operands (tensor cores), and the fp32 tiles the kernels make themselves (the weights ``w`` in ``w V`` and ``w^T dO``,
the score gradients ``dS`` in ``dS K`` and ``dS^T Q``) enter them split in two bf16 tiles, ``hi + lo``, which keep 16
significant bits (:func:`_split_dot`): unlike softmax's convex weights, these rows cancel positive against negative
terms, and one bf16 rounding of each weight (what FlashAttention does to ``P``) doubled the error of the output and
gradients. Under the interpreter, at 1,024 tokens of the SmolLM2 shape (``x^3/16``, causal, seed 0), the output's
error against fp64 on the same bf16 inputs fell from 5.9e-3 to 2.8e-3 of the mean absolute value: exactly the error of
the fp32 result truncated to bf16 (the interpreter truncates where a GPU rounds to nearest), so what remains is the
output's own rounding. fp16 and fp32 inputs take fp32 operands (``s^p`` of a score of ~60 overflows fp16), IEEE
products for both (TF32 products for fp16 failed to compile on an H200 under Triton 3.6: the device check of issue
45). fp64 inputs are the PyTorch kernel's.

Under Triton's interpreter (``TRITON_INTERPRET=1``, how ``tests/attention/test_triton_kernel.py`` and the self-check
of ``self_check.py`` run these kernels on a CPU) the code is the same, bf16 operands included: the interpreter of
Triton 3.9.0 cannot multiply bf16 tiles by itself, and ``triton_interpreter.py`` teaches it, for the launches of these
kernels only (imported here when the kernels are interpreted).

Not covered here (``backends.py`` sends these calls to another kernel): the families without an element-wise form
(softmax and the other softmax-over-logits families run on SDPA, the rest on the PyTorch kernel), attention dropout, returned weights, and recording the attention norms.
``reference.py`` is what this is tested against; ``backends.py`` hands it calls on a device only after it has passed
its self-check there (``self_check.py``: against the PyTorch kernel, at these block sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .blocks import block_any, first_last
from ..normalizations import Normalization

BLOCK_M = 64
"""Query rows per program (not tuned on a GPU yet: docs/results/attention.md, "Attention on a GPU")."""
BLOCK_N = 64
"""Keys per step of a program's loop."""


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    normalization: Normalization,
    *,
    bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = False,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """``x^p/c`` attention through the Triton kernels, differentiable with respect to query, key and value.

    Args:
        query: ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``H_q % H_kv == 0``; on a
            CUDA device (or the CPU under ``TRITON_INTERPRET=1``).
        allowed: bool ``(B or 1, 1 or H_q, q, kv)``, True = may attend; ``None`` = no mask, or with ``causal`` (and
            q > 1) a top-left causal mask with keys cut to q (as :func:`.kernel.chunked_attention` has it).
        normalization: a family with an element-wise form (:attr:`~hf_knorm.normalizations.Normalization.pointwise`:
            ``x^p/c``, ``x^p/sqrtN``, ``relu(x)^p/c``, ``relu(x)^p/n``, ...).
        bias: optional additive float scores of the mask's shape; scaling: score scale (default ``D ** -0.5``);
        softcap: ``tanh`` capping of the scores (Gemma2), applied before the bias.
        block_m, block_n: query rows and keys per block (powers of two; 16 at least on a GPU).

    Returns:
        output ``(B, q, H_q, D_v)`` in the query dtype, as :func:`.kernel.chunked_attention` returns it.
    """
    pointwise = normalization.pointwise
    if pointwise is None:
        raise ValueError(f"The Triton kernel computes the element-wise families (x^p/c, relu(x)^p/c), not "
                         f"{normalization.name}: its weights are not a function of each score alone.")
    if not query.is_cuda and not INTERPRETED:
        raise ValueError(f"The Triton kernel runs on CUDA tensors, not {query.device.type} ones (on a CPU, only under "
                         "Triton's interpreter: TRITON_INTERPRET=1 set before triton is first imported).")
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"The Triton kernel takes fp32, bf16 or fp16 inputs, not {query.dtype}.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    if allowed is None and causal and q_len > 1:  # top-left causal: keys beyond the queries are never attended
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    options = _Options(
        power=pointwise.power,
        rectified=pointwise.activation == "relu_power",
        row_rule=_ROW_RULES[pointwise.row_rule],
        inv_constant=pointwise.inv_constant,
        scaling=head_dim**-0.5 if scaling is None else float(scaling),
        softcap=None if softcap is None else float(softcap),
        causal=allowed is None and causal and q_len > 1,
        block_m=block_m,
        block_n=block_n,
    )
    if allowed is not None:
        allowed = allowed[..., : key.shape[2]]
        bias = None if bias is None else bias[..., : key.shape[2]]
    return _TritonAttention.apply(query, key, value, allowed, bias, options)


@dataclass(frozen=True)
class _Options:
    """What the kernels of one call share besides the tensors. ``rectified``: ``max(s, 0)`` before the power;
    ``row_rule``: :data:`_ROW_RULES`' code; ``inv_constant``: ``1 / c`` (the constant rule's); ``causal``: the implicit
    top-left causal mask (no mask tensor)."""

    power: int
    rectified: bool
    row_rule: int
    inv_constant: float
    scaling: float
    softcap: float | None
    causal: bool
    block_m: int
    block_n: int


_ROW_RULES = {"constant": 0, "sqrtN": 1, "n": 2}
"""The row rule of :class:`~hf_knorm.normalizations.routes.Pointwise` as the kernels' ``ROW_RULE`` constant."""


def block_ranges(allowed: torch.Tensor, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks worth visiting, from a bool mask ``(Bm, Hm, q, kv)``, computed on its device (no host sync).

    Returns:
        ``key_blocks (Bm, Hm, nM, 2)`` int32: the key blocks ``[lo, hi)`` query block ``m`` may attend (``lo = hi``
        when none), and ``query_blocks (Bm, Hm, nN, 2)``: the query blocks ``[lo, hi)`` that attend key block ``n``.
    """
    blocks = block_any(block_any(allowed, block_m, dim=2), block_n, dim=3)  # (Bm, Hm, nM, nN)
    return first_last(blocks), first_last(blocks.transpose(2, 3))


def _mask_strides(mask: torch.Tensor | None, q_heads: int) -> tuple[int, int, int, int]:
    """Strides ``(batch, head, row, key)`` of a ``(B or 1, 1 or H_q, q, kv)`` tensor, 0 on a broadcast dimension."""
    if mask is None:
        return 0, 0, 0, 0
    batch, heads = mask.shape[:2]
    return (mask.stride(0) if batch > 1 else 0, mask.stride(1) if heads > 1 else 0, mask.stride(2), mask.stride(3))


def _range_strides(ranges: torch.Tensor | None) -> tuple[int, int, int]:
    if ranges is None:
        return 0, 0, 0
    return (ranges.stride(0) if ranges.shape[0] > 1 else 0, ranges.stride(1) if ranges.shape[1] > 1 else 0,
            ranges.stride(2))


def _dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """``(fp32 operands, tl.dot input precision)`` for inputs of ``dtype`` (see the module docstring): bf16 operands
    stay bf16 (on a GPU and under the interpreter alike), anything else is computed on fp32 operands with IEEE
    products (fp16's TF32 products did not compile on an H200, Triton 3.6)."""
    upcast = dtype != torch.bfloat16
    return upcast, "ieee"


class _TritonAttention(torch.autograd.Function):
    """Forward kernel; backward: the dK/dV kernel and the dQ kernel, recomputing the scores block by block."""

    @staticmethod
    def forward(ctx, query, key, value, allowed, bias, options: _Options):
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[-1]
        output = query.new_empty(batch, q_len, q_heads, value_dim)
        row_scale = torch.empty(batch, q_heads, q_len, device=query.device, dtype=torch.float32)
        key_blocks = query_blocks = None
        mask = None
        if allowed is not None:
            key_blocks, query_blocks = block_ranges(allowed, options.block_m, options.block_n)
            mask = allowed.view(torch.uint8) if allowed.dtype == torch.bool else allowed
        bias = None if bias is None else bias.float()
        grid = (triton.cdiv(q_len, options.block_m), batch * q_heads)
        upcast, precision = _dot_options(query.dtype)
        _forward_kernel[grid](
            query, key, value, output, row_scale, mask, bias, key_blocks,
            *query.stride(), *key.stride(), *value.stride(), *output.stride(),
            *_mask_strides(mask, q_heads), *_mask_strides(bias, q_heads), *_range_strides(key_blocks),
            q_heads, q_heads // kv_heads, q_len, kv_len, head_dim, value_dim,
            options.scaling, options.inv_constant, options.softcap or 1.0,
            POWER=options.power, RECTIFIED=options.rectified, ROW_RULE=options.row_rule,
            SOFTCAP=options.softcap is not None,
            CAUSAL=options.causal, HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
            BLOCK_M=options.block_m, BLOCK_N=options.block_n, BLOCK_D=_pow2(head_dim), BLOCK_DV=_pow2(value_dim),
            UPCAST=upcast, PRECISION=precision,
        )
        ctx.save_for_backward(query, key, value, row_scale, mask, bias, key_blocks, query_blocks)
        ctx.options = options
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, row_scale, mask, bias, key_blocks, query_blocks = ctx.saved_tensors
        options: _Options = ctx.options
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[-1]
        grad_output = grad_output.to(query.dtype)
        dq = torch.empty_like(query)
        dk, dv = torch.empty_like(key), torch.empty_like(value)
        upcast, precision = _dot_options(query.dtype)
        shared = dict(
            POWER=options.power, RECTIFIED=options.rectified, SOFTCAP=options.softcap is not None,
            CAUSAL=options.causal, HAS_MASK=mask is not None, HAS_BIAS=bias is not None, BLOCK_M=options.block_m, BLOCK_N=options.block_n,
            BLOCK_D=_pow2(head_dim), BLOCK_DV=_pow2(value_dim), UPCAST=upcast, PRECISION=precision,
        )
        common = (*query.stride(), *key.stride(), *value.stride(), *grad_output.stride(),
                  *_mask_strides(mask, q_heads), *_mask_strides(bias, q_heads))
        sizes = (q_heads, q_heads // kv_heads, q_len, kv_len, head_dim, value_dim,
                 options.scaling, options.softcap or 1.0)
        _dkdv_kernel[(triton.cdiv(kv_len, options.block_n), batch * kv_heads)](
            query, key, value, grad_output, row_scale, mask, bias, query_blocks, dk, dv,
            *common, *_range_strides(query_blocks), *dk.stride(), *dv.stride(), *sizes, **shared,
        )
        _dq_kernel[(triton.cdiv(q_len, options.block_m), batch * q_heads)](
            query, key, value, grad_output, row_scale, mask, bias, key_blocks, dq,
            *common, *_range_strides(key_blocks), *dq.stride(), *sizes, **shared,
        )
        return dq, dk, dv, None, None, None


def _pow2(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32, on fp32 operands with ``UPCAST`` (module docstring)."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _split_dot(x, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``x @ b`` for an fp32 tile ``x`` (weights, score gradients) and an input tile ``b``, accumulated in fp32. With
    ``UPCAST``, on fp32 operands. Otherwise ``x`` is split into two bf16 tiles, ``hi = bf16(x)`` and ``lo = bf16(x -
    hi)``, and ``hi @ b + lo @ b`` is taken on bf16 operands: ``x`` keeps 16 significant bits where one bf16 tile keeps
    8, at the cost of a second product. These weights are not a convex combination as softmax's are: a row's
    positive and negative terms cancel, and one bf16 rounding of each weight doubled the error of the output
    (module docstring, "Precision")."""
    if UPCAST:
        return tl.dot(x, b.to(tl.float32), input_precision=PRECISION)
    hi = x.to(b.dtype)
    lo = (x - hi.to(tl.float32)).to(b.dtype)
    return tl.dot(hi, b, input_precision=PRECISION) + tl.dot(lo, b, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """``tanh`` from ``exp`` (both ends saturate to +-1: ``exp`` overflows to inf, or underflows to 0)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k_ptrs, rows, keys, dims, b, h, q_len, kv_len, head_dim, mask_ptr, bias_ptr,
            smb, smh, smq, smk, sbb, sbh, sbq, sbk, scaling, softcap,
            SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One ``(BLOCK_M, BLOCK_N)`` tile: scores zeroed where not allowed, ``tanh(raw / cap)`` (or 0s), the allowed
    pairs."""
    k = tl.load(k_ptrs, mask=(keys[:, None] < kv_len) & (dims[None, :] < head_dim), other=0.0)
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scaling
    t = tl.zeros_like(s)
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    inside = (rows[:, None] < q_len) & (keys[None, :] < kv_len)
    allowed = inside
    if CAUSAL:
        allowed = allowed & (keys[None, :] <= rows[:, None])
    # A mask holds B x q x kv entries: 64-bit offsets (2^31 entries are 46k x 46k, or two items at 32k).
    b64, h64, rows64, keys64 = b.to(tl.int64), h.to(tl.int64), rows.to(tl.int64), keys.to(tl.int64)
    if HAS_MASK:
        offsets = b64 * smb + h64 * smh + rows64[:, None] * smq + keys64[None, :] * smk
        allowed = allowed & (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0)
    if HAS_BIAS:
        offsets = b64 * sbb + h64 * sbh + rows64[:, None] * sbq + keys64[None, :] * sbk
        s += tl.load(bias_ptr + offsets, mask=inside, other=0.0)
    return tl.where(allowed, s, 0.0), t, allowed


@triton.jit
def _rectify(s, allowed, RECTIFIED: tl.constexpr):
    """``(u, active)``: the scores ``s`` (0 where not allowed) as ``g`` reads them, ``max(s, 0)`` when ``RECTIFIED``,
    and the pairs where ``g`` has a nonzero slope (allowed, and ``s > 0`` when ``RECTIFIED``)."""
    if RECTIFIED:
        active = allowed & (s > 0.0)
        return tl.where(active, s, 0.0), active
    return s, allowed


@triton.jit
def _power(s, P: tl.constexpr):
    """``s^P`` for a constant integer ``P >= 0`` (repeated products: odd powers keep the sign)."""
    result = tl.full(s.shape, 1.0, tl.float32)
    for _ in tl.static_range(P):
        result = result * s
    return result


@triton.jit
def _key_range(ranges_ptr, b, h, block, srb, srh, srk, q_start, kv_len, CAUSAL: tl.constexpr,
               HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks ``[lo, hi)`` query block ``block`` (rows from ``q_start``) visits."""
    lo = 0
    hi = tl.cdiv(kv_len, BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(hi, tl.cdiv(q_start + BLOCK_M, BLOCK_N))
    if HAS_MASK:
        base = ranges_ptr + b * srb + h * srh + block * srk
        lo = tl.load(base)
        hi = tl.load(base + 1)
    return lo, hi


@triton.jit
def _forward_kernel(
    Q, K, V, O, ROW_SCALE, MASK, BIAS, KEY_BLOCKS,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, som, soh, sod,
    smb, smh, smq, smk, sbb, sbh, sbq, sbk, srb, srh, srk,
    q_heads, groups, q_len, kv_len, head_dim, value_dim, scaling, inv_constant, softcap,
    POWER: tl.constexpr, RECTIFIED: tl.constexpr, ROW_RULE: tl.constexpr, SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Output rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of query head ``h`` of batch item ``b``; grid
    ``(cdiv(q, BLOCK_M), B * H_q)``."""
    block = tl.program_id(0)
    b = (tl.program_id(1) // q_heads).to(tl.int64)  # 64-bit offsets: a batch of long sequences passes 2^31
    h = (tl.program_id(1) % q_heads).to(tl.int64)
    kv_head = h // groups
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim), other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    count = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lo, hi = _key_range(KEY_BLOCKS, b, h, block, srb, srh, srk, block * BLOCK_M, kv_len, CAUSAL, HAS_MASK,
                        BLOCK_M, BLOCK_N)
    for key_block in range(lo, hi):
        keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ptrs = K + b * skb + kv_head * skh + keys[:, None] * skn + dims[None, :] * skd
        s, t, allowed = _scores(q, k_ptrs, rows, keys, dims, b, h, q_len, kv_len, head_dim, MASK, BIAS,
                                smb, smh, smq, smk, sbb, sbh, sbq, sbk, scaling, softcap,
                                SOFTCAP, CAUSAL, HAS_MASK, HAS_BIAS, UPCAST, PRECISION)
        count += tl.sum(allowed.to(tl.float32), axis=1)  # n: the keys the row may attend
        u, _ = _rectify(s, allowed, RECTIFIED)
        w = _power(u, POWER)
        v = tl.load(V + b * svb + kv_head * svh + keys[:, None] * svn + value_dims[None, :] * svd,
                    mask=(keys[:, None] < kv_len) & (value_dims[None, :] < value_dim), other=0.0)
        acc += _split_dot(w, v, UPCAST, PRECISION)
    if ROW_RULE == 1:
        scale = 1.0 / tl.sqrt(tl.maximum(count, 1.0))
    elif ROW_RULE == 2:
        scale = 1.0 / tl.maximum(count, 1.0)
    else:
        scale = tl.zeros_like(count) + inv_constant
    acc = acc * scale[:, None]
    tl.store(ROW_SCALE + (b * q_heads + h) * q_len + rows, scale, mask=rows < q_len)
    tl.store(O + b * sob + rows[:, None] * som + h * soh + value_dims[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (value_dims[None, :] < value_dim))


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, ROW_SCALE, MASK, BIAS, QUERY_BLOCKS, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdm, sdh, sdd,
    smb, smh, smq, smk, sbb, sbh, sbq, sbk, srb, srh, srk, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    q_heads, groups, q_len, kv_len, head_dim, value_dim, scaling, softcap,
    POWER: tl.constexpr, RECTIFIED: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK, dV of keys ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of KV head ``kv_head``; grid ``(cdiv(kv, BLOCK_N),
    B * H_kv)``. Sums over the ``groups`` query heads of the KV head and the query blocks that attend the keys."""
    block = tl.program_id(0)
    kv_heads = q_heads // groups
    b = (tl.program_id(1) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    k_ptrs = K + b * skb + kv_head * skh + keys[:, None] * skn + dims[None, :] * skd
    v = tl.load(V + b * svb + kv_head * svh + keys[:, None] * svn + value_dims[None, :] * svd,
                mask=(keys[:, None] < kv_len) & (value_dims[None, :] < value_dim), other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for group in range(0, groups):
        h = kv_head * groups + group
        lo = 0
        hi = tl.cdiv(q_len, BLOCK_M)
        if CAUSAL:
            lo = (block * BLOCK_N) // BLOCK_M
        if HAS_MASK:
            base = QUERY_BLOCKS + b * srb + h * srh + block * srk
            lo = tl.load(base)
            hi = tl.load(base + 1)
        for query_block in range(lo, hi):
            rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
            in_rows = rows < q_len
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                        mask=in_rows[:, None] & (dims[None, :] < head_dim), other=0.0)
            do = tl.load(DO + b * sdb + rows[:, None] * sdm + h * sdh + value_dims[None, :] * sdd,
                         mask=in_rows[:, None] & (value_dims[None, :] < value_dim), other=0.0)
            scale = tl.load(ROW_SCALE + (b * q_heads + h) * q_len + rows, mask=in_rows, other=0.0)
            s, t, allowed = _scores(q, k_ptrs, rows, keys, dims, b, h, q_len, kv_len, head_dim, MASK, BIAS,
                                    smb, smh, smq, smk, sbb, sbh, sbq, sbk, scaling, softcap,
                                    SOFTCAP, CAUSAL, HAS_MASK, HAS_BIAS, UPCAST, PRECISION)
            u, active = _rectify(s, allowed, RECTIFIED)
            lower = _power(u, POWER - 1)  # u^(p-1); masked pairs are 0 through u (or active, for p = 1)
            w = lower * u * scale[:, None]
            dv += _split_dot(tl.trans(w), do, UPCAST, PRECISION)
            dw = _dot(do, tl.trans(v), UPCAST, PRECISION)
            ds = tl.where(active, dw * (POWER * lower) * scale[:, None], 0.0)
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dk += _split_dot(tl.trans(ds), q, UPCAST, PRECISION)
    in_keys = keys[:, None] < kv_len
    tl.store(DK + b * sdkb + kv_head * sdkh + keys[:, None] * sdkn + dims[None, :] * sdkd,
             (dk * scaling).to(DK.dtype.element_ty), mask=in_keys & (dims[None, :] < head_dim))
    tl.store(DV + b * sdvb + kv_head * sdvh + keys[:, None] * sdvn + value_dims[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=in_keys & (value_dims[None, :] < value_dim))


@triton.jit
def _dq_kernel(
    Q, K, V, DO, ROW_SCALE, MASK, BIAS, KEY_BLOCKS, DQ,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdm, sdh, sdd,
    smb, smh, smq, smk, sbb, sbh, sbq, sbk, srb, srh, srk, sdqb, sdqh, sdqm, sdqd,
    q_heads, groups, q_len, kv_len, head_dim, value_dim, scaling, softcap,
    POWER: tl.constexpr, RECTIFIED: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dQ of query rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of query head ``h``; grid ``(cdiv(q, BLOCK_M),
    B * H_q)``."""
    block = tl.program_id(0)
    b = (tl.program_id(1) // q_heads).to(tl.int64)  # 64-bit offsets: a batch of long sequences passes 2^31
    h = (tl.program_id(1) % q_heads).to(tl.int64)
    kv_head = h // groups
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                mask=in_rows[:, None] & (dims[None, :] < head_dim), other=0.0)
    do = tl.load(DO + b * sdb + rows[:, None] * sdm + h * sdh + value_dims[None, :] * sdd,
                 mask=in_rows[:, None] & (value_dims[None, :] < value_dim), other=0.0)
    scale = tl.load(ROW_SCALE + (b * q_heads + h) * q_len + rows, mask=in_rows, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(KEY_BLOCKS, b, h, block, srb, srh, srk, block * BLOCK_M, kv_len, CAUSAL, HAS_MASK,
                        BLOCK_M, BLOCK_N)
    for key_block in range(lo, hi):
        keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ptrs = K + b * skb + kv_head * skh + keys[:, None] * skn + dims[None, :] * skd
        s, t, allowed = _scores(q, k_ptrs, rows, keys, dims, b, h, q_len, kv_len, head_dim, MASK, BIAS,
                                smb, smh, smq, smk, sbb, sbh, sbq, sbk, scaling, softcap,
                                SOFTCAP, CAUSAL, HAS_MASK, HAS_BIAS, UPCAST, PRECISION)
        v = tl.load(V + b * svb + kv_head * svh + keys[:, None] * svn + value_dims[None, :] * svd,
                    mask=(keys[:, None] < kv_len) & (value_dims[None, :] < value_dim), other=0.0)
        dw = _dot(do, tl.trans(v), UPCAST, PRECISION)
        u, active = _rectify(s, allowed, RECTIFIED)
        ds = tl.where(active, dw * (POWER * _power(u, POWER - 1)) * scale[:, None], 0.0)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        k = tl.load(k_ptrs, mask=(keys[:, None] < kv_len) & (dims[None, :] < head_dim), other=0.0)
        dq += _split_dot(ds, k, UPCAST, PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqm + dims[None, :] * sdqd,
             (dq * scaling).to(DQ.dtype.element_ty), mask=in_rows[:, None] & (dims[None, :] < head_dim))


INTERPRETED = isinstance(_forward_kernel, InterpretedFunction)
"""Whether these kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when triton was first imported: its
own library functions are decorated then, and an interpreted kernel cannot call compiled ones)."""

if INTERPRETED:
    from .triton_interpreter import teach_bf16_dot

    teach_bf16_dot(_forward_kernel, _dkdv_kernel, _dq_kernel)  # their launches only: not other interpreted kernels
