"""Where the attention reads a module's normalization at run time: the typed object, held, never parsed per call.

The spelling in a patched config (``config.hf_knorm["normalization"]``) is the normalization's saved form. The
object it names is parsed once, when the model is patched (:func:`hf_knorm.patch`) or built from a patched config
(every ``from_pretrained``, ``from_config``: :mod:`hf_knorm.models.parameters`' build hook), and held by each attention
module (:data:`HELD`); :func:`hf_knorm.unpatch` lets go of it. The attention entry (:mod:`.interface`) reads it
there.

A mode that changes what one model computes for a while (its clusters off while a codebook is fitted:
:func:`hf_knorm.models.cluster_codebook.clusters_off`) is a context variable (:func:`running_as`), never a write to
the model's config or to the held object: two threads running one model in different modes each get their own
results.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch

from ..normalizations import Normalization
from .taps import count_tap

HELD = "hf_knorm_normalization"
"""The attribute of each patched attention module that holds its :class:`~hf_knorm.normalizations.Normalization`."""

_RUNNING_AS: contextvars.ContextVar[Mapping[int, Normalization] | None] = contextvars.ContextVar(
    "hf_knorm_running_as", default=None)


def hold(module: torch.nn.Module, normalization: Normalization | None) -> None:
    """Make ``module`` hold ``normalization`` (``None``: hold nothing, as an unpatched module)."""
    if normalization is None:
        module.__dict__.pop(HELD, None)
    else:
        module.__dict__[HELD] = normalization


def held_by(module: torch.nn.Module) -> Normalization | None:
    """The normalization ``module`` holds (``None`` for a module that was never patched)."""
    return module.__dict__.get(HELD)


@contextmanager
def running_as(modules: Iterable[torch.nn.Module], normalization: Normalization):
    """``with running_as(modules, normalization):`` the attention of ``modules`` computes ``normalization`` within
    the block, in this context only (another thread, or code outside the block, sees what the modules hold); nested
    blocks stack. The normalization must take the values the modules hold (e.g. the held one without its clusters)."""
    current = _RUNNING_AS.get() or {}
    token = _RUNNING_AS.set({**current, **{id(module): normalization for module in modules}})
    count_tap(+1)  # compiled code reads the context variable only while a tap is set (taps.taps_set)
    try:
        yield
    finally:
        _RUNNING_AS.reset(token)
        count_tap(-1)


def running_normalization(module: torch.nn.Module, read_context: bool = True) -> Normalization | None:
    """What ``module``'s attention computes now: a :func:`running_as` override in this context (read only with
    ``read_context``: compiled code reads none while no tap is set), else what it holds."""
    if read_context:
        overrides = _RUNNING_AS.get()
        if overrides:
            override = overrides.get(id(module))
            if override is not None:
                return override
    return module.__dict__.get(HELD)
