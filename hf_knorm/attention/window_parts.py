"""What every path of the composition (:mod:`.window`, :mod:`.sparse`, :mod:`.window_off`) shares, written once: the
attention sinks and where each row weights them, the window's keys of each row, the part beside the window brought
to RMS 1 and mixed, and the checks of a call (definitions: :mod:`.window`'s docstring)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .linear_kernel import is_linear
from .masks import KeyPadding, Mask, read_once
from ..normalizations import Normalization
from .taps import SparseWindowStateHandover


class Sinks(NamedTuple):
    """The attention sinks of one call: each sequence's first ``S`` real keys (StreamingLLM, arXiv 2309.17453).

    Attributes:
        keys, values: ``(B, H_kv, S', D)``, ``S' <= S`` (fewer while a sequence has fewer keys).
        position: ``(B or 1, S')`` long: each sink's index among the call's keys; negative for a sink that a recurrent
            cache kept from before the call's keys (older than every query's window).
        valid: ``(B or 1, S')`` bool: False where a sequence has fewer than ``S'`` real keys.
    """

    keys: torch.Tensor
    values: torch.Tensor
    position: torch.Tensor
    valid: torch.Tensor


def leading_sinks(key: torch.Tensor, value: torch.Tensor, sinks: int) -> Sinks:
    """The :class:`Sinks` of a call whose first keys are its sequences' first real ones (no padding, no recurrent
    state): the first ``min(S, kv)`` keys and values, by slicing. The polynomial part then reads the keys after them
    (a contiguous range, no mask), which :func:`sink_keys` and :func:`without_sinks` give for any padding."""
    count = min(sinks, key.shape[2])
    position = torch.arange(count, device=key.device)[None]
    return Sinks(key[:, :, :count], value[:, :, :count], position, torch.ones_like(position, dtype=torch.bool))


def sink_keys(key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None, sinks: int, q_len: int,
              handover=None, source: torch.Tensor | None = None) -> Sinks | None:
    """The :class:`Sinks` of a bottom-right causal call with ``key``, ``value`` ``(B, H_kv, kv, D)`` (``None``: no
    key yet).

    Without ``handover`` the call holds every key of its sequences: the sinks are the first ``S`` real ones. With a
    recurrent window layer (:mod:`hf_knorm.recurrent.window_cache`: its ``sinks``, ``keep_sinks`` and
    ``cumulative_length``) the call holds the last kept keys and the step's ``q_len`` new ones: the sinks are the first
    ``S`` real keys among the layer's kept sinks and the new keys, and are kept for the next step; once every
    sequence has its ``S`` (read eagerly), the kept ones are returned without a search. ``source``: the mask tensor
    the call's ``key_valid`` was cut from (:class:`~.masks.KeyPadding`), shared by every layer of the forward: whether
    the sinks are complete is read once per forward (every layer of a cache has seen the same keys' validity)."""
    kv_len = key.shape[2]
    if kv_len == 0:
        return None
    positions = torch.arange(kv_len, device=key.device)
    valid = key.new_ones(1, kv_len, dtype=torch.bool) if key_valid is None else key_valid
    if handover is None:
        candidates = Sinks(key, value, positions[None], valid)
    else:  # the kept sinks (absolute positions) and the step's keys, the only ones not seen before
        first = handover.cumulative_length - kv_len  # the absolute position of the call's key 0
        if handover.sinks_complete:  # every sequence holds its S sinks: no later key is one
            return handover.sinks._replace(position=handover.sinks.position - first)
        new = slice(kv_len - q_len, kv_len)
        step = Sinks(key[:, :, new], value[:, :, new], positions[None, new] + first, valid[:, new])
        candidates = step if handover.sinks is None else _concatenated(handover.sinks, step)
    batch = max(candidates.position.shape[0], candidates.valid.shape[0])
    position, valid = candidates.position.expand(batch, -1), candidates.valid.expand(batch, -1)
    order = torch.where(valid, position, position + 2 * (position.amax() + 1))  # real keys first, in order
    index = order.topk(min(sinks, order.shape[1]), dim=-1, largest=False, sorted=True).indices  # (B, S')
    gather = lambda tensor: tensor.gather(  # noqa: E731
        2, index.expand(tensor.shape[0], -1)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1]))
    chosen = Sinks(gather(candidates.keys), gather(candidates.values), position.gather(1, index),
                   valid.gather(1, index))
    if handover is None:
        return chosen
    complete = chosen.position.shape[-1] == sinks and not torch.compiler.is_compiling()
    if complete:
        read = lambda: bool(chosen.valid.all())  # noqa: E731
        complete = read() if source is None else read_once(source, ("sinks complete", handover.cumulative_length), read)
    handover.keep_sinks(chosen, complete)
    return chosen._replace(position=chosen.position - first)


def window_columns(key_position: torch.Tensor, row_position: torch.Tensor, window: int) -> torch.Tensor:
    """Whether each key is in each row's window, ``a_i - W < j <= a_i`` (positions broadcast against each other): the
    window's mask of every path (the band's, the explicit masks', :mod:`.sparse`'s rows)."""
    return (key_position > row_position - window) & (key_position <= row_position)


def sink_columns(sinks: Sinks, batch: int, row_position: torch.Tensor, window: int) -> torch.Tensor:
    """``(B, ..., r, S')`` for rows at ``row_position`` ``(..., r, 1)`` (the sinks' coordinates): the sinks each row
    weights beside its window, the real ones older than it (a younger sink is in the window already)."""
    position, valid = sinks.position.expand(batch, -1), sinks.valid.expand(batch, -1)
    return valid[:, None, None, :] & (position[:, None, None, :] <= row_position - window)


def _concatenated(kept: Sinks, step: Sinks) -> Sinks:
    batch = max(step.valid.shape[0], kept.valid.shape[0])
    return Sinks(torch.cat([kept.keys, step.keys], dim=2), torch.cat([kept.values, step.values], dim=2),
                 torch.cat([kept.position.expand(batch, -1), step.position.expand(batch, -1)], dim=1),
                 torch.cat([kept.valid.expand(batch, -1), step.valid.expand(batch, -1)], dim=1))


def without_sinks(key_valid: torch.Tensor | None, sinks: Sinks | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """``key_valid`` ``(B or 1, kv)`` (``None``: every key real) with the call's sinks (:func:`sink_keys`) marked
    not valid, ``(B, kv)``: the keys the polynomial part reads. Unchanged without sinks."""
    if sinks is None:
        return key_valid
    valid = sinks.valid.new_ones(1, kv_len) if key_valid is None else key_valid
    positions = torch.arange(kv_len, device=valid.device)
    is_sink = ((positions[None, :, None] == sinks.position[:, None, :]) & sinks.valid[:, None, :]).any(dim=-1)
    return valid.expand(batch, kv_len) & ~is_sink


def row_scale(output: torch.Tensor) -> torch.Tensor:
    """``1 / RMS`` of each output row of the base part over its last axis (the head dimension): ``(..., 1)``.
    ``ROW_EPS`` is added to the mean square: rows of RMS well above ``1e-6`` are normalized exactly, and no gradient is
    infinite (without it, a padded row with a denormal mean square made the x^3/16 conversion's gradients NaN at
    recovery step ~125)."""
    return torch.rsqrt(output.pow(2).mean(dim=-1, keepdim=True) + ROW_EPS)


ROW_EPS = 1e-12
"""Added to each row's mean square before the polynomial part's RMS normalization (:func:`row_scale`)."""


def part_factor(part: torch.Tensor, mix: torch.Tensor | None, shape: tuple[int, ...] = (1, 1, -1, 1)) -> torch.Tensor:
    """What the part beside the window is multiplied by, ``m_h / RMS(u_i)``: ``(..., 1)`` for a part ``u``
    ``(..., D_v)`` (``(B, q, H_q, D_v)`` here, ``(B, H_kv, G, r, D_v)`` in :mod:`.sparse`) and a mix ``(H_q,)``
    (``None``: 1) viewed as ``shape`` against it. The band path applies the same two factors one after the other."""
    factor = row_scale(part)
    return factor if mix is None else factor * mix.to(part.dtype).view(shape)


def check_mix(mix: torch.Tensor | None, query: torch.Tensor) -> None:
    """Raise a ValueError unless ``mix`` is ``None`` or ``(H_q,)`` for ``query`` ``(B, H_q, q, D)``."""
    if mix is not None and tuple(mix.shape) != (query.shape[1],):
        raise ValueError(f"mix scales the part beside the window per query head: shape ({query.shape[1]},), got "
                         f"{tuple(mix.shape)}.")


def check_causal(normalization: Normalization, mask: Mask, causal: bool) -> None:
    """Raise a ValueError for a bidirectional call: a softmax window (and its sinks, sparse cache, clusters) weights
    the keys before a query."""
    if not causal or (isinstance(mask, KeyPadding) and not mask.causal):
        raise ValueError(f"{normalization.name}: a softmax window weights the keys before a query; this call is "
                         "bidirectional (an encoder). Use the normalization without softmax_window on encoders.")


def scaled_part(part: torch.Tensor, weights: torch.Tensor | None, mix: torch.Tensor | None,
                frobenius_sq: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The part beside the window ``(B, q, H_q, D_v)`` times :func:`part_factor`, and its weights ``(B, H_q, q, kv)``
    (or ``None``) scaled alike, their squares added to ``frobenius_sq`` (the explicit masks, :mod:`.window_off`)."""
    factor = part_factor(part, mix)  # (B, q, H_q, 1)
    if weights is not None:
        weights = weights * factor.permute(0, 2, 1, 3)
        if frobenius_sq is not None:
            frobenius_sq += weights.detach().to(frobenius_sq.dtype).square().sum(dim=(-2, -1)).view_as(frobenius_sq)
    return part * factor, weights


def check_call(normalization: Normalization, mask: Mask, *, causal: bool, sliding_window: int | None,
               bias: torch.Tensor | None, dropout: float, softcap: float | None, return_weights: bool,
               has_state: bool) -> None:
    """Raise a ValueError for a call the composition does not define: ``normalization`` has no window or is softmax,
    the call is bidirectional, it has sinks or a sparse cache and the layer its own ``sliding_window``, or a sparse
    cache meets what it does not compute (a bias, dropout, clusters under a softcap; with a state: a base family that
    is not ``p = 1``, returned weights, a softcap)."""
    name = normalization.name
    if normalization.window <= 0 or normalization.is_softmax:
        raise ValueError(f"window_attention computes a polynomial normalization with a softmax window, not {name}.")
    check_causal(normalization, mask, causal)
    if normalization.sinks and sliding_window is not None:
        raise ValueError(f"{name}: attention sinks are each sequence's first {normalization.sinks} tokens, and this "
                         f"layer has its own sliding window of {sliding_window} positions, which leaves them behind (as "
                         "its cache does). Patch this model without attention_sinks (attention_sinks=0; hf-knorm "
                         "convert --attention-sinks 0: the softmax window alone), or use a model without "
                         "sliding-window layers.")
    if not normalization.sparse:
        return
    refusals = [
        (sliding_window is not None, f"this layer has its own sliding window of {sliding_window} positions, which "
         "leaves the sparse cache's older pairs behind. Patch this model without the sparse cache."),
        (bias is not None, "an additive attention bias with a sparse cache is not supported."),
        (normalization.clusters and softcap is not None, "a softcap bends each score, so a cluster's mean key no "
         "longer gives its pairs' mean score; clusters are not supported with a softcap (Gemma 2). Patch without "
         "clusters."),
        (dropout, "attention dropout with a sparse cache is not implemented; set the model's attention_dropout to 0."),
        (has_state and not is_linear(normalization.without_window), "a recurrent state continues a p = 1 base part "
         "only; decode this model with a normal cache (cache=DynamicCache())."),
        (has_state and return_weights, "the attention weights cannot be returned while decoding from a recurrent "
         "state (the distant pairs are summed into it). Generate with a normal cache."),
        (has_state and softcap is not None, "a softcap makes the base part non-linear in the keys, so a recurrent "
         "state cannot continue it. Generate with a normal cache."),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{name}: {why}")


def check_state_window(handover, normalization: Normalization) -> None:
    """Raise unless a handed-over recurrent state (or ``None``) was kept for ``normalization``'s window, sinks and
    sparse cache (a state layer's ``window`` and ``sparse`` attributes; none: 0)."""
    if handover is None:
        return
    kept, sparse = getattr(handover, "window", 0), getattr(handover, "sparse", 0)
    if kept != normalization.window or sparse != normalization.sparse or (
            sparse and not isinstance(handover, SparseWindowStateHandover)):
        cache = f" and a sparse cache of {sparse} pairs" if sparse else ""
        raise ValueError(f"The recurrent cache was built for a softmax window of {kept} keys{cache} and the model "
                         f"runs {normalization.name}: build it from the model's config "
                         f"(RecurrentStateCache(config=model.config)).")
