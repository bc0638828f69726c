"""The plugin's attention function, as Transformers' ``AttentionInterface`` calls it (registered as ``"hf_knorm"``,
``registration.py``).

Each attention module holds its typed normalization (``held.py``: parsed once, at ``patch`` or when a patched config
is built; never per call), and a mode set for a while (``held.running_as``) is a context variable, not a write to a
shared config. This module adapts Transformers' arguments (mask forms, kwargs, output recording), reports to an
active norm recorder or K/V transform, takes the recurrent state a cache hands over (``taps.py``), and chooses the
call's route once from the held normalization and the call (:data:`ROUTES`): a pure normalization on ``paths.py``'s
and ``backends.py``'s kernels, or the composition of ``window.py`` (window, sinks, sparse cache, clusters), or that
composition with its window dropped (``window_off.py``). The chosen path is counted and checked here, once.

Masks arrive as key padding ``(B, kv)`` for a plain causal call (the linear path never sees an ``N x N`` tensor) or
as the explicit mask otherwise (``masks.py``); :func:`read_mask` turns either into what the paths take.

Under ``torch.compile`` the function has no graph break. The taps are read only while one is set (``taps.taps_set``).
The linear path is traced as it is (its choice needs no data when the mask is key padding). Otherwise, with no tap
set and no dropout or returned weights, the call is one custom op running the eager kernels (``compiled.py``); with a
tap, the kernels are traced without their data-dependent shortcuts. Either way the results are the eager ones
(``tests/attention/test_compile.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat import attentions_being_collected
from .backends import KEY_PADDING_KERNELS, run_linear, run_quadratic, with_kernel
from .compiled import compiled_attention
from .full_precision import full_precision
from .masks import CallLayout, KeyPadding, Mask, kernel_mask
from ..normalizations import Normalization
from .held import running_normalization
from ..normalizations.base import PARAMETER_PREFIX
from ..normalizations.windowed import CODEBOOK, MIX
from .paths import Path, check_linear_policy, check_state_path, choose_path, linear_keys, linear_policy_of, note_path
from .taps import current_kv_transform, current_recorder, take_state_for, taps_set
from .window import window_attention, window_call_path
from .window_off import window_is_dropped, window_off_attention
from .window_parts import check_state_window

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
    check_state_window(handover, normalization)
    call = _Call(module, query, key, value, mask, bias, normalization, normalization.values_on(module), handover,
                 causal, scaling, kwargs.get("softcap"), dropout if module.training else 0.0,
                 _attentions_requested(kwargs), frobenius_sq, kwargs.get("sliding_window"), compiling, read_taps)
    for applies, choose, run in ROUTES:
        if applies(call):
            break
    path = choose(call)
    if read_taps:  # counted once, whichever route (attention_paths, the linear policy)
        note_path(path, module, query.shape[2], linear_policy_of(module))
    elif path.fallback:
        check_linear_policy(path, linear_policy_of(module))
    output, weights = run(call, path)
    if recorder is not None:
        recorder.record(module, key, value, mask, frobenius_sq.reshape(query.shape[0], query.shape[1]))
    return output, weights


@dataclass(frozen=True)
class _Call:
    """One call's arguments, as the routes read them (shapes: :func:`hf_knorm_attention`). ``mask``, ``bias``: as
    :func:`read_mask` gives them; ``params``: the family's learnable values; ``handover``: a recurrent state to
    continue (``taps.StateHandover``) or ``None``; ``frobenius_sq``: the recorder's accumulator or ``None``."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Mask
    bias: torch.Tensor | None
    normalization: Normalization
    params: dict
    handover: object
    causal: bool
    scaling: float | None
    softcap: float | None
    dropout: float
    return_weights: bool
    frobenius_sq: torch.Tensor | None
    sliding_window: int | None
    compiling: bool
    read_taps: bool

    @property
    def kernel_options(self) -> dict:
        """What every kernel of the quadratic and window routes takes besides the tensors."""
        return dict(bias=self.bias, scaling=self.scaling, softcap=self.softcap, dropout=self.dropout,
                    causal=self.causal, return_weights=self.return_weights, frobenius_sq=self.frobenius_sq,
                    params=self.params)

    def path(self, normalization: Normalization, return_weights: bool, **options) -> Path:
        """:func:`.paths.choose_path` for ``normalization`` on this call, with its kernel named
        (:func:`.backends.with_kernel`; ``options``: its ``layout``)."""
        choice = dict(causal=self.causal, softcap=self.softcap, dropout=self.dropout, compiling=self.compiling)
        path = choose_path(normalization, self.query.shape[2], self.key.shape[2], self.mask, self.bias,
                           return_weights=return_weights, has_state=self.handover is not None, **choice)
        return with_kernel(path, self.query, normalization, dropout=self.dropout, return_weights=return_weights,
                           recording=self.frobenius_sq is not None, compiling=self.compiling, softcap=self.softcap,
                           **options)


# --- the routes: which applies (the first that does), the path it counts, and the computation ---------------------


def _window_off_path(call: _Call) -> Path:
    """A windowed layer's training forward with its window dropped (:mod:`.window_off`, window dropout): the base
    family's path as for the pure normalization (quadratic where norms are recorded: the rows' scales apply to the
    weights)."""
    if call.handover is not None:
        raise ValueError(f"{call.normalization.name}: its softmax window is dropped (window dropout, a training "
                         "switch) and a recurrent cache was handed over: train without a cache (use_cache=False), or "
                         "leave hf_knorm.models.window_mix.window_dropped before decoding.")
    return call.path(call.normalization.without_window, call.return_weights or call.frobenius_sq is not None)


def _window_off(call: _Call, path: Path):
    return window_off_attention(call.query, call.key, call.value, call.mask, call.normalization, path,
                                mix=call.params.get(MIX), compiling=call.compiling, **call.kernel_options)


def _window_path(call: _Call) -> Path:
    """The composition's path (:func:`.window.window_call_path`), chosen once here and handed to it."""
    return window_call_path(call.query, call.key.shape[2], call.mask, call.bias, call.normalization,
                            causal=call.causal, softcap=call.softcap, dropout=call.dropout,
                            return_weights=call.return_weights, recording=call.frobenius_sq is not None,
                            has_state=call.handover is not None, compiling=call.compiling,
                            sliding_window=call.sliding_window)


def _window(call: _Call, path: Path):
    """The composition (:mod:`.window`): the window, its sinks, a sparse cache and clusters beside the base part."""
    return window_attention(call.query, call.key, call.value, call.mask, call.normalization,
                            mix=call.params.get(MIX), handover=call.handover, path=path,
                            codebook=call.module._parameters.get(PARAMETER_PREFIX + CODEBOOK),
                            sliding_window=call.sliding_window, op=call.compiling and not call.read_taps,
                            compiling=call.compiling, **call.kernel_options)


def _kernel_path(call: _Call) -> Path:
    """The path of a pure normalization with the kernel that computes it (SDPA and FlexAttention may compute the
    whole call: they read its layout)."""
    layout = CallLayout(call.mask, call.bias, call.causal, call.query.shape[2], call.key.shape[2])
    path = call.path(call.normalization, call.return_weights, layout=layout)
    check_state_path(path, call.handover is not None)
    return path


def _pure(call: _Call, path: Path):
    """A normalization without a window: the linear path, the custom op (traced code without taps), or a quadratic
    kernel."""
    if path.linear:
        key, value = linear_keys(call.query, call.key, call.value, call.mask, call.causal)
        return _linear(call.query, key, value, path, call.normalization, call.scaling, call.handover,
                       call.frobenius_sq), None
    # FlexAttention and fla read key padding as it is; the other kernels take the N x N form (masks.kernel_mask)
    mask = call.mask if path.kernel in KEY_PADDING_KERNELS else kernel_mask(call.mask, call.compiling)
    if call.compiling and not call.read_taps and call.dropout == 0.0 and not call.return_weights:
        return compiled_attention(call.query, call.key, call.value, mask, call.bias, call.normalization,
                                  scaling=call.scaling, softcap=call.softcap, causal=call.causal,
                                  params=call.params), None
    return run_quadratic(path, call.query, call.key, call.value, mask, call.normalization,
                         trim_keys=not call.compiling, **call.kernel_options)


ROUTES = (
    (lambda call: bool(call.normalization.window) and window_is_dropped(call.module), _window_off_path, _window_off),
    (lambda call: bool(call.normalization.window), _window_path, _window),
    (lambda call: True, _kernel_path, _pure),
)
"""The route table: ``(applies, path, compute)`` per route, the first that applies computes the call."""


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
