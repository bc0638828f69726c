"""A layer with a softmax window, computed with its window dropped: the base family alone, for window dropout.

Why. Hybrids of a sliding softmax window and another attention learn to bypass the other branch: the window does
nearly all the work, and common benchmarks do not show it (Benfeghoul et al., arXiv 2510.05901; here,
docs/research/2026-12-conversion.md, "Why the polynomial part is decoration"). Their Scheduled Sliding-window Dropout
switches the window off on some training steps, so that the other branch must carry the context.
:mod:`hf_knorm.training.window_dropout` decides the steps; this module computes a layer on such a step.

Definition (ours). With the window dropped, the whole softmax part is off (the window, the sinks and a sparse cache),
and the base family weights **every key the mask allows**, through the row normalization and the mix of the part
beside the window (:mod:`.window`), as it would be with a window of no key:

    o_i = m_h * u_i / RMS(u_i),    u_i = sum_{j allowed} w_ij v_j    (w: the base family's weights)

All keys, because with only the older ones a query would see nothing of its own last ``W`` tokens on a dropped step
(a signal about lost local context, not about the distant part); over all keys the layer is the base family's own
attention, which the paper's linear-only conversions train. No sinks either: a softmax over the first ``S`` tokens
alone would be another path that carries no context and that the model could lean on. The price: the base family's
weights on the recent keys are trained on such steps although the window covers them at inference.

The drop is read from the attention module (:data:`WINDOW_DROPPED`, set by
:func:`hf_knorm.models.window_mix.window_dropped`) and applies only while the module is training: evaluation and
``generate`` always run the window.
"""

from __future__ import annotations

import torch

from .backends import run_linear, run_quadratic
from .masks import Mask, kernel_mask
from ..normalizations import Normalization
from .paths import Path, linear_keys
from .window_parts import check_causal, check_mix, scaled_part

WINDOW_DROPPED = "hf_knorm_window_dropped"
"""The attribute of an attention module that drops its softmax window in training forwards (absent: not dropped)."""


def window_is_dropped(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward runs with its softmax window dropped: the switch is on and the module trains."""
    return bool(module.training and getattr(module, WINDOW_DROPPED, False))


def window_off_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Mask,
                         normalization: Normalization, path: Path, *, bias: torch.Tensor | None = None,
                         scaling: float | None = None, softcap: float | None = None, dropout: float = 0.0,
                         causal: bool = True, return_weights: bool = False, frobenius_sq: torch.Tensor | None = None,
                         mix: torch.Tensor | None = None, params: dict[str, torch.Tensor] | None = None,
                         compiling: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer with a softmax window, its window dropped (see the module docstring). The arguments and the result are
    :func:`.window.window_attention`'s (``return_weights``: the rows' scales and the mix included), and ``path`` the
    base family's path for this call (:func:`.paths.choose_path` and :func:`.backends.with_kernel` on
    ``normalization.without_window``, with ``return_weights`` true when norms are recorded: the rows' scales apply to
    the weights).

    Raises:
        ValueError: no window, a bidirectional call, a mix of another shape, or a linear path asked for weights.
    """
    if not normalization.window:
        raise ValueError(f"Dropping the softmax window needs one; {normalization.name} has none.")
    check_causal(normalization, mask, causal)
    check_mix(mix, query)
    weighted = return_weights or frobenius_sq is not None  # the rows' scales apply to the weights: materialize them
    if weighted and path.linear:
        raise ValueError("The linear path materializes no weights: choose the path with return_weights=True.")
    base = normalization.without_window
    dtype = query.dtype  # computed in fp32 (fp64 for fp64 inputs) and scaled there, as window.py computes its parts
    compute = torch.promote_types(dtype, torch.float32)
    query, key, value = query.to(compute), key.to(compute), value.to(compute)
    weights = None
    if path.linear:
        key, value = linear_keys(query, key, value, mask, causal)
        output = run_linear(path, query, key, value, path.key_valid, base, scaling=scaling)
    else:
        output, weights = run_quadratic(path, query, key, value, kernel_mask(mask, compiling), base, bias=bias,
                                        scaling=scaling, softcap=softcap, dropout=dropout, causal=causal,
                                        return_weights=weighted, trim_keys=not compiling, params=params)
    output, weights = scaled_part(output, weights, mix, frobenius_sq)  # each row's RMS to 1, times the mix
    return output.to(dtype), (weights if return_weights else None)
