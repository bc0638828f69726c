"""KNorm KV-cache compression: keep the cached keys with the lowest L2 norm (Devoto et al., arXiv 2406.11430).

:class:`KNormCache` is a Transformers :class:`~transformers.Cache` for ``model.generate(..., cache=...)``. It follows
the pattern of Transformers' own evicting layer (``DynamicSlidingWindowLayer``): each ``update`` returns the *full*
states of the current step to the attention, stores fewer, keeps the absolute sequence length (``get_seq_length``) so
new tokens get their true positions, and reports ``get_mask_sizes`` with an offset so the causal mask of later steps
stays right. Kept keys keep their rotation (they are cached post-RoPE).

The method (the paper's setting, every option off): the first forward pass through the cache (the prompt, "prefill")
attends the prompt in full, so it is exact; then, per layer and per KV head, only the ``ceil((1 - r) * n)`` prompt
tokens whose post-RoPE key has the lowest L2 norm are kept (same count for every head of a layer, positions may
differ between heads), in their original order. Later tokens are appended uncompressed.

Which tokens a layer keeps is decided by a score (``score=``, :mod:`hf_knorm.knorm.scores`): ``"key_norm"``, the
paper's, by default; others need no attention weights either: ``"kv_diff"`` (recommended: it keeps the needle that
``key_norm`` loses on the default model, BENCHMARKS.md "Eviction scores"), ``"key_diff"``, ``"value_over_key"`` and
the baselines ``"recent"`` and ``"random"``.

Options (all off by default): ``budget`` (keep a token count instead of a ratio), ``sink_tokens`` and
``recent_window`` (never evict the first k / last w tokens; they count towards the kept number), ``layer_ratios``
(per-layer ratios; the authors' code leaves layers 0-1 uncompressed: ``layer_ratios={0: 0.0, 1: 0.0}``),
``decoding_budget`` (keep at most that many tokens per head during decoding too: bounded memory), ``key_scales``
(score ``||k * s||`` instead of ``||k||``: for a K/V-balanced model, whose keys are ``k_original / s``, this scores in
the original basis) and ``value_scales`` (the same for values, ``v_original = v / t``, read by value-based scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .scores import resolve_score


def kept_count(prompt_length: int, ratio: float) -> int:
    """Number of prompt tokens kept at compression ratio ``ratio``: ``ceil((1 - ratio) * n)`` (at least 1 if n > 0)."""
    evicted = math.floor(round(ratio * prompt_length, 6))  # round() absorbs float noise such as 0.9 * 1000
    return max(prompt_length - evicted, min(prompt_length, 1))


class KNormLayer(DynamicLayer):
    """One layer of a :class:`KNormCache`: stores ``keys``/``values`` of shape (B, H_kv, S_kept, D).

    ``positions`` (B, H_kv, S_kept), int64, holds the absolute position of every stored token (per head; tests and
    the decoding budget read it). ``cumulative_length`` counts every token ever seen, evicted or not.
    """

    is_croppable = False

    def __init__(self, cache: KNormCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.cumulative_length = 0
        self.positions: torch.Tensor | None = None
        self.prompt_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        self.positions = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append (B, H_kv, q, D) states, return the full (B, H_kv, S_kept + q, D) states, then evict."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        start = self.cumulative_length
        self.cumulative_length += q_len
        new_positions = torch.arange(start, start + q_len, device=self.device).expand(batch, heads, q_len)
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        full_positions = torch.cat([self.positions, new_positions], dim=-1)

        stored_by_mask = self.cache._mask_stored
        if start > 0 and q_len > 1 and stored_by_mask is not None and self.keys.shape[-2] != stored_by_mask:
            raise ValueError(
                f"This KNormCache holds {self.keys.shape[-2]} tokens in layer {self.layer_idx} but {stored_by_mask} in "
                "another (per-layer ratios): Transformers builds one mask for all layers, so after compression such a "
                "cache takes one token per forward. Feed the tokens one at a time (hf_knorm.knorm.pipeline."
                "append_tokens does), or use the same ratio for every layer."
            )
        keep = full_keys.shape[-2]
        if start == 0 and q_len > 0:  # the prompt: compressed once it has been attended in full
            self.cache._check_positions(kwargs, start, q_len)
            self.prompt_length = q_len
            keep = self.cache._prompt_keep(self.layer_idx, q_len)
        if self.cache.decoding_budget is not None:
            keep = min(keep, self.cache.decoding_budget)
        if keep < full_keys.shape[-2]:
            scores = self.cache.scores(full_keys, full_values, full_positions, self.layer_idx, self.cumulative_length)
            index = scores.topk(keep, dim=-1, largest=False).indices.sort(dim=-1).values  # (B, H_kv, keep)
            self.keys = full_keys.gather(2, index[..., None].expand(-1, -1, -1, full_keys.shape[-1]))
            self.values = full_values.gather(2, index[..., None].expand(-1, -1, -1, full_values.shape[-1]))
            self.positions = full_positions.gather(2, index)
        else:
            self.keys, self.values, self.positions = full_keys, full_values, full_positions
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the stored tokens plus the query, offset so the query's own tokens stay causal."""
        stored = self.keys.shape[-2] if self.is_initialized else 0
        return stored + query_length, self.cumulative_length - stored

    def get_seq_length(self) -> int:
        """Absolute length (every token seen, evicted ones included): positions of new tokens stay true."""
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "KNormCache cannot be cropped (evicted tokens are gone): assisted/speculative decoding is not supported "
            "with it; use a DynamicCache."
        )

    def reset(self) -> None:
        super().reset()
        self.positions, self.prompt_length = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.get_seq_length() > 0:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.get_seq_length() > 0:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.get_seq_length() > 0:
            self.positions = self.positions[indices, ...]


class KNormCache(Cache):
    """KV cache that keeps, per layer and KV head, the prompt tokens with the lowest key L2 norm (arXiv 2406.11430),
    or the highest importance under another query-agnostic ``score``.

    Args:
        compression_ratio (float): Fraction of the prompt to evict, in [0, 1). ``0`` keeps everything (bit-identical to
            a ``DynamicCache``).
        score (str or score object): What decides which tokens are kept: a name of
            :data:`hf_knorm.knorm.scores.SCORES` (``"key_norm"``, the paper's, the default; ``"value_over_key"``,
            ``"key_diff"``, ``"kv_diff"``, ``"recent"``, ``"random"``) or a score instance (e.g. ``Random(seed=3)``,
            ``KeyDiff(pool=5)``).
        budget (int, optional): Keep this many prompt tokens per head instead of using the ratio (must not exceed the
            prompt length).
        sink_tokens (int): Never evict the first ``sink_tokens`` tokens (attention sinks). Default 0.
        recent_window (int): Never evict the last ``recent_window`` tokens. Default 0. Protected tokens count towards
            the kept number; if there are more of them than the ratio allows, all of them are kept.
        layer_ratios (sequence of float or mapping int -> float, optional): Per-layer ratios overriding
            ``compression_ratio`` (a mapping names only the layers it changes).
        decoding_budget (int, optional): Keep at most this many tokens per head at all times, evicting during decoding
            too (bounded memory).
        key_scales (list of torch.Tensor, optional): Per layer a (H_kv, head_dim) tensor ``s``; the score becomes ``||k
            * s||``. For a K/V-balanced model (whose keys are ``k_original / s``) this scores in the original basis;
            ``None`` scores the cached keys as they are.
        value_scales (list of torch.Tensor, optional): Per layer a (H_kv, head_dim) tensor ``t``; scores see ``v / t``
            (a balanced model's values are ``v_original * t``). Only value-based scores read values.
        config (PreTrainedConfig, optional): The model's config. With it the cache checks that the model is a supported
            decoder and gives sliding-window layers (Mistral, Gemma 2/3) Transformers' own sliding layer, uncompressed.
            **Pass it for models with sliding-window layers**; without it every layer is a KNorm layer.
            ``hf_knorm.knorm_generate`` and the ``knorm-text-generation`` pipeline pass it for you.

    Note:
        Shapes: each layer stores keys and values (B, H_kv, S_kept, D) and positions (B, H_kv, S_kept).
        Padded batches are refused (eviction breaks the padding-mask bookkeeping): generate one sequence at a time, or
        batch prompts of equal length. Chunked prefill (``prefill_chunk_size``) would compress only the first chunk: do
        not combine them.
    """

    def __init__(
        self,
        compression_ratio: float = 0.0,
        *,
        budget: int | None = None,
        sink_tokens: int = 0,
        recent_window: int = 0,
        layer_ratios: Sequence[float] | Mapping[int, float] | None = None,
        decoding_budget: int | None = None,
        key_scales: Sequence[torch.Tensor] | None = None,
        value_scales: Sequence[torch.Tensor] | None = None,
        score="key_norm",
        config=None,
    ):
        self.score = resolve_score(score)
        _check_ratio("compression_ratio", compression_ratio)
        if isinstance(layer_ratios, Mapping):
            layer_ratios = dict(layer_ratios)
        elif layer_ratios is not None:
            layer_ratios = dict(enumerate(layer_ratios))
        for layer, ratio in (layer_ratios or {}).items():
            _check_ratio(f"layer_ratios[{layer}]", ratio)
        for name, value in (("sink_tokens", sink_tokens), ("recent_window", recent_window)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        for name, value in (("budget", budget), ("decoding_budget", decoding_budget)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (a number of tokens) or None, got {value!r}.")
        if budget is not None and (compression_ratio or layer_ratios):
            raise ValueError("Give either a token budget or compression ratios, not both.")
        if decoding_budget is not None and decoding_budget < sink_tokens + recent_window:
            raise ValueError(
                f"decoding_budget={decoding_budget} is smaller than the protected tokens (sink_tokens + recent_window "
                f"= {sink_tokens + recent_window}); raise the budget or protect fewer tokens."
            )
        self.compression_ratio, self.budget = float(compression_ratio), budget
        self.sink_tokens, self.recent_window = sink_tokens, recent_window
        self.layer_ratios, self.decoding_budget = layer_ratios or {}, decoding_budget
        self.key_scales = None if key_scales is None else list(key_scales)
        self.value_scales = None if value_scales is None else list(value_scales)
        self._mask_stored: int | None = None  # the stored count the current step's mask was built for
        layers = []
        if config is not None:
            layers = self._layers_for(config)
        super().__init__(layers=layers)

    # --- structure -------------------------------------------------------------------------------------------------
    def _layers_for(self, config) -> list:
        from ..compat import layer_types_and_kwargs

        from ..models.architectures import architecture_of

        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("KNormCache supports decoder-only models; this config is an encoder-decoder.")
        if not architecture_of(config).causal:
            raise ValueError(f"KNormCache needs a decoder; {config.model_type!r} is an encoder (it has no KV cache).")
        config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = layer_types_and_kwargs(config)
        layers = []
        for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                layers.append(KNormLayer(self, index))
            elif kind in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(**kwargs))  # a window is already bounded: left uncompressed
            else:
                raise ValueError(f"KNormCache does not support layers of type {kind!r} (layer {index}).")
        for name in ("key_scales", "value_scales"):
            scales = getattr(self, name)
            if scales is not None and len(scales) != len(layers):
                raise ValueError(f"{name} has {len(scales)} entries; the model has {len(layers)} layers.")
        for layer in self.layer_ratios:
            if not 0 <= layer < len(layers):
                raise ValueError(f"layer_ratios names layer {layer}; the model has layers 0..{len(layers) - 1}.")
        return layers

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # no config given: layers are created on first use
            self.layers.append(KNormLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Mask sizes for KNorm layers from the *largest* of them: with per-layer ratios the stored counts differ,
        and a single-token step's all-True mask, cut from the left by the attention, then fits every layer."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], KNormLayer):
            filled = [layer for layer in self.layers if isinstance(layer, KNormLayer) and layer.is_initialized]
            if filled:
                stored = max(layer.keys.shape[-2] for layer in filled)
                self._mask_stored = stored
                return stored + query_length, filled[0].cumulative_length - stored
        return super().get_mask_sizes(query_length, layer_idx)

    def is_uniform(self) -> bool:
        """True when every KNorm layer stores the same number of tokens (multi-token steps are then allowed)."""
        return len({n for n, layer in zip(self.stored_tokens(), self.layers) if isinstance(layer, KNormLayer)}) <= 1

    @classmethod
    def from_dynamic_cache(cls, cache: Cache, **options) -> KNormCache:
        """Compress a filled (uncompressed) cache as if its contents had been the prompt of a ``KNormCache``.

        Exactly what prefill with a ``KNormCache`` stores, since prefill attends the full prompt either way: one
        prefill can thus be compressed at several ratios. ``cache`` is left unchanged.
        """
        compressed = cls(**options)
        for index, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer or not layer.is_initialized:
                raise ValueError(
                    f"from_dynamic_cache needs a filled DynamicCache of full-attention layers; layer {index} is "
                    f"{type(layer).__name__}."
                )
            compressed.update(layer.keys, layer.values, index)
        return compressed

    # --- scoring ---------------------------------------------------------------------------------------------------
    def _prompt_keep(self, layer_idx: int, prompt_length: int) -> int:
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

    def scores(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int,
               length: int) -> torch.Tensor:
        """Eviction order (B, H_kv, S) of one layer's keys and values (B, H_kv, S, D): the negated importance of
        ``self.score`` (for ``key_norm`` the key L2 norm), low = kept; protected tokens -inf."""
        scale = self._scale("key_scales", layer_idx, keys)
        if scale is not None:
            keys = keys * scale.to(keys)[None, :, None, :]
        scale = self._scale("value_scales", layer_idx, values)
        if scale is not None:
            values = values / scale.to(values)[None, :, None, :]
        scores = -self.score(keys, values, positions, layer_idx)
        protected = positions < self.sink_tokens
        if self.recent_window:
            protected |= positions >= length - self.recent_window
        return scores.masked_fill(protected, float("-inf"))

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

    @staticmethod
    def _check_positions(kwargs: dict, start: int, q_len: int) -> None:
        position_ids = (kwargs.get("kwargs") or {}).get("position_ids")
        if position_ids is None:
            return
        expected = torch.arange(start, start + q_len, device=position_ids.device)
        if not bool((position_ids.reshape(-1, position_ids.shape[-1]) == expected).all()):
            raise ValueError(
                "KNormCache got a padded batch (position ids are not 0..n-1 in every row): eviction breaks the "
                "padding mask. Generate one sequence at a time, or batch prompts of equal length."
            )

    # --- introspection ---------------------------------------------------------------------------------------------
    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute positions (B, H_kv, S_kept) of the tokens a KNorm layer stores, in increasing order per head."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, KNormLayer) or not layer.is_initialized:
            raise ValueError(f"Layer {layer_idx} is not a filled KNorm layer.")
        return layer.positions

    def stored_tokens(self) -> list[int]:
        """Tokens stored per head, layer by layer."""
        return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in self.layers]

    def nbytes(self, include_positions: bool = False) -> int:
        """Bytes held by the cached keys and values (plus the int64 position table if asked)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.nbytes + layer.values.nbytes
                if include_positions and getattr(layer, "positions", None) is not None:
                    total += layer.positions.nbytes
        return total


def _check_ratio(name: str, ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise ValueError(
            f"{name} must be in [0, 1) (the fraction of the prompt to evict), got {ratio!r}; to keep a fixed number "
            "of tokens use budget=."
        )
