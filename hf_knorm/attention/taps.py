"""Taps: the context-local hooks the plugin's attention function reads on every call.

- A **norm recorder** (any object with ``record(module, key, value, allowed, frobenius_sq)``, in practice
  :class:`hf_knorm.recording.statistics.NormRecorder`): the attention computes the squared Frobenius norm of each
  attention matrix as it goes and hands it, with the K/V it attended, to the active recorder.
- A **K/V transform** (``with KVTransform(fn):``): the attention replaces the ``key`` and ``value`` it receives by
  ``fn(module, key, value)`` before attending. Shapes: ``(B, H_kv, kv, D)`` in and out. This is how a perplexity
  evaluation makes attention really read quantized or low-rank K/V in a single forward pass (Transformers' own
  ``QuantizedCache`` hands attention the unquantized states at prefill).
- A **recurrent-state handover** (``hand_over_state`` / ``take_state_for``): a cache that keeps a linear-attention
  state instead of K and V (:class:`hf_knorm.recurrent.cache.RecurrentStateCache`) hands a layer's state to the
  attention call that follows its ``update``; see the section at the end.

All live here, below everything that uses them, so that the attention never imports the layers built on it. The
model must be routed through the plugin: :func:`hf_knorm.recording.record_norms.routed_through_plugin` does it for a model
that is not patched.

**Under torch.compile.** Dynamo cannot trace ``ContextVar.get``. Compiled code first reads one plain flag,
:func:`taps_set`: True while a tap is set in any context (a process-wide over-approximation). Dynamo guards on it, so
setting a tap makes the next call recompile with the tap reads in place (a graph break at each, and correct results);
while no tap is set, the compiled attention reads none and has no graph break.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

TransformFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Recorder(Protocol):
    """What the attention function reports to: see :meth:`hf_knorm.recording.statistics.NormRecorder.record`.

    ``records(module)`` says whether a layer is one of the recorder's: another model attending through the plugin in
    the same step (a DPO reference model, a distillation teacher) is not reported.
    """

    def records(self, module) -> bool: ...

    def record(self, module, key, value, allowed, frobenius_sq) -> None: ...


_taps = 0
_TAPS_LOCK = threading.Lock()
TAPS_SET = False  # read by compiled code; always ``_taps > 0``
"""Process-wide on purpose: compiled code cannot read a context variable without a graph break, so it reads this flag
(a guarded global) and reads the context variables themselves only while some context has a tap set. A tap set in
one thread thus makes compiled code of every thread read its own context (correct results, a graph break); the
taps themselves are context variables, each thread sees only its own."""


def taps_set() -> bool:
    """Whether a tap (recorder, K/V transform, pending handover, path log, kernel choice, mode) is set in any
    context."""
    return TAPS_SET


def count_tap(delta: int) -> None:
    """Count a tap set (``+1``) or cleared (``-1``), in any context and thread: what :func:`taps_set` reads."""
    global _taps, TAPS_SET
    with _TAPS_LOCK:
        _taps += delta
        TAPS_SET = _taps > 0


_TRANSFORM: contextvars.ContextVar[TransformFn | None] = contextvars.ContextVar("hf_knorm_kv_transform", default=None)
_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("hf_knorm_recorder", default=None)


def current_kv_transform() -> TransformFn | None:
    """The K/V transform active in this context, if any."""
    return _TRANSFORM.get()


def current_recorder(module=None) -> Recorder | None:
    """The norm recorder active in this context, if any (with ``module``: only if it records that layer)."""
    recorder = _RECORDER.get()
    if recorder is not None and module is not None and not recorder.records(module):
        return None
    return recorder


def activate_recorder(recorder: Recorder) -> contextvars.Token:
    """Make ``recorder`` the active one; returns the token :func:`deactivate_recorder` takes."""
    count_tap(+1)
    return _RECORDER.set(recorder)


def deactivate_recorder(token: contextvars.Token) -> None:
    """Restore the recorder that was active before :func:`activate_recorder` returned ``token``."""
    _RECORDER.reset(token)
    count_tap(-1)


class KVTransform:
    """Context manager activating ``fn(module, key, value) -> (key, value)`` for the plugin's attention calls."""

    def __init__(self, fn: TransformFn):
        self.fn = fn
        self._token = None

    def __enter__(self) -> KVTransform:
        self._token = _TRANSFORM.set(self.fn)
        count_tap(+1)
        return self

    def __exit__(self, *exc) -> None:
        _TRANSFORM.reset(self._token)
        count_tap(-1)


# --- the recurrent-state handover ------------------------------------------------------------------------------------
# A cache that keeps a linear-attention state instead of K and V (:class:`hf_knorm.recurrent.cache.RecurrentStateCache`)
# receives each layer's new keys and values in ``Cache.update``, right before the model calls the attention with the
# tensors ``update`` returned. The cache hands the layer's state over here; the attention takes it, recognising its own
# call by the identity of the key tensor, computes with the state and writes the new state back.


@runtime_checkable
class StateHandover(Protocol):
    """What a recurrent cache layer hands over to the attention call that follows its ``update``
    (:class:`hf_knorm.recurrent.state.RecurrentStateLayer`): every member the plugin's attention reads from it
    (:mod:`.interface`, :mod:`.window`), declared here.

    Attributes:
        key: the key tensor ``(B, H_kv, kv, D)`` the layer's ``update`` returned: the attention call that receives
            this very tensor is the one the state is for (:func:`take_state_for`).
        window: ``W``, the softmax window the layer keeps beside the state; ``0`` for a pure state. The attention
            refuses a state kept for another window than its normalization's.
        sparse: ``K``, the pairs of the sparse cache the layer keeps beside its window (``0``: none); the attention
            refuses a state kept for another ``K`` than its normalization's.
    """

    key: torch.Tensor
    window: int
    sparse: int

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The state ``(B, H_kv, D, D_v)`` fp32 (``sum k v^T`` of the valid keys the call's keys follow) and the count
        of those keys ``(B,)``; ``(None, None)`` before the first step."""
        ...

    def write(self, state: torch.Tensor | None, count: torch.Tensor | None) -> None:
        """Store the state and the count after the call's keys (a windowed layer: after the keys older than its
        window)."""
        ...


@runtime_checkable
class WindowStateHandover(StateHandover, Protocol):
    """A recurrent layer that also keeps a softmax window (and the attention sinks) beside its state
    (:class:`hf_knorm.recurrent.window_cache.WindowStateLayer`; ``window > 0``): the members
    :func:`hf_knorm.attention.window_parts.sink_keys` reads besides those of :class:`StateHandover`.

    Attributes:
        cumulative_length: every token the layer has seen, the call's included (padded ones too): the absolute
            position of the call's last key plus one.
        sinks: the attention sinks kept from earlier calls (:class:`hf_knorm.attention.window_parts.Sinks`: keys, values
            ``(B, H_kv, S', D)``, absolute positions and validity ``(B or 1, S')``), or ``None``.
        sinks_complete: every sequence holds its ``S`` sinks already: no later key is one (no search needed).
    """

    cumulative_length: int
    sinks: Any
    sinks_complete: bool

    def keep_sinks(self, sinks: Any, complete: bool = False) -> None:
        """Keep the call's sinks (a :class:`hf_knorm.attention.window_parts.Sinks`, absolute positions) for the next
        calls; ``complete``: every sequence has its ``S``."""
        ...


@runtime_checkable
class SparseWindowStateHandover(WindowStateHandover, Protocol):
    """A windowed recurrent layer that also keeps a sparse cache (:class:`hf_knorm.recurrent.sparse_cache.
    SparseWindowStateLayer`; ``sparse > 0``): the members :mod:`.sparse` reads besides those of
    :class:`WindowStateHandover`.

    Attributes:
        sparse_pairs: the cache's pairs kept from earlier calls (:class:`hf_knorm.attention.sparse.SparsePairs`), or
            ``None`` before the first call.
        score_statistics: what the score of the pairs carries from the calls before (a prefix score's running
            statistics), or ``None``.
        cluster_state: the per-cluster sums of the distant pairs (:class:`hf_knorm.attention.distant_clusters.
            ClusterState`) with ``+ clusters C``, or ``None``.
    """

    sparse_pairs: Any
    score_statistics: Any
    cluster_state: Any

    def keep_sparse(self, pairs: Any) -> None:
        """Keep the cache's pairs after the call (before :meth:`write`)."""
        ...

    def keep_score_statistics(self, statistics: Any) -> None:
        """Keep what a prefix score carries to the next call
        (:class:`hf_knorm.normalizations.prefix_kv_diff.PrefixStatistics`; ``None`` for a per-token score)."""
        ...

    def keep_clusters(self, state: Any) -> None:
        """Keep the per-cluster sums after the call (before :meth:`write`)."""
        ...


_HANDOVER: contextvars.ContextVar[StateHandover | None] = contextvars.ContextVar("hf_knorm_state", default=None)


def hand_over_state(handover: StateHandover | None) -> None:
    """Make ``handover`` the one the next attention call takes (``None`` clears it)."""
    count_tap((handover is not None) - (_HANDOVER.get() is not None))
    _HANDOVER.set(handover)


def pending_handover() -> StateHandover | None:
    """The handover no attention has taken yet, if any."""
    return _HANDOVER.get()


def take_state_for(key: torch.Tensor) -> StateHandover | None:
    """The pending handover if it was made for this ``key`` tensor (then it is cleared), else ``None``."""
    handover = _HANDOVER.get()
    if handover is None or handover.key is not key:
        return None
    hand_over_state(None)
    return handover
