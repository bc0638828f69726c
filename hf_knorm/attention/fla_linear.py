"""``x/c`` and ``x/sqrtN`` through flash-linear-attention's kernels, with the contract of :mod:`.linear_kernel`.

flash-linear-attention (``fla-core`` on PyPI, ``fla.ops.linear_attn``; Yang et al., arXiv 2312.06635) computes
causal linear attention with ``normalize=False``:

    o_t = scale * q_t^T S_t,      S_t = S_0 + sum_{j <= t} k_j v_j^T,

in chunked Triton kernels, forward and backward (``chunk_linear_attn``), and a fused recurrent one for decoding
(``fused_recurrent_linear_attn``), with an initial state in and the final state out. That is the project's ``p = 1``
path (``linear_kernel.py``) exactly, once its conventions are mapped:

- ``x/c``: ``scale = scaling`` and the output divided by ``c``; ``x/sqrtN``: each row divided by the square root of
  its count of valid keys (``linear_kernel._row_scale``: a factor per row, applied after the kernel);
- padded keys: zeroed in K and V, so they add nothing to any state (as ``linear_kernel.py`` does);
- a cache longer than the queries (bottom-right causal, ``kv > q``): the prefix's ``K^T V`` is added to the initial
  state, which every query sees;
- GQA: fla's ``linear_attn`` takes as many K/V heads as query heads, so K and V are repeated per group (linear in N)
  and the state kept is one per KV head (the group's heads hold the same state);
- layouts: fla reads ``(B, T, H, D)``; its output ``(B, q, H_q, D_v)`` is the project's output layout already.

fla computes in its kernels' precision (fp32 sums; bf16 inputs stay bf16 on the way in). Its kernels need a GPU: they
do not run under Triton's interpreter (with fla-core 0.6.0 and Triton 3.9.0: its autotuner benchmarks every config
through the active GPU driver, and there is none on a CPU; past that, ``fla/ops/common/chunk_h.py`` calls ``.to`` on
a loop index that the interpreter keeps as a Python ``int``). ``kernels=`` lets the tests put fla's own plain
reference (``fla.ops.linear_attn.naive.naive_recurrent_linear_attn``, same signature) in their place on a CPU.
``backends.py`` hands fla calls on a device only after it has passed its self-check there (``self_check.py``:
against the PyTorch linear kernel, a prefill and a decoding step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..extras import require
from .linear_kernel import _row_scale, is_linear
from ..normalizations import Normalization


def fla_kernels() -> tuple[Callable, Callable]:
    """``(chunk_linear_attn, fused_recurrent_linear_attn)`` from fla, or a clear error naming the extra."""
    require("fla", "The flash-linear-attention path for x/1 (hf_knorm.attention.backends)")
    from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

    return chunk_linear_attn, fused_recurrent_linear_attn


def fla_linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    normalization: Normalization,
    *,
    scaling: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_count: torch.Tensor | None = None,
    return_state: bool = False,
    kernels: tuple[Callable, Callable] | None = None,
):
    """Causal ``p = 1`` attention through fla; arguments and results as :func:`.linear_kernel.linear_attention`
    (without ``frobenius_sq``: the norm recorder's calls take the project's kernel).

    Args:
        query: ``(B, H_q, q, D)``; key ``(B, H_kv, kv, D)``; value ``(B, H_kv, kv, D_v)``; ``kv >= q``.
        key_valid: bool ``(B, kv)`` or ``None``; normalization: ``x/c`` or ``x/sqrtN``; scaling: default ``D ** -0.5``.
        initial_state: ``(B, H_kv, D, D_v)`` state of earlier keys; initial_count: ``(B,)`` their valid count.
        return_state: also return the state after the last key ``(B, H_kv, D, D_v)`` and the count ``(B,)``.
        kernels: ``(chunked, recurrent)`` functions with fla's ``linear_attn`` signature; default fla's own.

    Returns:
        ``output (B, q, H_q, D_v)`` in the query dtype; with ``return_state`` also the state and the count (fp32).
    """
    if not is_linear(normalization):
        raise ValueError(f"flash-linear-attention computes p = 1 normalizations (x/c, x/sqrtN), not "
                         f"{normalization.name}.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} key-value heads.")
    if kv_len < q_len:
        raise ValueError(f"The linear path needs at least as many keys as queries (causal), got {kv_len} < {q_len}.")
    chunked, recurrent = kernels or fla_kernels()
    groups = q_heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    if key_valid is not None:
        invalid = ~key_valid[:, None, :, None]
        key, value = key.masked_fill(invalid, 0.0), value.masked_fill(invalid, 0.0)
    prefix = kv_len - q_len
    state = initial_state.float() if initial_state is not None else None
    if prefix:  # keys every query sees (the cache): into the state
        cached = key[:, :, :prefix].float().transpose(-1, -2) @ value[:, :, :prefix].float()
        state = cached if state is None else state + cached
    if state is not None:
        state = state.repeat_interleave(groups, dim=1)  # (B, H_q, D, D_v): one per query head, as fla keeps it
    as_fla = lambda t: t.repeat_interleave(groups, dim=1).transpose(1, 2)  # noqa: E731  (B, H, T, D) -> (B, T, H_q, D)
    kernel = recurrent if q_len == 1 else chunked
    output, final = kernel(query.transpose(1, 2), as_fla(key[:, :, prefix:]), as_fla(value[:, :, prefix:]),
                           scale=scaling, initial_state=state, output_final_state=return_state, normalize=False)
    row_scale = _row_scale(normalization, key_valid, initial_count, prefix, q_len, batch, torch.float32, query.device)
    output = (output.float() * row_scale[:, :, None, None]).to(query.dtype)  # (B, q, H_q, D_v)
    if not return_state:
        return output
    valid = kv_len if key_valid is None else key_valid.sum(dim=-1)
    count = (torch.zeros(batch, device=query.device) if initial_count is None else initial_count.float()) + valid
    return output, final.float()[:, ::groups], count
