"""The plugin's attention function, as Transformers' ``AttentionInterface`` calls it.

Registered under the name ``"hf_knorm"`` (``registration.py``). Each attention module holds its typed normalization
(``held.py``: parsed once, when the model is patched or built from a patched config; never parsed per call), so two
models in one process can use different normalizations, and a mode set for a while (``held.running_as``) is a
context variable, not a write to a shared config. The math is in
``kernel.py`` (any normalization, quadratic time) and ``linear_kernel.py`` (``p = 1``, linear time; ``paths.py``
chooses; ``backends.py`` runs softmax, SSMax and a sink softmax on PyTorch's SDPA, ``sdpa.py``, and on CUDA the
polynomials as Triton and flash-linear-attention kernels, and the softmax-over-logits and log-weight families through
FlexAttention, ``flex.py``), composed by ``window.py``
for a normalization with a softmax window; this module adapts Transformers' arguments to them (mask forms, kwargs,
output recording), reports to an active norm recorder or K/V transform, and continues the recurrent state a cache
hands over (``taps.py``).

Masks arrive in two forms (``masks.py``): key padding ``(B, kv)`` for a plain causal call, so that the linear path
never sees an ``N x N`` tensor, and the explicit bool mask otherwise; ``read_mask`` turns either into what the paths
take, and only the quadratic kernel builds the ``N x N`` form from key padding (``masks.kernel_mask``).

Under ``torch.compile`` the function has no graph break. The taps are read only while one is set (``taps.taps_set``).
The linear path is traced as it is (its choice needs no data when the mask is key padding). Otherwise, with no tap
set and no dropout or returned weights (training and inference), the call is one custom op running the eager kernels
(``compiled.py``); with a tap, the kernels are traced with their data-dependent shortcuts left out (which keys a
chunk attends). Either way the results are the eager ones (``tests/attention/test_compile.py``).
"""

from __future__ import annotations

import torch

from ..compat import attentions_being_collected
from .backends import run_linear, run_quadratic, with_kernel
from .compiled import compiled_attention
from .full_precision import full_precision
from .masks import KeyPadding, Mask, kernel_mask
from ..normalizations import Normalization
from .held import running_normalization
from ..normalizations.base import PARAMETER_PREFIX
from ..normalizations.windowed import CODEBOOK, MIX
from .paths import check_linear_policy, choose_path, linear_keys, linear_policy_of, note_path
from .taps import current_kv_transform, current_recorder, take_state_for, taps_set
from .sparse import sparse_path, sparse_window_attention
from .window import check_state_window, window_attention, window_path
from .window_off import window_is_dropped, window_off_attention

ATTENTION_NAME = "hf_knorm"


@full_precision
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
            an additive float mask of that shape (e.g. a user's 4-D mask), or ``None``.
        scaling: score scale (default ``D ** -0.5``).
        dropout: attention dropout probability, applied to the weights when ``module.training``.
        **kwargs: ``softcap`` (Gemma2), ``sliding_window`` (the layer's own; a softmax window's sinks refuse it),
            ``output_attentions``, ``is_causal``; others are ignored.

    Returns:
        ``(output (B, q, H_q, D), weights (B, H_q, q, kv) or None)``; weights only when attentions are recorded.
    """
    compiling = torch.compiler.is_compiling()
    read_taps = not compiling or taps_set()  # compiled code cannot read a ContextVar without a graph break
    normalization = normalization_of(module, read_taps)
    params = normalization.values_on(module)  # the family's learnable values, (H_q,) each
    handover = take_state_for(key) if read_taps else None
    transform = current_kv_transform() if read_taps else None
    if transform is not None:
        key, value = transform(module, key, value)
    recorder = current_recorder(module) if read_taps else None
    frobenius_sq = None
    if recorder is not None:
        frobenius_sq = query.new_zeros(query.shape[0], key.shape[1], query.shape[1] // key.shape[1], dtype=torch.float32)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    mask, bias = read_mask(attention_mask, query.shape[2], key.shape[2], causal, compiling)
    softcap = kwargs.get("softcap")
    dropout = dropout if module.training else 0.0
    return_weights = _attentions_requested(kwargs)
    check_state_window(handover, normalization)
    if normalization.window and window_is_dropped(module):  # window dropout, in training only (window_off.py)
        output, weights = _window_off(module, query, key, value, mask, bias, normalization, params, handover, causal,
                                      softcap, dropout, return_weights, frobenius_sq, compiling, read_taps, scaling)
        if recorder is not None:
            recorder.record(module, key, value, mask, frobenius_sq.reshape(query.shape[0], query.shape[1]))
        return output, weights
    if normalization.sparse:  # a sparse cache beside the window (sparse.py): in blocks with a state, or masked rows
        path = sparse_path(normalization, query.shape[2], key.shape[2], handover, softcap=softcap,
                           return_weights=return_weights, recording=recorder is not None)
        if read_taps:
            note_path(path, module, query.shape[2], linear_policy_of(module))
        elif path.fallback:
            check_linear_policy(path, linear_policy_of(module))
        output, weights = sparse_window_attention(
            query, key, value, mask, normalization, bias=bias, scaling=scaling, softcap=softcap, dropout=dropout,
            causal=causal, return_weights=return_weights, frobenius_sq=frobenius_sq, mix=params.get(MIX),
            params=params, handover=handover, sliding_window=kwargs.get("sliding_window"),
            codebook=module._parameters.get(PARAMETER_PREFIX + CODEBOOK))
        if recorder is not None:
            recorder.record(module, key, value, mask, frobenius_sq.reshape(query.shape[0], query.shape[1]))
        return output, weights
    choice = dict(causal=causal, softcap=softcap, dropout=dropout, return_weights=return_weights,
                  has_state=handover is not None, compiling=compiling)
    if normalization.window:  # the polynomial part's path (window.py), chosen once here and handed to it
        path = window_path(normalization, query.shape[2], key.shape[2], mask, bias, **choice,
                           recording=recorder is not None, sliding_window=kwargs.get("sliding_window"))
    else:
        path = choose_path(normalization, query.shape[2], key.shape[2], mask, bias, **choice)
    path = with_kernel(path, query, normalization.without_window, dropout=dropout, return_weights=return_weights,
                       recording=recorder is not None, compiling=compiling, softcap=softcap,
                       sdpa=not normalization.window)
    if read_taps:
        note_path(path, module, query.shape[2], linear_policy_of(module))
    elif path.fallback:
        check_linear_policy(path, linear_policy_of(module))
    if handover is not None and not path.linear:
        raise ValueError(f"A recurrent state cache decodes with linear attention only, and this call cannot: "
                         f"{path.reason}. Generate with a normal cache (pass cache=DynamicCache()).")
    weights = None
    if normalization.window:  # a softmax window beside the polynomial part (window.py), on the path counted above
        output, weights = window_attention(
            query, key, value, mask, normalization, bias=bias, scaling=scaling, softcap=softcap, dropout=dropout,
            causal=causal, return_weights=return_weights, frobenius_sq=frobenius_sq, mix=params.get(MIX), params=params,
            handover=handover, path=path, sliding_window=kwargs.get("sliding_window"), op=compiling and not read_taps,
            compiling=compiling)
    elif path.linear:
        key, value = linear_keys(query, key, value, mask, causal)
        output = _linear(query, key, value, path, normalization, scaling, handover, frobenius_sq)
    elif compiling and not read_taps and dropout == 0.0 and not return_weights:
        output = compiled_attention(query, key, value, kernel_mask(mask, compiling), bias,
                                    normalization, scaling=scaling, softcap=softcap, causal=causal, params=params)
    else:
        flex_mask = path.kernel == "flex"  # FlexAttention reads key padding as it is (no N x N mask)
        output, weights = run_quadratic(
            path, query, key, value, mask if flex_mask else kernel_mask(mask, compiling), normalization, bias=bias,
            scaling=scaling, softcap=softcap, dropout=dropout, causal=causal, return_weights=return_weights,
            frobenius_sq=frobenius_sq, trim_keys=not compiling, params=params,
        )
    if recorder is not None:
        recorder.record(module, key, value, mask, frobenius_sq.reshape(query.shape[0], query.shape[1]))
    return output, weights


def _window_off(module, query, key, value, mask, bias, normalization, params, handover, causal, softcap, dropout,
                return_weights, frobenius_sq, compiling, read_taps, scaling):
    """A windowed layer's training forward with its window dropped (:mod:`.window_off`): the base family's path
    chosen and counted as for the pure normalization (quadratic where norms are recorded: the rows' scales apply to
    the weights)."""
    if handover is not None:
        raise ValueError(f"{normalization.name}: its softmax window is dropped (window dropout, a training switch) "
                         "and a recurrent cache was handed over: train without a cache (use_cache=False), or leave "
                         "hf_knorm.models.window_mix.window_dropped before decoding.")
    base = normalization.without_window
    weighted = return_weights or frobenius_sq is not None
    path = choose_path(base, query.shape[2], key.shape[2], mask, bias, causal=causal, softcap=softcap, dropout=dropout,
                       return_weights=weighted, has_state=False, compiling=compiling)
    path = with_kernel(path, query, base, dropout=dropout, return_weights=weighted, recording=frobenius_sq is not None,
                       compiling=compiling, softcap=softcap)
    if read_taps:
        note_path(path, module, query.shape[2], linear_policy_of(module))
    elif path.fallback:
        check_linear_policy(path, linear_policy_of(module))
    return window_off_attention(query, key, value, mask, normalization, path, bias=bias, scaling=scaling,
                                softcap=softcap, dropout=dropout, causal=causal, return_weights=return_weights,
                                frobenius_sq=frobenius_sq, mix=params.get(MIX), params=params, compiling=compiling)


def _linear(query, key, value, path, normalization, scaling, handover, frobenius_sq) -> torch.Tensor:
    """The linear path; with a recurrent state handed over, it continues from that state and writes the new one."""
    if handover is None:
        return run_linear(path, query, key, value, path.key_valid, normalization, scaling=scaling,
                          frobenius_sq=frobenius_sq)
    state, count = handover.read()
    output, state, count = run_linear(path, query, key, value, path.key_valid, normalization, scaling=scaling,
                                      initial_state=state, initial_count=count, frobenius_sq=frobenius_sq,
                                      return_state=True)
    handover.write(state, count)
    return output


def _attentions_requested(kwargs: dict) -> bool:
    """Whether the caller records attention weights (``output_attentions=True``).

    Some families (GPT-2) consume ``output_attentions`` before calling the attention function; Transformers'
    output-capturing context then tells whether attentions are being collected.
    """
    if kwargs.get("output_attentions"):
        return True
    return attentions_being_collected()


def normalization_of(module: torch.nn.Module, read_context: bool = True) -> Normalization:
    """The normalization ``module`` computes now: what it holds (``held.py``), or a :func:`.held.running_as` mode of
    this context (read with ``read_context``)."""
    normalization = running_normalization(module, read_context)
    if normalization is None:
        section = getattr(module.config, "hf_knorm", None) or {}
        named = f"its config names {section['normalization']!r}" if section.get("normalization") else \
            "its config names no normalization"
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs attn_implementation="
            f"'{ATTENTION_NAME}' and holds no hf_knorm normalization ({named}). Patch the model with "
            "hf_knorm.patch(model, normalization=...), or load a saved one with hf_knorm imported "
            "(hf_knorm.from_pretrained, or Transformers' from_pretrained after `import hf_knorm`); a config's hf_knorm "
            "section is not edited by hand.")
    return normalization


def read_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool,
              compiling: bool = False) -> tuple[Mask, torch.Tensor | None]:
    """The mask the attention received, as the paths take it: ``(mask, additive float bias or None)``.

    ``mask`` is :class:`~.masks.KeyPadding` for the ``(B, kv)`` form of :func:`~.masks.hf_knorm_mask`, a bool
    ``(B or 1, 1 or H_q, q, kv)`` mask for a 4-D bool or additive float mask, or ``None``. An all-zero bias is dropped
    (so the linear path stays open), except while compiling: that check reads the data.
    """
    if mask is None:
        return None, None
    if mask.dim() == 2:
        return KeyPadding.of(mask, q_len, kv_len, causal), None
    if mask.dtype == torch.bool:
        return mask, None
    allowed = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(allowed, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)).float()
    return allowed, (bias if compiling or bool(bias.any()) else None)
