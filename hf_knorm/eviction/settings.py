"""What a KNorm cache evicts: the settings one :class:`~hf_knorm.KNormCache` shares with its layers, and their rules.

:class:`EvictionSettings` holds the cache's options as public fields (validated once, when built). The cache builds it
and hands it to every :class:`~hf_knorm.eviction.layer.KNormLayer` at construction; a layer reads nothing else of the
cache. Its two rules are the method of arXiv 2406.11430 with the options on top:

- :meth:`EvictionSettings.prompt_keep`: how many prompt tokens a layer keeps (``ceil((1 - r) * n)`` at ratio ``r``, or
  the token ``budget``; never fewer than the protected tokens);
- :meth:`EvictionSettings.eviction_order`: which ones (the score's negated importance, protected tokens first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .budgets import HEAD_BUDGETS, LAYER_BUDGETS
from .scores import resolve_score


def kept_count(prompt_length: int, ratio: float) -> int:
    """Number of prompt tokens kept at compression ratio ``ratio``: ``ceil((1 - ratio) * n)`` (at least 1 if n > 0)."""
    evicted = math.floor(round(ratio * prompt_length, 6))  # round() absorbs float noise such as 0.9 * 1000
    return max(prompt_length - evicted, min(prompt_length, 1))


@dataclass
class EvictionSettings:
    """The options of one :class:`~hf_knorm.KNormCache` (see it for their meaning), validated when built.

    Attributes:
        compression_ratio (float): Fraction of the prompt evicted, in [0, 1).
        budget (int or None): Prompt tokens kept per head instead of the ratio.
        sink_tokens, recent_window (int): Tokens never evicted at the start / the end.
        layer_ratios (dict[int, float]): Per-layer ratios (a sequence is turned into ``{layer: ratio}``).
        decoding_budget (int or None): Tokens kept per head at all times, decoding included.
        key_scales, value_scales (list of (H_kv, head_dim) tensors, or None): Per-layer scoring bases.
        score: The score object (a name of :data:`~hf_knorm.eviction.scores.SCORES` is resolved to one).
        head_budget (str): ``"uniform"`` (the paper's: the same count in every head) or ``"heads"`` (AdaKV's
            head-adaptive budget, :func:`~hf_knorm.eviction.budgets.head_adaptive_keep`).
        head_floor (float): In [0, 1]; with ``head_budget="heads"`` every head keeps at least this fraction of its
            uniform share (AdaKV: 0.2). ``1`` keeps the uniform count in every head.
        layer_budget (str): ``"uniform"``, ``"skip_first"``, ``"dispersion"``
            (:func:`~hf_knorm.eviction.budgets.layer_keep_counts`) or ``"global"`` (one threshold over every layer and
            head: :func:`~hf_knorm.eviction.budgets.global_keep`); the total kept is the ratio's either way.
        threshold (float or None): KVzap's threshold pruning instead of a ratio: a pair whose importance is below it
            is evicted once it is older than the ``recent_window`` (at the prefill and at every decoding step); how
            much is evicted depends on the text (:meth:`keeps_above_threshold`).
    """

    compression_ratio: float = 0.0
    budget: int | None = None
    sink_tokens: int = 0
    recent_window: int = 0
    layer_ratios: Sequence[float] | Mapping[int, float] | None = None
    decoding_budget: int | None = None
    key_scales: Sequence[torch.Tensor] | None = None
    value_scales: Sequence[torch.Tensor] | None = None
    score: Any = "key_norm"
    head_budget: str = "uniform"
    head_floor: float = 0.2
    layer_budget: str = "uniform"
    threshold: float | None = None

    def __post_init__(self):
        self.score = resolve_score(self.score)
        self._check_budgets()
        self._check_threshold()
        _check_ratio("compression_ratio", self.compression_ratio)
        if isinstance(self.layer_ratios, Mapping):
            self.layer_ratios = dict(self.layer_ratios)
        elif self.layer_ratios is not None:
            self.layer_ratios = dict(enumerate(self.layer_ratios))
        for layer, ratio in (self.layer_ratios or {}).items():
            _check_ratio(f"layer_ratios[{layer}]", ratio)
        for name in ("sink_tokens", "recent_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        for name in ("budget", "decoding_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (a number of tokens) or None, got {value!r}.")
        if self.budget is not None and (self.compression_ratio or self.layer_ratios):
            raise ValueError("Give either a token budget or compression ratios, not both.")
        if self.deferred and self.decoding_budget is not None:
            raise ValueError(
                f"score={self.score.name!r} scores the prompt by a reconstruction pass after the prefill; it cannot "
                "score the tokens generated later, so it does not combine with decoding_budget (drop it, or use a "
                "score computed from the cached states such as 'kv_diff')."
            )
        protected = self.sink_tokens + self.recent_window
        if self.decoding_budget is not None and self.decoding_budget < protected:
            raise ValueError(
                f"decoding_budget={self.decoding_budget} is smaller than the protected tokens (sink_tokens + "
                f"recent_window = {protected}); raise the budget or protect fewer tokens."
            )
        self.compression_ratio = float(self.compression_ratio)
        self.layer_ratios = self.layer_ratios or {}
        self.key_scales = None if self.key_scales is None else list(self.key_scales)
        self.value_scales = None if self.value_scales is None else list(self.value_scales)

    def _check_budgets(self) -> None:
        if self.head_budget not in HEAD_BUDGETS:
            raise ValueError(f"Unknown head_budget {self.head_budget!r}; use one of {', '.join(HEAD_BUDGETS)}.")
        if self.layer_budget not in LAYER_BUDGETS:
            raise ValueError(f"Unknown layer_budget {self.layer_budget!r}; use one of {', '.join(LAYER_BUDGETS)}.")
        if isinstance(self.head_floor, bool) or not isinstance(self.head_floor, (int, float)) \
                or not 0.0 <= float(self.head_floor) <= 1.0:
            raise ValueError(
                f"head_floor must be in [0, 1] (the fraction of its uniform share every head keeps; a head cannot "
                f"keep more than its share and leave the layer's total unchanged), got {self.head_floor!r}."
            )
        self.head_floor = float(self.head_floor)
        adaptive = self.head_budget != "uniform" or self.layer_budget != "uniform"
        if adaptive and (self.budget is not None or self.layer_ratios):
            raise ValueError(
                "head_budget/layer_budget share the compression_ratio's total between heads and layers; they do not "
                "combine with budget= or layer_ratios= (give only compression_ratio)."
            )
        if self.layer_budget == "global" and not getattr(self.score, "shared_scale", False):
            raise ValueError(
                "layer_budget='global' compares the importance of every layer's and head's pairs as it is, which needs "
                "a score on one scale everywhere (score='kvzip': attention weights, or score='kvzap': their predicted "
                f"logs); {self.score.name!r} is not. For it, head_budget='heads' compares heads on z-scores and "
                "layer_budget='dispersion' shares between layers."
            )
        if self.layer_budget == "global" and self.head_budget != "heads":
            raise ValueError("layer_budget='global' keeps a different count in every head: add head_budget='heads' "
                             "(the store that holds them).")
        if self.head_budget == "heads" and self.decoding_budget is not None:
            raise ValueError(
                "head_budget='heads' does not evict during decoding yet: drop decoding_budget, or use "
                "head_budget='uniform'."
            )

    def _check_threshold(self) -> None:
        if self.threshold is None:
            return
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number (an importance on the score's scale), got "
                             f"{self.threshold!r}.")
        self.threshold = float(self.threshold)
        if not getattr(self.score, "shared_scale", False) or self.deferred:
            raise ValueError(
                f"threshold compares every pair's importance with one number, at the prefill and while decoding: it "
                f"needs a score computed from the cached states on one scale everywhere (score='kvzap': the predicted "
                f"log of KVzip's importance); {self.score.name!r} is not."
            )
        sized = [name for name in ("compression_ratio", "budget", "layer_ratios", "decoding_budget")
                 if getattr(self, name)]
        if sized or self.layer_budget != "uniform":
            raise ValueError(f"threshold decides by itself how much to evict; drop "
                             f"{', '.join(sized) or 'layer_budget'}.")
        if self.head_budget != "heads":
            raise ValueError("threshold keeps a different count in every head: add head_budget='heads' (the store that "
                             "holds them).")

    @property
    def keeps_above_threshold(self) -> bool:
        """True when the cache evicts by :attr:`threshold` (KVzap's ``ThresholdPress``, arXiv 2601.07891): a pair
        stays while it is a sink or among the last ``recent_window`` tokens, then only if its importance is at least
        the threshold, decided once, when it leaves the window."""
        return self.threshold is not None

    def check_layer_count(self, num_layers: int) -> None:
        """Raise if the per-layer options name layers a model of ``num_layers`` layers does not have."""
        for name in ("key_scales", "value_scales"):
            scales = getattr(self, name)
            if scales is not None and len(scales) != num_layers:
                raise ValueError(f"{name} has {len(scales)} entries; the model has {num_layers} layers.")
        for layer in self.layer_ratios:
            if not 0 <= layer < num_layers:
                raise ValueError(f"layer_ratios names layer {layer}; the model has layers 0..{num_layers - 1}.")

    def prompt_keep(self, layer_idx: int, prompt_length: int) -> int:
        """Prompt tokens layer ``layer_idx`` keeps per head after a prompt of ``prompt_length`` tokens."""
        if self.budget is not None:
            if self.budget > prompt_length:
                raise ValueError(
                    f"budget={self.budget} tokens is larger than the prompt ({prompt_length} tokens); use a smaller "
                    "budget or compression_ratio instead."
                )
            keep = self.budget
        else:
            keep = kept_count(prompt_length, self.layer_ratios.get(layer_idx, self.compression_ratio))
        protected = min(prompt_length, self.sink_tokens + self.recent_window)
        return max(keep, protected)

    @property
    def deferred(self) -> bool:
        """True when the score is computed outside the cache, after the prefill (``score="kvzip"``): layers then store
        their prompt whole until :meth:`~hf_knorm.KNormCache.compress_prompts` gets the importance."""
        return bool(getattr(self.score, "reconstructs", False))

    def eviction_order(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int,
                       length: int, importance: torch.Tensor | None = None) -> torch.Tensor:
        """Eviction order (B, H_kv, S) of one layer's keys and values (B, H_kv, S, D) at absolute positions
        (B, H_kv, S), ``length`` tokens seen so far: the negated importance of ``score`` (for ``key_norm`` the key L2
        norm), low = kept; protected tokens -inf. ``importance`` (B, H_kv, S), when given, is used instead of calling
        the score (a deferred score's, computed outside the cache)."""
        if importance is not None:
            if importance.shape != positions.shape:
                raise ValueError(f"importance has shape {tuple(importance.shape)}; layer {layer_idx} stores "
                                 f"{tuple(positions.shape)} (B, H_kv, S) tokens.")
            scores = -importance.to(positions.device)
        else:
            scores = -self.importance(keys, values, positions, layer_idx)
        protected = positions < self.sink_tokens
        if self.recent_window:
            protected |= positions >= length - self.recent_window
        return scores.masked_fill(protected, float("-inf"))

    def importance(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   layer_idx: int) -> torch.Tensor:
        """The score's importance (B, H_kv, S) of keys and values (B, H_kv, S, D) at positions (B, H_kv, S), in the
        scoring basis (``key_scales``, ``value_scales``); higher = kept. No protection applied."""
        scale = self._scale("key_scales", layer_idx, keys)
        if scale is not None:
            keys = keys * scale.to(keys)[None, :, None, :]
        scale = self._scale("value_scales", layer_idx, values)
        if scale is not None:
            values = values / scale.to(values)[None, :, None, :]
        return self.score(keys, values, positions, layer_idx)

    def _scale(self, name: str, layer_idx: int, states: torch.Tensor) -> torch.Tensor | None:
        scales = getattr(self, name)
        if scales is None:
            return None
        if layer_idx >= len(scales):
            raise ValueError(f"{name} has {len(scales)} entries; layer {layer_idx} has none.")
        scale = scales[layer_idx]
        if scale.shape != states.shape[1:2] + states.shape[3:]:
            raise ValueError(
                f"{name}[{layer_idx}] has shape {tuple(scale.shape)}; the layer's states need "
                f"(H_kv, head_dim) = {tuple(states.shape[1:2] + states.shape[3:])}."
            )
        return scale


def _check_ratio(name: str, ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise ValueError(
            f"{name} must be in [0, 1) (the fraction of the prompt to evict), got {ratio!r}; to keep a fixed number "
            "of tokens use budget=."
        )
