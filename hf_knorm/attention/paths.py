"""Which kernel computes an attention call: the linear path or the quadratic one, and a log of which ran.

The linear path (:mod:`.linear_kernel`) computes ``x/c`` and ``x/sqrtN`` (``p = 1``) in time linear in the sequence
length. It is chosen automatically when it computes exactly what the quadratic kernel (:mod:`.kernel`) would:

- the normalization has ``p = 1``;
- the mask is causal (bottom-right, as with a cache) with padded keys at most: no sliding window, no packed sequences,
  no bidirectional attention, no additive float bias. A plain causal model call hands the attention its mask as key
  padding (:mod:`.masks`), which says so by its form: no ``N x N`` tensor exists and nothing is scanned, in eager mode
  and under ``torch.compile`` alike. An explicit 4-D mask (a user's) is checked row block by row block in eager mode;
  traced code cannot branch on its values, so under ``torch.compile`` it takes the quadratic kernel (which computes
  the same weights);
- no softcap, no attention dropout in training, no request for the attention weights;
- at least :data:`LINEAR_MIN_QUERIES` queries (below that the quadratic kernel is faster: one decoded token reads a
  K/V cache in ``O(N * D)``, the linear form needs ``O(N * D^2)``), or a recurrent state to continue.

Which path ran is visible: ``with attention_paths() as paths:`` counts the calls per path (``paths["linear"]``,
``paths["quadratic"]``, ``paths["sdpa"]`` for a quadratic call that PyTorch's SDPA computes; on CUDA ``paths["fla"]``
and ``paths["triton"]`` for the GPU kernels, ``backends.py``), and the ``hf_knorm.attention`` logger says at DEBUG
level why a call took the quadratic path (and ``backends.py`` which kernel computes it, and why).
A *fallback* (a ``p = 1`` call that could not take the linear path for a reason other than its few queries) is never
silent on a long input: from :data:`LONG_INPUT` queries on it warns once per reason. A model patched with
``linear="require"`` (:func:`hf_knorm.patch`) raises instead, at any length, for users who need the guarantee.
"""

from __future__ import annotations

import contextvars
import logging
import warnings
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .linear_kernel import is_linear
from .masks import KeyPadding, Mask
from ..normalizations import Normalization
from .taps import count_tap

LINEAR_MIN_QUERIES = 128
"""Fewest queries for which the linear path is chosen without a recurrent state (read at call time). The crossover
with the quadratic kernel on the SmolLM2 layer (docs/results/attention.md, "Linear-time x/1"): 1.44x the quadratic
time at 64 tokens, 1.03x at 128, 0.58x at 256."""

LONG_INPUT = 4096
"""Queries from which a fallback from the linear path warns (once per reason)."""
LINEAR_POLICIES = ("auto", "require")
"""``auto``: the linear path where it computes the call exactly, the quadratic kernel otherwise (a long fallback
warns); ``require``: a fallback raises."""

logger = logging.getLogger("hf_knorm.attention")
_warned: set[str] = set()

_PATHS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("hf_knorm_attention_paths", default=None)
_MASK_CHECK_ROWS = 1024
_last_mask_check: tuple | None = None  # (weakref to the mask, q, kv, key validity): one check per forward, not per layer


@dataclass(frozen=True)
class Path:
    """The kernel for one call. ``key_valid``: ``(B or 1, kv)`` bool for the linear path (``None`` = all valid);
    ``reason``: why the linear path was not taken (empty when it was); ``fallback``: a ``p = 1`` call that the linear
    path could not compute (not merely a short one, for which the quadratic kernel is the faster choice)."""

    linear: bool
    key_valid: torch.Tensor | None = None
    reason: str = ""
    fallback: bool = False
    kernel: str = ""  # what computes the path besides the PyTorch kernels ("sdpa", "triton", "fla"; backends.py)

    @property
    def name(self) -> str:
        return self.kernel or ("linear" if self.linear else "quadratic")


def choose_path(normalization: Normalization, q_len: int, kv_len: int, mask: Mask, bias: torch.Tensor | None, *,
                causal: bool, softcap: float | None, dropout: float, return_weights: bool, has_state: bool,
                compiling: bool = False) -> Path:
    """The path for one call (see the module docstring); ``mask`` as :func:`.interface.read_mask` gives it, ``bias``
    an additive float mask or ``None``."""
    if not is_linear(normalization):
        return Path(linear=False, reason=f"{normalization.name} is not linear attention (only x/c and x/sqrtN are)")
    reason = _blocker(bias, softcap, dropout, return_weights)
    key_valid = None
    if not reason:
        if mask is None:
            if not causal:
                reason = "bidirectional attention (no causal mask)"
        elif isinstance(mask, KeyPadding):
            if not mask.causal:
                reason = "bidirectional attention (no causal mask)"
            elif compiling or not mask.all_real:  # compiled code keeps the tensor: no data read
                key_valid = mask.key_valid
        elif compiling:
            reason = "under torch.compile an explicit 4-D mask's structure cannot be checked without a graph break"
        else:
            is_causal, key_valid = causal_key_validity(mask, q_len, kv_len)
            if not is_causal:
                reason = "the mask is not causal with padded keys (sliding window, packed sequences or a custom mask)"
    if reason:
        return Path(linear=False, reason=reason, fallback=True)
    if not has_state and q_len < LINEAR_MIN_QUERIES:
        return Path(linear=False, reason=f"{q_len} queries (< LINEAR_MIN_QUERIES = {LINEAR_MIN_QUERIES}: the "
                                         "quadratic kernel is faster)")
    return Path(linear=True, key_valid=key_valid)


def check_state_path(path: Path, has_state: bool) -> None:
    """Raise unless a call continuing a recurrent state (``has_state``) takes a linear path."""
    if has_state and not path.linear:
        raise ValueError(f"A recurrent state cache decodes with linear attention only, and this call cannot: "
                         f"{path.reason}. Generate with a normal cache (pass cache=DynamicCache()).")


def linear_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the linear path reads: with no mask and ``causal``, a top-left causal mask over as many
    keys as queries (sdpa's rule, as the quadratic kernel has it); otherwise all of them. Shapes ``(B, H_kv, kv, D)``."""
    if allowed is None and causal and query.shape[2] > 1:
        return key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    return key, value


def _blocker(bias, softcap, dropout, return_weights) -> str:
    if softcap is not None:
        return "a softcap on the scores"
    if bias is not None:
        return "an additive attention bias"
    if dropout > 0.0:
        return "attention dropout"
    if return_weights:
        return "the attention weights were requested"
    return ""


def causal_key_validity(allowed: torch.Tensor, q_len: int, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """Whether ``allowed`` ``(B or 1, 1, q, kv)`` is exactly bottom-right causal AND a key validity, and that
    ``(B or 1, kv)`` validity (``None`` when every key is valid). Checked in row blocks; the answer for the same mask tensor is remembered, so the
    layers of one forward check the shared mask once."""
    global _last_mask_check
    if _last_mask_check is not None:
        ref, rows, keys, answer = _last_mask_check
        if ref() is allowed and (rows, keys) == (q_len, kv_len):
            return answer
    answer = _decompose(allowed, q_len, kv_len)
    _last_mask_check = (weakref.ref(allowed), q_len, kv_len, answer)
    return answer


def _decompose(allowed: torch.Tensor, q_len: int, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    if allowed.dim() != 4 or allowed.shape[1] != 1 or allowed.shape[-2:] != (q_len, kv_len):
        return False, None
    key_valid = allowed[:, 0, -1, :]  # the last query sees every key that is not padding
    keys = torch.arange(kv_len, device=allowed.device)
    for start in range(0, q_len, _MASK_CHECK_ROWS):
        stop = min(q_len, start + _MASK_CHECK_ROWS)
        rows = torch.arange(start, stop, device=allowed.device) + (kv_len - q_len)
        expected = (keys[None, :] <= rows[:, None])[None] & key_valid[:, None, :]
        if not torch.equal(allowed[:, 0, start:stop], expected):
            return False, None
    return True, (None if bool(key_valid.all()) else key_valid)


def note_path(path: Path, module: torch.nn.Module, q_len: int, policy: str = "auto") -> None:
    """Count ``path`` in the active :func:`attention_paths` log, say at DEBUG level why a call is quadratic, and apply
    the model's linear-path ``policy`` to a fallback (:func:`check_linear_policy`)."""
    paths = _PATHS.get()
    if paths is not None:
        paths[path.name] += 1
    if not path.linear and logger.isEnabledFor(logging.DEBUG):
        logger.debug("layer %s: quadratic path (%s): %s", getattr(module, "layer_idx", "?"), path.name, path.reason)
    if path.fallback:
        check_linear_policy(path, policy, q_len)


def check_linear_policy(path: Path, policy: str, q_len: int | None = None) -> None:
    """Raise on a fallback under ``policy="require"``; under ``"auto"`` warn once per reason from :data:`LONG_INPUT`
    queries on (``q_len`` ``None``: not known to be long, as in compiled code that cannot keep the set of warnings)."""
    if policy == "require":
        raise ValueError(f"This model requires the linear path (hf_knorm.patch(..., linear='require')) and an "
                         f"attention call cannot take it: {path.reason}. Remove what blocks it, or patch with "
                         f"linear='auto' to let the quadratic kernel compute such calls (time and memory quadratic).")
    if q_len is not None and q_len >= LONG_INPUT and path.reason not in _warned:
        _warned.add(path.reason)
        warnings.warn(f"hf_knorm: a linear normalization on {q_len} queries takes the quadratic kernel (time quadratic "
                      f"in the length): {path.reason}. hf_knorm.patch(..., linear='require') makes this an error.",
                      stacklevel=4)


def linear_policy_of(module: torch.nn.Module) -> str:
    """The linear-path policy a patched model's config selects (``"auto"`` when the config names none)."""
    section = getattr(module.config, "hf_knorm", None) or {}
    return section.get("linear", "auto")


@contextmanager
def attention_paths():
    """``with attention_paths() as paths:`` -> a ``Counter`` of the plugin's attention calls per path
    (``"linear"``, ``"quadratic"``, ``"sdpa"``, and on CUDA ``"fla"``, ``"triton"``) made inside the block."""
    paths = Counter()
    token = _PATHS.set(paths)
    count_tap(+1)
    try:
        yield paths
    finally:
        _PATHS.reset(token)
        count_tap(-1)
