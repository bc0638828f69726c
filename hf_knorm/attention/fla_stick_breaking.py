"""Stick-breaking attention through flash-linear-attention's Triton kernel, with the contract of :mod:`.kernel`.

flash-linear-attention (``fla-core`` on PyPI, ``fla.ops.stickbreaking_attn.parallel_stickbreaking_attn``, after Tan,
Shen, Yang, Courville, Panda, "Scaling Stick-Breaking Attention", arXiv 2410.17980, and their
shawntan/stickbreaking-attention) computes, forward and backward in fused Triton kernels (no ``N x N`` tensor),

    o_i = sum_j A_ij v_j,      A_ij = sigma(z_ij) prod_{j < l <= i} (1 - sigma(z_il)),      z = scale * q_i . k_j,

with ``attend_current=True`` (a query attends its own key), GQA when the query heads are a multiple of the KV heads (K
and V are not repeated), and variable-length sequences packed in one row (``cu_seqlens``). That is the project's
stick-breaking family (:class:`~hf_knorm.normalizations.stick_breaking.StickBreaking`, whose capability
:class:`~hf_knorm.normalizations.routes.StickBreak` says a causal row counts its own key) exactly, on these calls:

- causal, as many queries as keys (a prefill, a training step): no mask, or key padding / an explicit bool mask that is
  causal with padded keys anywhere (left padding: a batched ``generate``'s prompts; right padding: a training batch).
  The real tokens of each item are packed into one sequence of ``cu_seqlens``: a real query attends the real keys at
  or before it, which are the packed ones at or before it, so fla computes every real row. A padded query row attends
  the real keys before it (none under left padding: its output is 0, as in the chunked kernel); the packed sequences
  have no row for it, so the rows of padding after a real key (right or inner padding) are computed by the PyTorch
  chunked kernel on those rows alone (``O(padded rows x keys)``; usually rows the loss ignores, computed all the same:
  the logits at every position are the chunked kernel's);
- no softcap, no additive bias, no learned values (the family has none), no attention dropout, no returned weights,
  no norm recording (the dispatcher, ``backends.py``, keeps those calls on the PyTorch chunked kernel);
- fp32, bf16 or fp16 inputs, head dimension at most 256 (fla's limits). fla computes in fp32 with its operands' dtype
  in the products (bf16 operands with fp32 accumulation; Triton's default TF32 for fp32 inputs on a GPU). So the
  automatic choice sends it fp32 calls only where TF32 is asked for (``backends.tf32_blocker``, the rule of both fla
  routes: ``torch.set_float32_matmul_precision("high")`` or ``"medium"``, or ``kernels(quadratic="fla")``); fp32
  inputs otherwise stay fp32 on the chunked kernel.

Everything else stays on the PyTorch chunked kernel (``kernel.py``): decoding (one query row against a cache: fla
takes as many keys as queries), a chunk of a prompt after a cache, sliding windows, packed sequences given as a mask.

On a CPU fla's kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) once its autotuner has one configuration
(with several it benchmarks them through a GPU driver): the tests do that
(``tests/attention/test_fla_stick_breaking.py``) in fp32, where the interpreter multiplies IEEE fp32 values. Under the
interpreter with fla-core 0.6.0, fp64 inputs give wrong key and value gradients (measured on 100 random tokens: largest
absolute errors 3.7 and 32 against fla's fp64 reference, where fp32 inputs give 7e-7 and 2e-6), so this module
refuses fp64.
``backends.py`` hands fla calls on a device only after it has passed its self-check there (``self_check.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..extras import require
from .kernel import chunked_attention
from .masks import CallLayout, KeyPadding, Mask
from ..normalizations import Normalization
from .paths import causal_key_validity

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def fla_stickbreaking_kernel() -> Callable:
    """fla's ``parallel_stickbreaking_attn``, or a clear error naming the extra."""
    require("fla", "flash-linear-attention's stick-breaking kernel (hf_knorm.attention.backends)")
    from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn

    return parallel_stickbreaking_attn


def layout_blocker(layout: CallLayout | None, softcap: float | None = None) -> str:
    """Why the kernel cannot compute a call of this layout (``""`` when it can; module docstring). Reads an explicit
    mask's values (eager mode only; compiled calls never reach a GPU kernel): once per forward."""
    if layout is None:
        return "a part of a composed call, such as a softmax window's (it computes whole calls only)"
    if softcap is not None:
        return "a softcap on the scores"
    if layout.bias is not None:
        return "an additive attention bias"
    if not layout.causal:
        return "bidirectional attention (no causal mask)"
    if layout.q_len != layout.kv_len:
        return (f"{layout.q_len} queries against {layout.kv_len} keys (it takes as many keys as queries: a prefill or "
                "a training step; decoding and a prompt after a cache stay on the PyTorch kernel)")
    return key_validity(layout.mask, layout.q_len, layout.kv_len)[0]


def key_validity(mask: Mask, q_len: int, kv_len: int) -> tuple[str, torch.Tensor | None]:
    """``(why not, key_valid)``: ``""`` and the ``(B, kv)`` bool validity of a causal mask with padded keys
    (``None``: every key real, the implicit causal mask), or the reason the mask is not one."""
    if mask is None:
        return "", None
    if isinstance(mask, KeyPadding):
        if not mask.causal:
            return "bidirectional attention (no causal mask)", None
        if mask.all_real:
            return "", None
        key_valid = mask.key_valid
    else:
        causal, key_valid = causal_key_validity(mask, q_len, kv_len)
        if not causal:
            return "the mask is not causal with padded keys (a sliding window, packed sequences or a custom mask)", None
    return "", key_valid


def fla_stick_breaking_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Mask,
    normalization: Normalization,
    *,
    scaling: float | None = None,
    causal: bool = True,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """Causal stick-breaking attention through fla; arguments and result as :func:`.kernel.chunked_attention`'s for
    the calls the module docstring lists.

    Args:
        query: ``(B, H_q, T, D)``; key ``(B, H_kv, T, D)``; value ``(B, H_kv, T, D_v)``; ``H_q % H_kv == 0``.
        mask: ``None`` (the causal mask), :class:`~.masks.KeyPadding` or a bool ``(B or 1, 1, T, T)`` mask, causal
            with padded keys.
        normalization: a family declaring :attr:`~hf_knorm.normalizations.Normalization.stick_break`.
        scaling: score scale (default ``D ** -0.5``); causal: must be true; bias, softcap: must be ``None``.
        kernel: a function with ``parallel_stickbreaking_attn``'s signature (default fla's own).

    Returns:
        ``output (B, T, H_q, D_v)`` in the query dtype (0 on a padded query row before every real key).

    Raises:
        ValueError: a call the kernel does not compute (the message says why).
    """
    form = normalization.stick_break
    if form is None:
        raise ValueError(f"fla's stick-breaking kernel computes stick-breaking weights (Normalization.stick_break), "
                         f"not {normalization.name}.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if query.dtype not in DTYPES:
        raise ValueError(f"fla's stick-breaking kernel takes fp32, bf16 or fp16 inputs, not {query.dtype} (module "
                         "docstring).")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    if max(head_dim, value.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"fla's stick-breaking kernel takes head dimensions up to {MAX_HEAD_DIM}, not "
                         f"{max(head_dim, value.shape[-1])}.")
    blocker = layout_blocker(CallLayout(mask, bias, causal, q_len, kv_len), softcap)
    if blocker:
        raise ValueError(f"fla's stick-breaking kernel cannot compute this call: {blocker}.")
    kernel = kernel or fla_stickbreaking_kernel()
    scaling = head_dim**-0.5 if scaling is None else scaling
    as_fla = lambda t: t.transpose(1, 2)  # noqa: E731  (B, H, T, D) -> (B, T, H, D)
    _, key_valid = key_validity(mask, q_len, kv_len)
    if key_valid is None:
        output, _ = kernel(as_fla(query), as_fla(key), as_fla(value), scale=scaling, attend_current=form.own_key)
        return output.to(query.dtype)
    key_valid = key_valid.expand(batch, kv_len)
    items, positions = key_valid.nonzero(as_tuple=True)  # the real tokens, item by item, in order
    shape = (batch, q_len, q_heads, value.shape[-1])
    if not len(items):  # no real key at all: every row attends nothing
        return query.new_zeros(shape)
    lengths = key_valid.sum(dim=-1)
    cu_seqlens = F.pad(lengths[lengths > 0].cumsum(0), (1, 0))  # (N + 1,) int64; items with no real token left out
    packed = lambda t: as_fla(t)[items, positions].unsqueeze(0)  # noqa: E731  (1, real tokens, H, D)
    output, _ = kernel(packed(query), packed(key), packed(value), scale=scaling, attend_current=form.own_key,
                       cu_seqlens=cu_seqlens)
    output = output.new_zeros(shape).index_put((items, positions), output[0])
    return _padded_rows(output, query, key, value, key_valid, normalization, scaling).to(query.dtype)


def _padded_rows(output, query, key, value, key_valid, normalization, scaling) -> torch.Tensor:
    """``output`` with each padded query row that has a real key before it (right or inner padding) computed by the
    chunked kernel over its item's keys (module docstring); the other rows as they are."""
    attending = ~key_valid & (key_valid.cumsum(dim=-1) > 0)  # (B, T): padded rows after a real key
    keys = torch.arange(key_valid.shape[-1], device=key_valid.device)
    for item in attending.any(dim=-1).nonzero().flatten().tolist():
        rows = attending[item].nonzero().flatten()
        allowed = (key_valid[item][None, :] & (keys[None, :] <= rows[:, None]))[None, None]  # (1, 1, rows, T)
        part, _ = chunked_attention(query[item:item + 1, :, rows], key[item:item + 1], value[item:item + 1], allowed,
                                    normalization, scaling=scaling)
        output = output.index_put((torch.full_like(rows, item), rows), part[0].to(output.dtype))
    return output
