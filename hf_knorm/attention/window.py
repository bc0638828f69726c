"""The composition around any family, ``base + softmax window W + sinks S`` (``+ sparse K + clusters C``:
:mod:`.sparse`, :mod:`.distant_clusters`): one function, :func:`window_attention`, whose ``sparse = 0`` case is
computed here. The plain reference is :func:`.reference.reference_window_attention`; why, and what it measured:
docs/normalizations.md, "A softmax window beside any family" (LoLCATs, arXiv 2410.10254; Liger, arXiv 2503.01496;
sinks: StreamingLLM, arXiv 2309.17453; the row normalization: TransNormer's NormAttention, arXiv 2210.10340).

Definition (ours). Query ``i`` sits at position ``a_i`` (under a causal mask its own, the last key it may attend);
``s_ij`` is the model's score (scaling, softcap and any additive mask included); ``w`` the base family's weights
(``x^p/c``: ``s^p / c_i``):

    o_i = sum_{j in window(i)} softmax_window(s_i)_j v_j  +  m_h * u_i / RMS(u_i),    u_i = sum_{j older} w(s_ij) v_j

- ``window(i)``: the keys ``a_i - W < j <= a_i`` and, with ``+ sinks S``, its sequence's first ``S`` real tokens, by
  position (they do not move with the query). Softmax over them alone: a convex combination of their values
  (Liger's window branch; not LoLCATs' joint denominator, which a sign-keeping ``x^3`` could make vanish).
- older: ``j <= a_i - W``, allowed, not a sink. ``c = sqrtN`` counts them (``c_i = sqrt`` of their number), the same
  rule in a prefill and in decoding.
- ``u_i / RMS(u_i)`` (per row and head, over the head dimension: :func:`row_scale`): without it the part grows with
  the number of older keys; with it ``c`` cancels and ``|m_h|`` is the part's size at every length. A row with no
  older key stays 0. ``m_h``: the per-query-head mix ``(H_q,)``, 1 when not given, a learnable parameter of a patched
  model (``m_h = 0``: the window alone, :func:`hf_knorm.models.window_mix.distant_part_off`).
- ``W = 0`` is not a window: the pure normalization on its own paths, bit for bit. Causal only: a bidirectional call
  has no "older" and raises.
- Masks. Key padding and bottom-right causal calls (every plain causal forward, with or without a cache): query ``i``
  at key ``kv - q + i``. An explicit mask (a model's own sliding window, packed sequences, a static cache, a user's
  mask): ``a_i`` is the last key row ``i`` may attend, and the two parts split what the mask allows (a model's own
  window ``W_m <= W`` leaves no older key). A padded query has no position: its output is finite and read by nothing
  (every real query agrees exactly between the paths).
- Sinks and masks. Key padding: each sequence's first ``S`` real keys (:func:`sink_keys`; a recurrent cache keeps
  them). An explicit mask: the first ``S`` keys each row may attend, its sequence's first tokens when every row
  attends its sequence from its start. A layer with its own sliding window leaves them behind, and so does its
  cache: the sinks are refused there (:func:`.reference.window_split` refuses such a mask too).

Paths (memory linear in ``N`` for a fixed ``W``):

- Key padding or none: the softmax part is one call of the chunked kernel on blocks of ``max(BAND_ROWS, W)`` queries
  and the keys their band covers, the sinks before them (:func:`_softmax_band`, ``O(N * (rows + W + S) * D)``); the
  base part is the pure normalization on the keys delayed by ``W`` (:func:`_older_keys`): any ``p`` on the chunked
  kernel, ``p = 1`` on the linear one (``O(N * W * D + N * D^2)``; decoding continues the state of the keys older than
  the window, :mod:`hf_knorm.recurrent.window_cache`). An unpadded call slices its sinks off (:func:`leading_sinks`);
  otherwise they are searched for and masked out of the base part like padding.
- An explicit mask, returned weights or recorded norms: both parts on the explicit masks ``allowed & window`` and
  ``allowed & older`` (:func:`_explicit`), quadratic; for ``p = 1`` a fallback from the linear path (warned on long
  inputs, an error under ``linear="require"``).

Kernels. The base part takes the kernel of a plain call of the pure normalization (:func:`.backends.with_kernel`: on
CUDA Triton for the quadratic path, flash-linear-attention for the linear one, decoding included); the softmax part
runs the PyTorch chunked kernel (:data:`SOFTMAX_PATH`: no GPU kernel of the plugin computes softmax, so a forced one
serves the base part). ``attention_paths()`` counts one entry per call, the base part's kernel (``"sparse"`` with a
sparse cache). Host reads: whether the keys are all real (:attr:`.masks.KeyPadding.all_real`) and whether a recurrent
cache's sinks are complete are read once per forward, not per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backends import run_linear, run_quadratic, with_kernel
from .compiled import compiled_attention
from .linear_kernel import is_linear
from .masks import KeyPadding, Mask
from ..normalizations import Normalization
from ..normalizations.windowed import WINDOW_PART
from .paths import Path, check_state_path, choose_path, linear_keys
from .sparse import sparse_attention, sparse_path
from .window_parts import (ROW_EPS, check_call, check_mix, check_state_window, leading_sinks, row_scale, scaled_part,
                           sink_columns, sink_keys, window_columns, without_sinks)

__all__ = ["BAND_ROWS", "ROW_EPS", "SOFTMAX_PATH", "leading_sinks", "row_scale", "sink_keys", "window_attention",
           "window_call_path", "window_path"]

BAND_ROWS = 32
"""Queries per block of the softmax part (at least ``W``, at most ``q``; read at call time): a block's scores are
``rows x (rows + W - 1)``, of which ``rows x W`` are in the window (all blocks in one kernel call)."""

SOFTMAX = WINDOW_PART
SOFTMAX_PATH = Path(linear=False, reason="the softmax part of a window: the PyTorch chunked kernel")
"""The softmax part's kernel: the PyTorch chunked kernel (the plugin's GPU kernels compute polynomial weights)."""


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Mask,
    normalization: Normalization,
    *,
    bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    causal: bool = True,
    return_weights: bool = False,
    frobenius_sq: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
    params: dict[str, torch.Tensor] | None = None,
    handover=None,
    codebook: torch.Tensor | None = None,
    path: Path | None = None,
    sliding_window: int | None = None,
    op: bool = False,
    compiling: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The composition: ``normalization.without_window`` beside a softmax window of ``normalization.window`` keys, its
    sinks, and its sparse cache and clusters if any (``sparse > 0``: :mod:`.sparse` computes it).

    Args:
        query: ``(B, H_q, q, D)``; key, value ``(B, H_kv, kv, D)``, not repeated for GQA.
        mask: as :func:`.interface.read_mask` gives it: :class:`~.masks.KeyPadding`, a bool ``(B or 1, 1 or H_q, q,
            kv)`` mask, or ``None`` (with ``causal``: sdpa's top-left causal mask, keys cut to ``q`` when ``q > 1``).
        normalization: a normalization with ``window > 0`` (not softmax).
        bias: an additive float mask of the explicit mask's shape, or ``None`` (not with a sparse cache).
        scaling, softcap, dropout: as the kernels take them (dropout on both parts' weights; not with a sparse cache).
        causal: the call is causal (required).
        return_weights: also return the ``(B, H_q, q, kv)`` weights of both parts (materialized).
        frobenius_sq: optional ``(B, H_kv, G)`` accumulator of each head's squared Frobenius norm (the parts attend
            disjoint keys: their squares add; the base part's counts ``m_h^2`` times).
        mix: ``(H_q,)`` factors of the base part, or ``None`` (1).
        params: the base family's learnable values, ``(H_q,)`` each.
        handover: a recurrent state handed over by a window cache layer (:class:`~.taps.WindowStateHandover`, with a
            sparse cache :class:`~.taps.SparseWindowStateHandover`), or ``None``.
        codebook: ``(H_kv, C, D)`` the layer's cluster codebook, with ``+ clusters C`` (required then).
        path: the path as the attention function chose and counted it (:func:`window_call_path`); ``None``: chosen
            here, from the same arguments.
        sliding_window: the layer's own sliding window (Transformers' ``sliding_window`` keyword), or ``None``.
        op: run the quadratic parts through the custom op (``compiled.py``: compiled code with no tap).
        compiling: traced by ``torch.compile``: nothing reads tensor values (the chunked kernel keeps every key).

    Returns:
        ``(output (B, q, H_q, D_v) in the query dtype, weights or None)``.

    Raises:
        ValueError: a call the composition does not define (:func:`window_path`), a mix of another shape, or a state
            that the call cannot continue.
    """
    if path is None:
        path = window_call_path(query, key.shape[2], mask, bias, normalization, causal=causal, softcap=softcap,
                                dropout=dropout, return_weights=return_weights, recording=frobenius_sq is not None,
                                has_state=handover is not None, compiling=compiling, sliding_window=sliding_window)
    check_state_window(handover, normalization)
    check_mix(mix, query)
    if normalization.sparse:
        return sparse_attention(query, key, value, mask, normalization, scaling=scaling, softcap=softcap,
                                return_weights=return_weights, frobenius_sq=frobenius_sq, mix=mix, params=params,
                                handover=handover, codebook=codebook)
    options = dict(scaling=scaling, softcap=softcap, dropout=dropout, op=op, compiling=compiling, params=params)
    dtype = query.dtype  # the parts are computed and added in fp32 (fp64 for fp64 inputs), as the kernels compute
    compute = torch.promote_types(dtype, torch.float32)
    query, key, value = query.to(compute), key.to(compute), value.to(compute)
    if _explicit_route(mask, bias, return_weights, frobenius_sq is not None):
        output, weights = _explicit(query, key, value, mask, normalization, bias, return_weights, frobenius_sq, mix,
                                    path, options)
        return output.to(dtype), weights
    if mask is None:
        key, value = linear_keys(query, key, value, None, causal=True)
    # None: every key is real (read once per forward, not while compiling: compiled code keeps the tensor)
    key_valid = None if mask is None or (not compiling and mask.all_real) else mask.key_valid
    sinks, older_key, older_value, older_valid = None, key, value, key_valid
    if normalization.sinks and handover is None and key_valid is None:  # the first S keys: sliced off, no mask
        sinks = leading_sinks(key, value, normalization.sinks)
        count = sinks.position.shape[-1]
        older_key, older_value = key[:, :, count:], value[:, :, count:]
    elif normalization.sinks:  # searched for, and masked out of the polynomial part like padding
        sinks = sink_keys(key, value, key_valid, normalization.sinks, query.shape[2], handover,
                          source=None if mask is None else mask.source)
        older_valid = without_sinks(key_valid, sinks, key.shape[0], key.shape[2])
    output = _softmax_band(query, key, value, key_valid, normalization.window, sinks, frobenius_sq, options)
    polynomial = _older_keys(query, older_key, older_value, older_valid, normalization, path, mix,
                             handover, options)
    if polynomial is not None:
        output = output + polynomial
    return output.to(dtype), None


def window_path(normalization: Normalization, q_len: int, kv_len: int, mask: Mask, bias: torch.Tensor | None, *,
                causal: bool, softcap: float | None, dropout: float, return_weights: bool, has_state: bool,
                compiling: bool = False, recording: bool = False, sliding_window: int | None = None) -> Path:
    """The path of a call of :func:`window_attention` (the arguments of :func:`.paths.choose_path`, which gives the
    base part's for ``sparse = 0``, the softmax part being linear in ``N`` on either; with a sparse cache
    :func:`.sparse.sparse_path`), once the call is checked.

    Raises:
        ValueError: ``normalization`` has no window or is softmax, the call is bidirectional, it has sinks or a sparse
            cache and the layer its own ``sliding_window``, or a sparse cache meets what it does not compute (a bias,
            dropout, clusters under a softcap; with a state: a base that is not ``p = 1``, returned weights, a softcap).
    """
    check_call(normalization, mask, causal=causal, sliding_window=sliding_window, bias=bias, dropout=dropout,
               softcap=softcap, return_weights=return_weights, has_state=has_state)
    if normalization.sparse:
        return sparse_path(normalization, q_len, kv_len, has_state, softcap=softcap, return_weights=return_weights,
                           recording=recording)
    polynomial = normalization.without_window
    if _explicit_route(mask, bias, return_weights, recording):
        reason = ("the attention weights were requested" if return_weights
                  else "the attention norms are recorded (the polynomial part's rows are normalized one by one)"
                  if recording else "an explicit mask (sliding window, packed sequences, a static cache or a custom "
                  "mask) or an additive bias with a softmax window")
        return Path(linear=False, reason=reason, fallback=is_linear(polynomial))
    if mask is None and q_len > 1:
        kv_len = q_len  # sdpa's top-left causal mask: the keys are cut to the queries (linear_keys)
    rows, older = _older_shape(q_len, kv_len, normalization.window)
    older_mask = None if mask is None else mask.first(older, rows)
    return choose_path(polynomial, rows, older, older_mask, None, causal=True, softcap=softcap, dropout=dropout,
                       return_weights=False, has_state=has_state, compiling=compiling)


def window_call_path(query: torch.Tensor, kv_len: int, mask: Mask, bias: torch.Tensor | None,
                     normalization: Normalization, *, causal: bool, softcap: float | None, dropout: float,
                     return_weights: bool, recording: bool, has_state: bool, compiling: bool,
                     sliding_window: int | None) -> Path:
    """:func:`window_path` with the base part's kernel named (:func:`.backends.with_kernel`; the sparse paths and the
    softmax part run the PyTorch kernels, :data:`SOFTMAX_PATH`): what the attention function counts and hands over.

    Raises:
        ValueError: as :func:`window_path`, or a state handed over to a call that is not linear.
    """
    path = window_path(normalization, query.shape[2], kv_len, mask, bias, causal=causal, softcap=softcap,
                       dropout=dropout, return_weights=return_weights, has_state=has_state, compiling=compiling,
                       recording=recording, sliding_window=sliding_window)
    if not normalization.sparse:
        path = with_kernel(path, query, normalization.without_window, dropout=dropout, return_weights=return_weights,
                           recording=recording, compiling=compiling, softcap=softcap, sdpa=False)
    check_state_path(path, has_state)
    return path


def _explicit_route(mask: Mask, bias, return_weights: bool, recording: bool) -> bool:
    return isinstance(mask, torch.Tensor) or bias is not None or return_weights or recording


def _older_shape(q_len: int, kv_len: int, window: int) -> tuple[int, int]:
    """``(rows, older)``: the queries ``q - rows ..`` that have a key older than their window, and the keys
    ``0 .. older - 1`` older than the window of every one of them (query ``i`` at ``kv - q + i``)."""
    older = max(0, kv_len - window)
    return min(q_len, older), older


def _softmax_band(query, key, value, key_valid, window, sinks, frobenius_sq, options) -> torch.Tensor:
    """The softmax part under a bottom-right causal mask: ``(B, q, H_q, D_v)``.

    One call of the chunked kernel on the queries cut into blocks of ``rows``, each block a batch entry with the
    ``rows + W - 1`` keys its windows cover (``unfold``: the keys are copied about ``1 + W / rows`` times, no
    ``N x N`` tensor). In block coordinates query ``r`` sees keys ``r .. r + W - 1``, the same band in every block;
    the keys before the first and the queries after the last are padding, masked out. ``sinks`` (:func:`sink_keys`):
    their ``S`` keys are put before every block's, attended by the queries they are older than the window of (a
    younger sink is in the band already)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rows = min(q_len, max(BAND_ROWS, window))
    blocks, span = -(-q_len // rows), rows + window - 1
    first = kv_len - q_len - window + 1  # the key index the first block's span starts at (< 0: padding before)
    front, back = max(0, -first), blocks * rows - q_len  # zero keys before key 0, after the last key
    valid = (key.new_ones(batch, kv_len, dtype=torch.bool) if key_valid is None
             else key_valid.expand(batch, kv_len))[:, max(0, first):]
    valid = F.pad(valid, (front, back), value=False).unfold(1, span, rows)  # (B, blocks, span)
    k, v = (F.pad(tensor[:, :, max(0, first):], (0, 0, front, back)).unfold(2, span, rows)  # (B, H_kv, T, D, span)
            .permute(0, 2, 1, 4, 3).reshape(batch * blocks, kv_heads, span, -1) for tensor in (key, value))
    q = (F.pad(query, (0, 0, 0, back)).view(batch, q_heads, blocks, rows, dim)
         .transpose(1, 2).reshape(batch * blocks, q_heads, rows, dim))
    row_positions = torch.arange(rows, device=query.device)[:, None] + window - 1  # in the span's coordinates
    band = window_columns(torch.arange(span, device=query.device), row_positions, window)  # (rows, span)
    real_rows = (torch.arange(blocks * rows, device=query.device) < q_len).view(blocks, rows, 1)
    allowed = (band & real_rows)[None] & valid[:, :, None, :]  # (B, T, rows, span)
    if sinks is not None:
        k, v, allowed, span = _with_sinks(key, value, k, v, allowed, sinks, window, kv_len - q_len, real_rows)
    block_sq = None if frobenius_sq is None else frobenius_sq.new_zeros(batch * blocks, *frobenius_sq.shape[1:])
    output, _ = _quadratic(SOFTMAX_PATH, q, k, v, allowed.reshape(batch * blocks, 1, rows, span), SOFTMAX,
                           frobenius_sq=block_sq, trim_keys=rows > 1, **options)
    if block_sq is not None:
        frobenius_sq += block_sq.view(batch, blocks, *frobenius_sq.shape[1:]).sum(dim=1)
    return output.reshape(batch, blocks * rows, q_heads, -1)[:, :q_len]


def _with_sinks(key, value, k, v, allowed, sinks, window, offset, real_rows):
    """The band's blocks ``k, v`` ``(B * T, H_kv, span, D)`` and ``allowed`` ``(B, T, rows, span)`` with the sinks'
    keys put first: ``(k, v, allowed, span + S)``. Query ``r`` of block ``t`` sits at ``offset + t * rows + r``."""
    batch, kv_heads = key.shape[:2]
    blocks, rows = real_rows.shape[:2]
    count = sinks.position.shape[-1]
    k_sink, v_sink = (tensor[:, None].expand(-1, blocks, -1, -1, -1).reshape(batch * blocks, kv_heads, count, -1)
                      for tensor in (sinks.keys, sinks.values))
    position = offset + torch.arange(blocks * rows, device=key.device).view(1, blocks, rows, 1)
    sink_allowed = sink_columns(sinks, batch, position, window) & real_rows[None]  # (B, T, rows, S)
    allowed = torch.cat([sink_allowed, allowed], dim=-1)
    return torch.cat([k_sink, k], dim=2), torch.cat([v_sink, v], dim=2), allowed, allowed.shape[-1]


def _older_keys(query, key, value, key_valid, normalization, path, mix, handover, options):
    """The polynomial part ``(B, q, H_q, D_v)``, ``None`` when no query has a key older than its window: queries
    ``q - rows ..`` on the keys ``0 .. older - 1``, bottom-right causal, on ``path`` (``key_valid`` ``None``: every
    key real)."""
    batch, _, q_len, _ = query.shape
    rows, older = _older_shape(q_len, key.shape[2], normalization.window)
    if rows == 0:  # every key is inside its query's window (and no state was kept: the cache holds W keys first)
        if handover is not None:
            handover.write(*handover.read())
        return None
    polynomial, start = normalization.without_window, q_len - rows
    q, k, v = query[:, :, start:], key[:, :, :older], value[:, :, :older]
    # the path's key validity, or the keys without the sinks (the path was chosen on the mask, sinks or not)
    linear_valid = (None if key_valid is None else key_valid[:, :older]) if normalization.sinks else path.key_valid
    if path.linear and handover is not None:
        state, count = handover.read()
        output, state, count = run_linear(path, q, k, v, linear_valid, polynomial, scaling=options["scaling"],
                                          initial_state=state, initial_count=count, return_state=True)
        handover.write(state, count)
    elif path.linear:
        output = run_linear(path, q, k, v, linear_valid, polynomial, scaling=options["scaling"])
    else:
        if key_valid is None and rows in (1, older):  # the kernel's implicit causal mask is this one
            allowed = None
        else:
            older_valid = k.new_ones(batch, older, dtype=torch.bool) if key_valid is None else key_valid[:, :older]
            allowed = KeyPadding(older_valid, rows, causal=True).dense()
        output, _ = _quadratic(path, q, k, v, allowed, polynomial, trim_keys=rows > 1, **options)
    output = output * row_scale(output)  # (B, rows, H_q, D): each row's RMS to 1, then the mix (this order: the
    if mix is not None:  # saved release-0 logits are bit for bit, tests/normalizations/test_release_0_checkpoints.py)
        output = output * mix.to(output.dtype)[None, None, :, None]
    return F.pad(output, (0, 0, 0, 0, start, 0))


def _explicit(query, key, value, mask, normalization, bias, return_weights, frobenius_sq, mix, path, options):
    """Both parts with the chunked kernel on explicit masks (see the module docstring)."""
    if mask is None:
        key, value = linear_keys(query, key, value, None, causal=True)
        positions = torch.arange(key.shape[2], device=query.device)
        allowed = (positions[None, :] <= positions[: query.shape[2], None] + key.shape[2] - query.shape[2])[None, None]
    else:
        allowed = mask.dense() if isinstance(mask, KeyPadding) else mask[..., : key.shape[2]]
    positions = torch.arange(allowed.shape[-1], device=query.device)
    last = torch.where(allowed, positions, -1).amax(dim=-1, keepdim=True)  # a_i: the last key row i may attend
    # the first S keys each row may attend: its sequence's first S tokens, as every row here attends its sequence from
    # its start (a layer with its own sliding window refuses sinks: window_path)
    sinks = allowed & (allowed.cumsum(dim=-1) <= normalization.sinks)
    in_window = allowed & (window_columns(positions, last, normalization.window) | sinks)
    options = dict(options, return_weights=return_weights, bias=bias)
    soft, soft_weights = _quadratic(SOFTMAX_PATH, query, key, value, in_window, SOFTMAX, frobenius_sq=frobenius_sq,
                                    **options)
    weighted = return_weights or frobenius_sq is not None  # the rows' scales apply to the weights: materialize them
    poly, poly_weights = scaled_part(*_quadratic(path, query, key, value, allowed & ~in_window,
                                                 normalization.without_window, **dict(options, return_weights=weighted)),
                                     mix, frobenius_sq)
    return soft + poly, (soft_weights + poly_weights if return_weights else None)


def _quadratic(path, query, key, value, allowed, normalization, *, scaling, softcap, dropout, op, compiling,
               params=None, frobenius_sq=None, bias=None, return_weights=False, trim_keys=True):
    """The quadratic kernel ``path`` names (:func:`.backends.run_quadratic`), or the custom op (compiled code with
    no tap, no dropout, no weights). ``trim_keys``: let the PyTorch kernel skip the keys no row of a chunk attends
    (one read of the mask's ranges to the host per call; a single query row attends every key of its part, so the
    callers pass ``False`` there, and compiled code never reads)."""
    if op and dropout == 0.0 and not return_weights and frobenius_sq is None:
        return compiled_attention(query, key, value, allowed, bias, normalization, scaling=scaling, softcap=softcap,
                                  causal=allowed is None, params=params), None
    return run_quadratic(path, query, key, value, allowed, normalization, bias=bias, scaling=scaling, softcap=softcap,
                         dropout=dropout, causal=allowed is None, return_weights=return_weights,
                         frobenius_sq=frobenius_sq, trim_keys=trim_keys and not compiling, params=params)


