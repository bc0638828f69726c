"""FlexAttention (``torch.nn.attention.flex_attention``; Dong, Feng, Guessous, Liang, He, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", arXiv 2412.05496) for every family that is a softmax
over modified logits, whose weight has an element-wise logarithm, or whose weight is a ratio of two such weights. The
route reads the family's declared form and never its type:

- :class:`~hf_knorm.normalizations.routes.SoftmaxLogits` (softmax, SSMax, a sink softmax): the row factor
  ``s_h log n_i`` multiplies the score in the ``score_mod``; a sink of logit ``sigma_h`` renormalizes by the returned
  log-sum-exp, ``out * sigmoid(lse - sigma_h)`` (as Transformers' ``integrations/flex_attention.py`` does for gpt-oss).
- :class:`~hf_knorm.normalizations.routes.LogWeight` (sigmoid, the rectified powers ``relu(x)^p/c``, the even powers
  ``x^p/c``): the ``score_mod`` is ``l(s) = log w(s)``; FlexAttention's softmax of it, times ``e^{lse}``, is the
  unnormalized sum: ``sum_j w_ij v_j = out_i e^{lse_i}`` exactly (``-inf`` where a weight is 0).

- :class:`~hf_knorm.normalizations.routes.LogWeightRatio` (softpick): two passes. Pass A's ``score_mod`` is the
  numerator's logarithm ``a(s) = log relu(e^s - 1)``: its output ``out_A``, ``lse_A`` and the row's largest modified
  score ``max_A`` (``AuxRequest(max_scores=True)``), from which the row shift ``m = max(0, max_k s_k) =
  softplus(max_A)`` follows; pass B's is the denominator's ``b(s) = log |e^s - 1|``: its ``lse_B``. Then
  ``out = out_A e^{lse_A} / (e^{lse_B} + eps e^m) = out_A / (e^{lse_B - lse_A} + eps e^{m - lse_A})`` (``lse_B >=
  lse_A``: no overflow), a row with no positive score 0. Exact in the forward. FlexAttention's ``max_scores`` has no
  gradient, so the backward holds ``m`` fixed where the reference differentiates it through the row's maximum: the
  term it leaves out is the floor's share of the denominator, ``eps e^m / (D + eps e^m)`` with ``D = sum_k |e^{s_k} -
  1| >= e^m - 1``, at most ``eps e^m / (e^m - 1)`` relative (``~eps`` = 1e-6 unless every score of the row is near 0),
  on the gradient of the row's largest score only: the tests allow ``1e-5`` of the largest gradient (fp64), against
  ``1e-10`` for the other families.

Stick-breaking weighs a key by the keys after it in its row (a reversed cumulative sum, not an element-wise function):
it stays on the chunked kernel. The odd powers ``x^p/c`` (negative weights) run on the Triton kernel.

Masks (:mod:`.masks`): key padding ``(B, kv)`` with queries at the bottom right of the keys, no mask (the implicit
top-left causal mask with ``causal``, keys cut to ``q``), or an explicit bool ``(B or 1, 1 or H_q, q, kv)`` mask (a
model's own sliding window, packed sequences, a cache: whatever Transformers built). Each becomes a ``BlockMask``
built from block summaries (:func:`block_mask`): key padding and the implicit mask without an ``N x N`` tensor; the
``mask_mod`` reads the padded key validity or the explicit mask. ``n_i`` (the keys row ``i`` may attend) is counted
from the same form. A row with no key gets 0 (FlexAttention's own answer: output 0, ``lse = -inf``). An additive
float bias is read in the ``score_mod`` after the softcap, as the chunked kernel adds it. GQA: ``enable_gqa`` (K and
V are not repeated). One decoded query row against the cache is a ``q = 1`` call of the same code. The family's
learned values are tensors the ``score_mod`` captures: FlexAttention differentiates them.

Precision: on CUDA the inputs' dtype (bf16/fp16 operands, scores, ``score_mod`` and accumulation in fp32, as flash
does; fp32 stays fp32); on the CPU fp32 (fp64 for fp64 inputs), as the chunked kernel computes. The renormalization
by ``lse`` is computed in fp32.

How it runs: on CUDA, ``torch.compile(flex_attention)`` (the fused Triton kernels; the first call of a shape
compiles, ``make device-check`` reports that warm-up); on the CPU, FlexAttention's eager forward (a dense reference
implementation: the tests). Gradients, established on torch 2.13: FlexAttention's autograd differentiates the
returned ``lse`` (its backward takes ``grad_logsumexp``, in the dense implementation and in Inductor's lowering,
``delta - grad_lse``) and the captured values; on CUDA that is the compiled backward. On the CPU torch 2.13 refuses any
backward at the API's entry (``_validate_device``: "FlexAttention does not support backward on CPU"); the dense
implementation under it computes the gradients through ``lse`` exactly in fp64 (``tests/attention/test_flex.py`` lifts
the refusal to check them), so on the CPU this route runs inference only, and the dispatcher sends it CUDA calls only.
Torch 2.13 refuses ``max_scores`` on the CPU too ("Returning max scores is not supported on CPU/MPS", raised as it
is): the two-pass route needs CUDA even for inference; its CPU tests lift that refusal as well (the dense
implementation computes the maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .full_precision import full_precision
from .kernel import _raw_params
from .masks import KeyPadding, Mask
from ..normalizations import Normalization
from ..normalizations.base import Parameters

BLOCK_SIZE = 128
"""FlexAttention's block (query rows and keys), its default: the ``BlockMask`` skips whole blocks."""
RECOMPILE_LIMIT = 64
"""Compiled variants of the flex call allowed per process (torch's default, 8, is reached by a few families in two
grad modes; past it Dynamo would run FlexAttention's unfused form, which materializes the scores)."""

_COMPILED = None


def computes(normalization: Normalization) -> bool:
    """Whether this route computes ``normalization``: a softmax over modified logits, a weight with a logarithm or a
    ratio of two (without a softmax window: :mod:`.window` composes its parts)."""
    return "flex" in normalization.fast_paths


@full_precision
def flex_route_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Mask,
    normalization: Normalization,
    *,
    bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = False,
    params: Parameters | None = None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Attention with ``normalization`` through FlexAttention.

    Args:
        query ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``H_q % H_kv == 0``.
        mask: :class:`~.masks.KeyPadding`, a bool ``(B or 1, 1 or H_q, q, kv)`` mask (True = may attend), or
            ``None``: no mask, or with ``causal`` (and ``q > 1``) a top-left causal mask with the keys cut to ``q``.
        normalization: a family with a FlexAttention route (:func:`computes`).
        bias: an additive float ``(B or 1, 1 or H_q, q, kv)`` mask, added after the softcap, or ``None``.
        scaling: the score scale (default ``D ** -0.5``); softcap: ``tanh`` capping of the scores (Gemma2).
        params: the family's learnable values, ``(H_q,)`` each.
        compiled: run ``torch.compile(flex_attention)`` (default: on CUDA) or FlexAttention's eager form.

    Returns:
        ``(B, q, H_q, D_v)`` in the query's dtype.

    Raises:
        ValueError: a family this route does not compute, head counts that do not group, a learnable value missing.
    """
    if not computes(normalization):
        raise ValueError(f"FlexAttention computes a softmax over modified logits or a non-negative weight with an "
                         f"element-wise logarithm (or a ratio of two), not {normalization.name} (it stays on the "
                         "chunked kernel).")
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    raw = _raw_params(normalization, params, query)
    on_cuda = query.device.type == "cuda"
    compiled = on_cuda if compiled is None else compiled
    compute = query.dtype if on_cuda else torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    if mask is None and causal and q_len > 1:  # top-left, keys cut to the queries (the kernel's convention)
        k, v = k[:, :, :q_len], v[:, :, :q_len]
        mask = KeyPadding(torch.ones(1, q_len, dtype=torch.bool, device=q.device), q_len, causal=True)
    elif mask is None:
        mask = KeyPadding(torch.ones(1, k.shape[2], dtype=torch.bool, device=q.device), q_len, causal=False)
    elif not isinstance(mask, KeyPadding):
        mask = mask[..., : k.shape[2]]
    bias = None if bias is None else bias[..., : k.shape[2]]
    accumulate = torch.promote_types(compute, torch.float32)  # the renormalization and n: fp32 (fp64 for fp64)
    blocks = block_mask(mask, q_len, k.shape[2], dtype=accumulate)
    form = _Form.of(normalization, raw)
    scale = dim**-0.5 if scaling is None else float(scaling)
    gqa = q_heads != kv_heads
    if form.ratio is not None:  # two passes: the numerator's output, lse and row maximum; the denominator's lse
        numerator = _score_mod(form, blocks.log_counts, bias, softcap, accumulate, element=form.ratio.numerator)
        denominator = _score_mod(form, blocks.log_counts, bias, softcap, accumulate, element=form.ratio.denominator)
        output, lse, largest = _flex(q, k, v, numerator, blocks.block_mask, scale, gqa, compiled, max_scores=True)
        _, lse_b, _ = _flex(q, k, v, denominator, blocks.block_mask, scale, gqa, compiled)
        output = _ratio(form.ratio, output.to(accumulate), lse.to(accumulate), largest.to(accumulate),
                        lse_b.to(accumulate))
    else:
        score_mod = _score_mod(form, blocks.log_counts, bias, softcap, accumulate)
        output, lse, _ = _flex(q, k, v, score_mod, blocks.block_mask, scale, gqa, compiled)
        output = form.finish(output.to(accumulate), lse.to(accumulate))
    return output.transpose(1, 2).to(query.dtype)


def _ratio(ratio, out_a: torch.Tensor, lse_a: torch.Tensor, max_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """``out_A e^{lse_A} / (e^{lse_B} + eps e^m)``, ``m = row_shift(max_A)``, computed as ``out_A / (e^{lse_B - lse_A}
    + eps e^{m - lse_A})``: pass A's output ``(B, H_q, q, D_v)`` and ``lse_A``, ``max_A``, ``lse_B`` ``(B, H_q, q)``,
    fp32. A row with no positive score (``lse_A = -inf``) is 0, with gradient 0."""
    some = lse_a > float("-inf")
    zero = torch.zeros_like(lse_a)
    safe_a = torch.where(some, lse_a, zero)
    floor = ratio.eps * torch.exp(torch.where(some, ratio.row_shift(max_a), zero) - safe_a)
    denominator = torch.exp(torch.where(some, lse_b, zero) - safe_a) + floor
    return torch.where(some[..., None], out_a / denominator[..., None], torch.zeros_like(out_a))


@dataclass
class _Form:
    """What the ``score_mod`` and the renormalization read: the family's declared form and its learned values
    ``(H_q,)`` each (SSMax's ``scale``, the sink's ``sink``, sigmoid's ``bias``)."""

    logits: object  # SoftmaxLogits or None
    log_weight: object  # LogWeight or None
    ratio: object  # LogWeightRatio or None
    values: dict

    @classmethod
    def of(cls, normalization: Normalization, raw: dict) -> _Form:
        return cls(normalization.softmax_logits, normalization.log_weights, normalization.log_weight_ratio, raw)

    @property
    def needs_counts(self) -> bool:
        if self.ratio is not None:
            return False
        if self.logits is not None:
            return self.logits.log_n_scale is not None
        return self.log_weight.needs_counts

    def finish(self, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """FlexAttention's ``(B, H_q, q, D_v)`` output and ``(B, H_q, q)`` ``lse`` (fp32) -> the family's output."""
        if self.log_weight is not None:  # sum_j w_ij v_j = out_i e^{lse_i}; a row of weights 0: lse = -inf, out 0
            return output * lse.exp()[..., None]
        if self.logits.sink is None:
            return output
        sink = self.logits.sink_logits(self.values, output.shape[1], lse)  # (H_q,)
        return output * torch.sigmoid(lse - sink[:, None])[..., None]  # e^lse / (e^lse + e^sigma)


def _score_mod(form: _Form, log_counts: torch.Tensor | None, bias: torch.Tensor | None, softcap: float | None,
               dtype: torch.dtype, element=None):
    """The ``score_mod(score, b, h, q_idx, kv_idx)``: softcap, bias, then the family's modification of the logit (or
    ``element``, an element-wise function of the score: a pass of a ratio's two).

    Numbers it reads that differ between calls (a softcap, SSMax's fixed scale) are captured as 0-d tensors: Dynamo
    would otherwise turn a Python float that changed into a symbolic one, which FlexAttention's backward graph fails
    to trace on torch 2.13 ("Pending unbacked symbols"), and recompile for each value."""
    device = log_counts.device
    if not form.needs_counts:
        log_counts = None
    values = form.values
    logits, log_weight = form.logits, form.log_weight
    head_scale = None
    if logits is not None and logits.log_n_scale is not None:
        head_scale = logits.head_scale(values)
        if not isinstance(head_scale, torch.Tensor):
            head_scale = torch.full((1,), float(head_scale), dtype=dtype, device=device)
    if softcap is not None:
        softcap = torch.tensor(float(softcap), dtype=dtype, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + _at(bias, b, h, q_idx, kv_idx).to(score.dtype)
        if element is not None:
            return element(score)
        log_n = 0.0 if log_counts is None else _at(log_counts, b, h, q_idx).to(score.dtype)
        if log_weight is not None:
            return log_weight(score, log_n, {name: value[h] for name, value in values.items()})
        if head_scale is not None:  # SSMax: s_h log n_i times the score
            factor = head_scale[h if head_scale.shape[0] > 1 else 0]
            score = score * (factor * log_n)
        return score

    return score_mod


def _at(tensor: torch.Tensor, b, h, *rest):
    """``tensor[b, h, *rest]`` of a ``(B or 1, H or 1, ...)`` tensor (index 0 on a broadcast dimension)."""
    return tensor[b if tensor.shape[0] > 1 else 0, h if tensor.shape[1] > 1 else 0, *rest]


@dataclass
class FlexMask:
    """A call's ``BlockMask`` and ``log n_i`` ``(B or 1, H or 1, q)`` (``n`` at least 1)."""

    block_mask: object
    log_counts: torch.Tensor


def block_mask(mask: KeyPadding | torch.Tensor, q_len: int, kv_len: int, block: int = BLOCK_SIZE,
               dtype: torch.dtype = torch.float32) -> FlexMask:
    """The ``BlockMask`` of ``mask`` (key padding, its queries at the bottom right of the keys; or an explicit bool
    ``(B or 1, 1 or H, q, kv)`` mask), from per-block summaries: a block no pair of which is allowed is skipped, one all
    of whose pairs are allowed is a full block (no ``mask_mod``), the rest read the ``mask_mod``. The tensors the
    ``mask_mod`` captures are padded to whole blocks (False), so it never reads out of range."""
    from torch.nn.attention.flex_attention import BlockMask

    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    q_pad, kv_pad = q_blocks * block - q_len, kv_blocks * block - kv_len
    if isinstance(mask, KeyPadding):
        valid = F.pad(mask.key_valid.to(torch.bool), (0, kv_pad))  # (Bm, kv padded)
        offset = kv_len - q_len  # query i sits at key position i + offset
        causal = mask.causal
        any_blocks, all_blocks = _padding_blocks(valid, q_len, kv_len, offset, causal, block)
        real = valid.sum(-1, keepdim=True) if not causal else None

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = valid[b if valid.shape[0] > 1 else 0, kv_idx]
            return allowed & (kv_idx <= q_idx + offset) if causal else allowed

        if causal:
            cumulative = valid.cumsum(-1)  # keys valid up to each position
            positions = torch.arange(q_len, device=valid.device) + offset
            counts = cumulative[:, positions.clamp_min(0)] * (positions >= 0)
        else:
            counts = real.expand(-1, q_len)
        counts = counts[:, None]  # (Bm, 1, q)
    else:
        allowed = F.pad(mask.to(torch.bool), (0, kv_pad, 0, q_pad))  # (Bm, Hm, q padded, kv padded)
        tiles = allowed.unflatten(-1, (kv_blocks, block)).unflatten(-3, (q_blocks, block))  # (Bm, Hm, nQ, bq, nK, bk)
        any_blocks = tiles.any(dim=-1).any(dim=-2)
        all_blocks = tiles.all(dim=-1).all(dim=-2)

        def mask_mod(b, h, q_idx, kv_idx):
            return _at(allowed, b, h, q_idx, kv_idx)

        counts = allowed[..., :q_len, :].sum(-1)  # (Bm, Hm, q)
    partial = any_blocks & ~all_blocks
    block_mask = BlockMask.from_kv_blocks(
        *_indices(partial), *_indices(all_blocks), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(q_len, kv_len))
    return FlexMask(block_mask, counts.to(dtype).clamp_min(1.0).log())


def _padding_blocks(valid: torch.Tensor, q_len: int, kv_len: int, offset: int, causal: bool, block: int):
    """``(any, all)`` ``(Bm, 1, nQ, nK)`` of key padding ``valid`` ``(Bm, kv padded)`` with query ``i`` at key position
    ``i + offset`` (causal: it attends keys up to there), without the ``q x kv`` mask."""
    device = valid.device
    q_blocks = -(-q_len // block)
    keys = valid.unflatten(-1, (-1, block))  # (Bm, nK, bk)
    positions = torch.arange(keys.shape[1] * block, device=device).unflatten(-1, (-1, block))  # (nK, bk)
    first_valid = torch.where(keys, positions, kv_len).amin(-1)  # (Bm, nK): kv_len where none
    all_valid = keys.all(-1)  # (Bm, nK); a block past the end is never all valid (padded with False)
    starts = torch.arange(q_blocks, device=device) * block
    full_rows = (starts + block <= q_len)[:, None]  # a ragged last query block is never full
    any_blocks = (first_valid < kv_len)[:, None, :].expand(-1, q_blocks, -1)
    all_blocks = all_valid[:, None, :] & full_rows[None]
    if causal:
        last_row = (starts + block).clamp_max(q_len) - 1 + offset  # the block's last query's position
        first_row = starts + offset
        block_last_key = positions[:, -1]  # (nK,)
        any_blocks = any_blocks & (first_valid[:, None, :] <= last_row[None, :, None])
        all_blocks = all_blocks & (block_last_key[None, None, :] <= first_row[None, :, None])
    return any_blocks[:, None], all_blocks[:, None]


def _indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks (Bm, Hm, nQ), indices (Bm, Hm, nQ, nK))`` int32 of a bool block map: the selected blocks first."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), order.contiguous()


def _flex(q, k, v, score_mod, blocks, scale: float, gqa: bool, compiled: bool, max_scores: bool = False):
    """``(output (B, H_q, q, D_v), lse (B, H_q, q), the row's largest modified score (B, H_q, q) or None)`` from
    FlexAttention, compiled or eager; the maximum (no gradient) with ``max_scores``."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    options = dict(score_mod=score_mod, block_mask=blocks, scale=scale, enable_gqa=gqa,
                   return_aux=AuxRequest(lse=True, max_scores=max_scores))
    # Python numbers the score_mod reads (a family's constants) stay constants: a float Dynamo made symbolic after it
    # changed between calls breaks FlexAttention's backward graph on torch 2.13 ("could not guard on data-dependent
    # expression zuf0"). Shapes stay dynamic after a second length (no recompilation per decoded token).
    settings = dict(specialize_float=True, recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit))
    with torch._dynamo.config.patch(**settings):
        if not compiled:
            output, aux = flex_attention(q, k, v, **options)
            return output, aux.lse, aux.max_scores
        global _COMPILED
        if _COMPILED is None:
            _COMPILED = torch.compile(flex_attention)
        output, aux = _COMPILED(q, k, v, **options)
    return output, aux.lse, aux.max_scores


def cpu_blocker(normalization: Normalization) -> str:
    """Why this route's eager forward cannot run on the CPU for ``normalization`` (``""`` when it can): a ratio's two
    passes read FlexAttention's row maximum, which torch 2.13 returns on CUDA only."""
    if normalization.log_weight_ratio is not None:
        return "its two passes read FlexAttention's row maximum, which torch returns on CUDA only"
    return ""


def available() -> str:
    """``""`` when this torch has FlexAttention with ``return_aux`` (torch >= 2.9), else why not."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError:
        return f"FlexAttention with return_aux needs torch >= 2.9 (this is {torch.__version__})"
    return ""

