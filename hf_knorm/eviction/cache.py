"""KNorm KV-cache compression: keep the cached keys with the lowest L2 norm (Devoto et al., arXiv 2406.11430).

:class:`KNormCache` is a Transformers :class:`~transformers.Cache` for ``model.generate(..., cache=...)``. It follows
the pattern of Transformers' own evicting layer (``DynamicSlidingWindowLayer``): each ``update`` returns the *full*
states of the current step to the attention, stores fewer, keeps the absolute sequence length (``get_seq_length``) so
new tokens get their true positions, and reports ``get_mask_sizes`` with an offset so the causal mask of later steps
stays right. Kept keys keep their rotation (they are cached post-RoPE).

Who knows what: the cache validates its options once into an :class:`~hf_knorm.eviction.settings.EvictionSettings` and
gives that object to each :class:`KNormLayer` when building it; a layer reads nothing else of the cache. The only
thing a layer needs from the model's call, the position ids (which tell a left-padded batch's padding,
:mod:`hf_knorm.eviction.rows`), reaches it as an explicit argument of ``KNormLayer.update``. ``get_mask_sizes`` has no
side effect: nothing flows from it to ``update``.

The method (the paper's setting, every option off): the first forward pass through the cache (the prompt, "prefill")
attends the prompt in full, so it is exact; then, per layer and per KV head, only the ``ceil((1 - r) * n)`` prompt
tokens whose post-RoPE key has the lowest L2 norm are kept (same count for every head of a layer, positions may
differ between heads), in their original order. Later tokens are appended uncompressed.

Which tokens a layer keeps is decided by a score (``score=``, :mod:`hf_knorm.eviction.scores`): ``"key_norm"``, the
paper's, by default; others need no attention weights either: ``"kv_diff"`` (recommended: it keeps the needle that
``key_norm`` loses on the default model, docs/results/knorm.md, "Eviction scores"), ``"key_diff"``,
``"value_over_key"`` and the baselines ``"recent"`` and ``"random"``. ``"kvzip"`` (KVzip, arXiv 2505.23416) reads the
attention of a reconstruction pass run after the prefill: the layers then store the prompt whole until
:meth:`KNormCache.compress_prompts` gets its importance (:mod:`hf_knorm.eviction.reconstruction` runs both).

Options (all off by default): ``budget`` (keep a token count instead of a ratio), ``sink_tokens`` and
``recent_window`` (never evict the first k / last w tokens; they count towards the kept number), ``layer_ratios``
(per-layer ratios; the authors' code leaves layers 0-1 uncompressed: ``layer_ratios={0: 0.0, 1: 0.0}``),
``decoding_budget`` (keep at most that many tokens per head during decoding too: bounded memory), ``key_scales``
(score ``||k * s||`` instead of ``||k||``: for a K/V-balanced model, whose keys are ``k_original / s``, this scores in
the original basis) and ``value_scales`` (the same for values, ``v_original = v / t``, read by value-based scores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..attention.linear_kernel import is_linear
from ..normalizations import parse_normalization
from ..compat import update_position_ids
from .budgets import global_keep, layer_dispersion, layer_keep_counts
from .layer import KNormLayer
from .ragged import RAGGED_ATTENTION, RaggedKNormLayer, register as register_ragged_attention
from .rows import is_padded_step
from .settings import EvictionSettings, kept_count

__all__ = ["KNormCache", "KNormLayer", "kept_count"]


def _refuse_linear_attention(config) -> None:
    """Raise for a model patched with a ``p = 1`` normalization (it has no growing K/V cache to evict from) or with a
    softmax window (it reads the keys of the last positions, which eviction removes)."""
    normalization = (getattr(config, "hf_knorm", None) or {}).get("normalization")
    if normalization is not None and parse_normalization(normalization).window:
        raise ValueError(
            f"KNormCache evicts keys by their norm, and {normalization} weights the keys of each query's last "
            "positions by softmax: with keys evicted, the cache no longer holds those positions in order. Generate "
            "this model with a normal cache (or RecurrentStateCache for p = 1)."
        )
    if normalization is not None and is_linear(parse_normalization(normalization)):
        raise ValueError(
            f"KNormCache evicts keys from a K/V cache that grows with the context; a model patched with "
            f"{normalization} (linear attention) decodes with a constant-size state instead "
            "(hf_knorm.RecurrentStateCache, what its generate uses), so there is nothing to evict. Use "
            "KNormCache on softmax or x^3 models."
        )


class KNormCache(Cache):
    """KV cache that keeps, per layer and KV head, the prompt tokens with the lowest key L2 norm (arXiv 2406.11430),
    or the highest importance under another query-agnostic ``score``.

    Args:
        compression_ratio (float): Fraction of the prompt to evict, in [0, 1). ``0`` keeps everything (bit-identical to
            a ``DynamicCache``).
        score (str or score object): What decides which tokens are kept: a name of
            :data:`hf_knorm.eviction.scores.SCORES` (``"key_norm"``, the paper's, the default; ``"value_over_key"``,
            ``"key_diff"``, ``"kv_diff"``, ``"recent"``, ``"random"``, ``"kvzip"``, ``"kvzap"``) or a score instance
            (e.g. ``Random(seed=3)``, ``KeyDiff(pool=5)``, ``KVzap(file=...)``). ``"kvzip"`` compresses only when
            :func:`hf_knorm.eviction.reconstruction.compress_by_reconstruction` has scored the prompt (``knorm_generate``
            with ``tokenizer=`` and the pipeline run it); generating before that is refused.
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
        head_budget (str): ``"uniform"`` (default, the paper's: the same count in every head) or ``"heads"``: AdaKV's
            head-adaptive budget (arXiv 2407.11550; :func:`hf_knorm.eviction.budgets.head_adaptive_keep`, per-head
            z-scores in fp32), stored per head compactly (:class:`hf_knorm.eviction.ragged.RaggedKNormLayer`); the
            model must run with the ``"knorm_ragged"`` attention (``knorm_generate`` sets it). Needs ``config``.
        head_floor (float): In [0, 1]; with ``head_budget="heads"`` each head keeps at least ``ceil(head_floor * k)``
            of its uniform share ``k``. Default 0.2 (AdaKV's); ``1`` is the uniform budget exactly.
        layer_budget (str): ``"uniform"`` (default), ``"skip_first"`` (layers 0-1 whole, as the authors' code),
            ``"dispersion"`` (shares from each layer's score dispersion at prefill;
            :func:`hf_knorm.eviction.budgets.layer_keep_counts`) or ``"global"`` (KVzip's pair-level eviction: one
            threshold over every layer's and head's importance, :func:`hf_knorm.eviction.budgets.global_keep`; with
            ``score="kvzip"`` and ``head_budget="heads"``, ``head_floor=0`` as the paper); the total kept is the
            ratio's. Needs ``config``.
        threshold (float, optional): KVzap's threshold pruning (arXiv 2601.07891; kvpress ``ThresholdPress``) instead
            of a ratio: with ``score="kvzap"`` and ``head_budget="heads"``, a pair is evicted when it leaves the last
            ``recent_window`` tokens (KVzap: 128) with a predicted log importance below ``threshold`` (the sinks
            stay), at the prefill and at every decoding step, so the cache's size follows the text
            (:meth:`compression_achieved`). Needs ``config``.
        config (PreTrainedConfig, optional): The model's config. With it the cache checks that the model is a supported
            decoder and gives sliding-window layers (Mistral, Gemma 2/3) Transformers' own sliding layer, uncompressed.
            **Pass it for models with sliding-window layers**; without it every layer is a KNorm layer.
            ``hf_knorm.eviction.pipeline.knorm_generate`` and the ``knorm-text-generation`` pipeline pass it for you.

    Attributes:
        settings (EvictionSettings): The options above, validated, with public fields
            (:mod:`hf_knorm.eviction.settings`); every KNorm layer gets this one object when it is built.

    Note:
        Shapes: each layer stores keys and values (B, H_kv, S_kept, D) and positions (B, H_kv, S_kept); with
        ``head_budget="heads"`` a head-major (C, D) store, one slice per head, and (B, H_kv) slice ends and counts (see
        ``hf_knorm.eviction.ragged``).
        Left-padded batches: each row keeps its own tokens, as its prompt alone (:mod:`hf_knorm.eviction.rows`); the
        model must then attend with ``"knorm_ragged"`` (``knorm_generate`` and the pipeline set it) and the cache
        needs ``config``. :meth:`crop` is exact for tokens appended after the last eviction and refused otherwise.
        Chunked prefill (``prefill_chunk_size``) would compress only the first chunk: do not combine them.
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
        head_budget: str = "uniform",
        head_floor: float = 0.2,
        layer_budget: str = "uniform",
        threshold: float | None = None,
        config=None,
    ):
        self.settings = EvictionSettings(
            compression_ratio=compression_ratio, budget=budget, sink_tokens=sink_tokens, recent_window=recent_window,
            layer_ratios=layer_ratios, decoding_budget=decoding_budget, key_scales=key_scales,
            value_scales=value_scales, score=score, head_budget=head_budget, head_floor=head_floor,
            layer_budget=layer_budget, threshold=threshold,
        )
        if config is None and (head_budget != "uniform" or layer_budget != "uniform"):
            raise ValueError(
                "head_budget/layer_budget need the model's config (KNormCache(..., config=model.config)): the cache "
                "must know the layers (and, for head budgets, check the attention implementation)."
            )
        self.config = None if config is None else config.get_text_config(decoder=True)
        normalization = (getattr(self.config, "hf_knorm", None) or {}).get("normalization")
        if head_budget == "heads" and normalization is not None:
            raise ValueError(
                f"head_budget='heads' attends through the knorm_ragged attention (softmax, SDPA); this model is "
                f"patched with {normalization}, which it would lose. Use head_budget='uniform' with patched models."
            )
        if head_budget == "heads":
            register_ragged_attention()  # the first cache that needs "knorm_ragged" registers it (idempotent)
        super().__init__(layers=[] if config is None else self._layers_for(config))

    # --- structure -------------------------------------------------------------------------------------------------
    def _layers_for(self, config) -> list:
        from ..compat import layer_types_and_kwargs

        from ..models.architectures import architecture_of

        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("KNormCache supports decoder-only models; this config is an encoder-decoder.")
        if not architecture_of(config).causal:
            raise ValueError(f"KNormCache needs a decoder; {config.model_type!r} is an encoder (it has no KV cache).")
        config = config.get_text_config(decoder=True)
        _refuse_linear_attention(config)
        layer_types, layer_kwargs = layer_types_and_kwargs(config)
        layers = []
        for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                layer_class = RaggedKNormLayer if self.settings.head_budget == "heads" else KNormLayer
                layers.append(layer_class(self.settings, index))
            elif kind in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(**kwargs))  # a window is already bounded: left uncompressed
            else:
                raise ValueError(f"KNormCache does not support layers of type {kind!r} (layer {index}).")
        self.settings.check_layer_count(len(layers))
        return layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store (B, H_kv, q, D) states in layer ``layer_idx``; return the states the attention sees (all of them).

        A KNorm layer gets the step's position ids as an explicit argument (:func:`~hf_knorm.compat.
        update_position_ids` reads them from what the model passed). A multi-token step onto a compressed cache is
        refused before any layer changes when the KNorm layers store different counts (see :meth:`is_uniform`).
        """
        while len(self.layers) <= layer_idx:  # no config given: layers are created on first use
            self.layers.append(KNormLayer(self.settings, len(self.layers)))
        layer = self.layers[layer_idx]
        if not isinstance(layer, KNormLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        self._check_multi_token_step(layer, key_states.shape[-2])
        if layer.cumulative_length > 0 and self.awaits_importance():
            raise ValueError(
                f"KNormCache(score={self.settings.score.name!r}) holds the prompt uncompressed until its importance is "
                "computed (a reconstruction pass of the model) and handed to compress_prompts; generating on it now "
                "would never compress it. Use hf_knorm.eviction.pipeline.knorm_generate(..., tokenizer=...) or the "
                "knorm-text-generation pipeline, or call hf_knorm.eviction.reconstruction.compress_by_reconstruction "
                "after the prefill."
            )
        position_ids = update_position_ids(kwargs)
        if isinstance(layer, RaggedKNormLayer):
            self._check_ragged_step(layer, key_states.shape[-2], position_ids)
        elif layer.row_lengths is not None or (key_states.shape[-2] > 1 and is_padded_step(
                position_ids, layer.cumulative_length, key_states.shape[-2])):
            self._check_padded_attention()
        out = layer.update(key_states, value_states, position_ids=position_ids)
        if (self.settings.layer_budget != "uniform" and not self.settings.deferred
                and layer.cumulative_length == layer.prompt_length):
            self._finish_prompt()
        return out

    def _check_ragged_step(self, layer: KNormLayer, q_len: int, position_ids: torch.Tensor | None) -> None:
        """A step after the prompt onto per-head counts needs the ``"knorm_ragged"`` attention (the padding of the
        view must be masked per head) and one token at a time (the causal part of the mask is not rebuilt); a padded
        prompt is refused under another attention before any layer changes (:meth:`_check_padded_attention`)."""
        if layer.cumulative_length == 0:
            if q_len > 1 and is_padded_step(position_ids, 0, q_len):
                self._check_padded_attention()
            return
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation != RAGGED_ATTENTION:
            raise ValueError(
                f"KNormCache(head_budget='heads') stores a different number of tokens per head; the model's attention "
                f"({implementation!r}) would attend the padding. Run the model with "
                f"model.set_attn_implementation({RAGGED_ATTENTION!r}) (hf_knorm.eviction.pipeline.knorm_generate does it for you)."
            )
        if q_len > 1:
            raise ValueError("KNormCache(head_budget='heads') takes one token per forward after the prompt; feed the "
                             "tokens one at a time (hf_knorm.eviction.pipeline.append_tokens does).")

    def _check_padded_attention(self) -> None:
        """A padded batch is attended after its prompt with the layer's own mask of real slots, which only the
        ``"knorm_ragged"`` attention reads (:mod:`hf_knorm.eviction.rows`): refuse it under any other attention,
        before any layer changes."""
        normalization = (getattr(self.config, "hf_knorm", None) or {}).get("normalization")
        if normalization is not None:  # first: the knorm_ragged attention would drop the patch
            raise ValueError(f"KNormCache attends a padded batch through the {RAGGED_ATTENTION!r} attention (softmax, "
                             f"SDPA); this model is patched with {normalization}. Generate one sequence at a time.")
        implementation = getattr(self.config, "_attn_implementation", None)
        if self.config is None or implementation != RAGGED_ATTENTION:
            register_ragged_attention()  # the first padded batch registers the name (idempotent)
            where = ("this KNormCache has no config: build it with KNormCache(..., config=model.config)"
                     if self.config is None else f"the model attends with {implementation!r}")
            raise ValueError(
                f"KNormCache got a padded batch: its rows keep different tokens, which Transformers' padding mask does "
                f"not describe, so the model must attend with the {RAGGED_ATTENTION!r} attention ({where}). Generate "
                f"inside hf_knorm.eviction.ragged.ragged_attention_for(model, cache, padded=True), or run "
                f"model.set_attn_implementation({RAGGED_ATTENTION!r}) first (knorm_generate and the "
                "knorm-text-generation pipeline do it for you), or generate one sequence at a time."
            )

    def _finish_prompt(self, importance: Mapping[int, torch.Tensor] | None = None) -> None:
        """Compress every KNorm layer under the layer schedule once all of them hold the whole prompt (the schedule
        reads every layer's scores). Until then a layer stores its prompt whole: the peak is a full prompt cache,
        as with prefill into a ``DynamicCache``. ``importance`` (layer index -> (B, H_kv, n)): a deferred score's,
        used instead of calling the score."""
        layers = [layer for layer in self.layers if isinstance(layer, KNormLayer)]
        if getattr(self, "_scheduled", False) or any(
                not layer.is_initialized or not layer.prompt_length or layer.cumulative_length != layer.prompt_length
                for layer in layers):
            return
        self._scheduled = True
        if layers[0].row_lengths is not None:  # a padded batch: each row by itself
            if self.settings.layer_budget == "global":
                self._keep_rows_globally(layers, importance)
                return
            for layer in layers:
                layer.compress_rows(None if importance is None else importance[layer.layer_idx])
            return
        n = layers[0].prompt_length
        orders = [layer.prompt_order(None if importance is None else importance[layer.layer_idx]) for layer in layers]
        if self.settings.layer_budget == "global":  # ragged layers (settings: head_budget="heads")
            kept = global_keep(orders, self.settings.prompt_keep(0, n), self.settings.head_floor)
            for layer, mask in zip(layers, kept):
                layer.keep_prompt(mask)
            return
        if self.settings.layer_budget == "uniform":  # a deferred score under the uniform budget (or layer_ratios)
            counts = [self.settings.prompt_keep(layer.layer_idx, n) for layer in layers]
        else:
            keep = self.settings.prompt_keep(0, n)
            dispersions = [layer_dispersion(order) for order in orders]
            low = max(1, min(n, self.settings.sink_tokens + self.settings.recent_window))
            counts = layer_keep_counts(self.settings.layer_budget, n, keep, len(layers), low=low,
                                       dispersions=dispersions)
        for layer, order, count in zip(layers, orders, counts):
            layer.compress_prompt(count, order)

    def _keep_rows_globally(self, layers: list[KNormLayer], importance: Mapping[int, torch.Tensor] | None) -> None:
        """``layer_budget="global"`` on a padded batch (ragged layers): each row's pairs ranked over every layer and
        head on their own, with the row's own length's budget, as the row alone would be."""
        orders = [layer.row_orders(None if importance is None else importance[layer.layer_idx]) for layer in layers]
        kept = [global_keep([per_layer[row][1] for per_layer in orders], self.settings.prompt_keep(0, length),
                            self.settings.head_floor)
                for row, length in enumerate(layers[0].row_lengths.tolist())]
        for index, (layer, per_layer) in enumerate(zip(layers, orders)):
            layer.keep_rows([slots for slots, _ in per_layer], [row[index] for row in kept])

    def awaits_importance(self) -> bool:
        """True when the score is deferred (``score="kvzip"``) and :meth:`compress_prompts` has not run yet."""
        return self.settings.deferred and not getattr(self, "_scored", False)

    def compress_prompts(self, importance: Mapping[int, torch.Tensor]) -> None:
        """Compress the stored prompt of every KNorm layer with a deferred score's importance (``score="kvzip"``,
        computed after the prefill by :func:`hf_knorm.eviction.reconstruction.compress_by_reconstruction`).

        Args:
            importance (mapping int -> torch.Tensor): for every KNorm layer index, (B, H_kv, n) importance of its
                prompt tokens (higher = kept); the budgets, protections and schedules apply as for any score.
        """
        if not self.settings.deferred:
            raise ValueError(f"compress_prompts is for a deferred score (score='kvzip'); this cache's score "
                             f"{self.settings.score.name!r} compresses at the prefill.")
        layers = [layer for layer in self.layers if isinstance(layer, KNormLayer)]
        if getattr(self, "_scored", False) or not layers or any(
                not layer.is_initialized or layer.cumulative_length != layer.prompt_length or not layer.prompt_length
                for layer in layers):
            raise ValueError("compress_prompts needs a KNormCache holding exactly its prompt, uncompressed (prefill it "
                             "once, then call this once).")
        missing = [layer.layer_idx for layer in layers if layer.layer_idx not in importance]
        if missing:
            raise ValueError(f"compress_prompts got no importance for KNorm layer(s) {missing}.")
        self._finish_prompt(importance)
        self._scored = True

    def reset(self) -> None:
        super().reset()
        self._scheduled = self._scored = False

    def _check_multi_token_step(self, layer: KNormLayer, q_len: int) -> None:
        """Refuse q > 1 new tokens after the prompt if the KNorm layers that have not yet received them store
        different counts: Transformers builds one causal mask for all of them (:meth:`get_mask_sizes`), which fits
        only one count. The first layer a step reaches compares every layer, so a refused step changes nothing."""
        start = layer.cumulative_length
        if start == 0 or q_len <= 1 or layer.row_lengths is not None:  # a padded layer masks its own slots
            return
        peers = {other.layer_idx: other.stored_length() for other in self.layers
                 if isinstance(other, KNormLayer) and other.is_initialized and other.cumulative_length == start}
        if len(set(peers.values())) > 1:
            counts = ", ".join(f"layer {index}: {stored}" for index, stored in peers.items())
            raise ValueError(
                f"This KNormCache stores different numbers of tokens per layer ({counts}; per-layer ratios): "
                "Transformers builds one mask for all layers, so after compression such a cache takes one token per "
                "forward. Feed the tokens one at a time (hf_knorm.eviction.pipeline.append_tokens does), or use the same "
                "ratio for every layer."
            )

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Mask sizes for KNorm layers from the *largest* of them: with per-layer ratios the stored counts differ,
        and a single-token step's all-True mask, cut from the left by the attention, then fits every layer."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], KNormLayer):
            filled = [layer for layer in self.layers if isinstance(layer, KNormLayer) and layer.is_initialized]
            if filled:
                stored = max(layer.stored_length() for layer in filled)
                return stored + query_length, filled[0].cumulative_length - stored
        return super().get_mask_sizes(query_length, layer_idx)

    def is_padded(self) -> bool:
        """True when the cache holds a left-padded batch (:mod:`hf_knorm.eviction.rows`): each KNorm layer then masks
        its own dead slots, so steps of several tokens are taken whatever the layers store."""
        return any(getattr(layer, "row_lengths", None) is not None for layer in self.layers)

    def is_uniform(self) -> bool:
        """True when every KNorm layer stores the same number of tokens (multi-token steps are then allowed); never
        with ``head_budget="heads"`` (per-head counts take one token per forward)."""
        if any(isinstance(layer, RaggedKNormLayer) for layer in self.layers):
            return False
        return len({layer.stored_length() for layer in self.layers if isinstance(layer, KNormLayer)}) <= 1

    def takes_several_tokens(self) -> bool:
        """True when a forward after the prompt may carry several tokens: every KNorm layer stores the same count
        (:meth:`is_uniform`), or the batch is padded and its layers mask their own slots (not with
        ``head_budget="heads"``, whose layers take one token per forward, a padding token included)."""
        ragged = any(isinstance(layer, RaggedKNormLayer) for layer in self.layers)
        return self.is_uniform() or (self.is_padded() and not ragged)

    def prefill_from(self, cache: Cache) -> KNormCache:
        """Take the contents of a filled, uncompressed ``cache`` as this empty cache's prompt, and compress them.

        Exactly what prefill through this cache stores, since prefill attends the full prompt either way: one prefill
        (into a ``DynamicCache``) can thus be compressed at several settings. ``cache`` is left unchanged. Returns
        ``self``.
        """
        if self.get_seq_length() > 0:
            raise ValueError("prefill_from needs an empty KNormCache; this one already holds tokens.")
        for index, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer or not layer.is_initialized:
                raise ValueError(
                    f"prefill_from needs a filled DynamicCache of full-attention layers; layer {index} is "
                    f"{type(layer).__name__}."
                )
            self.update(layer.keys, layer.values, index)
        return self

    def can_stack_rows(self) -> bool:
        """True when :meth:`stack_rows` can build this cache: it is empty, every layer is a (uniform) KNorm layer
        (no sliding-window layers, no ``head_budget="heads"``, and the config given, so the layers exist), and the
        layer budget is uniform (a padded batch refuses the others)."""
        return bool(self.layers) and self.get_seq_length() == 0 and self.settings.layer_budget == "uniform" and all(
            type(layer) is KNormLayer for layer in self.layers)

    def stack_rows(self, rows_alone: Sequence[Cache], width: int, prompt_open: bool = False) -> KNormCache:
        """Hold a left-padded batch of contexts as a padded prefill into this cache stores it (each row compressed as
        its context alone, :mod:`hf_knorm.eviction.rows`), from ``rows_alone``: per row, a cache with this cache's
        settings that prefilled that row's real tokens alone. The batch's forward then never computes the padding
        (:func:`hf_knorm.eviction.pipeline.prefill_rows`). ``width``: the batch's padded length. With
        ``prompt_open``, the rows are ``DynamicCache`` s holding the start of each prompt uncompressed, and the next
        step (one token per row: ``generate``'s first) ends every prompt: it is attended whole, then each row is
        compressed as its whole prompt alone (``knorm_generate`` on a padded batch). Returns ``self``.

        Raises:
            ValueError: this cache cannot take stacked rows (:meth:`can_stack_rows`), or a row's cache holds other
                layers, more than one row, or more than ``width`` tokens (with a closed prompt, tokens after it).
        """
        if not self.can_stack_rows():
            raise ValueError("stack_rows needs an empty KNormCache built with the model's config whose layers are all "
                             "uniform KNorm layers (no sliding-window layers, head_budget='uniform').")
        kind = DynamicLayer if prompt_open else KNormLayer
        for index, row in enumerate(rows_alone):
            if [type(layer) for layer in row.layers] != [kind] * len(self.layers) or any(
                    layer.keys.shape[0] != 1 or layer.get_seq_length() > width
                    or (not prompt_open and layer.cumulative_length != layer.prompt_length) for layer in row.layers):
                raise ValueError(f"stack_rows: row {index}'s cache is not one context of at most {width} tokens "
                                 f"prefilled alone through {len(self.layers)} {kind.__name__}s.")
        for index, layer in enumerate(self.layers):
            layer.stack_rows([row.layers[index] for row in rows_alone], width, prompt_open)
        return self

    @classmethod
    def from_dynamic_cache(cls, cache: Cache, **options) -> KNormCache:
        """A new ``KNormCache(**options)`` holding ``cache``'s contents compressed as its prompt
        (:meth:`prefill_from`)."""
        return cls(**options).prefill_from(cache)

    # --- introspection ---------------------------------------------------------------------------------------------
    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute positions (B, H_kv, S_kept) of the tokens a KNorm layer stores, in increasing order per head
        (with ``head_budget="heads"``, S_kept is the longest head's and shorter heads end with ``-1``)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, KNormLayer) or not layer.is_initialized:
            raise ValueError(f"Layer {layer_idx} is not a filled KNorm layer.")
        return layer.padded()[2] if isinstance(layer, RaggedKNormLayer) else layer.positions

    def stored_tokens(self) -> list[int]:
        """Tokens stored per head, layer by layer (with ``head_budget="heads"``: the longest head's)."""
        return [layer.stored_length() if isinstance(layer, KNormLayer) else layer.keys.shape[-2]
                if layer.is_initialized else 0 for layer in self.layers]

    def stored_per_head(self, layer_idx: int) -> torch.Tensor:
        """Tokens a KNorm layer stores in each head, (B, H_kv) int64."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, KNormLayer) or not layer.is_initialized:
            raise ValueError(f"Layer {layer_idx} is not a filled KNorm layer.")
        return layer.stored_per_head()

    def compression_achieved(self) -> float:
        """The share of the tokens seen that the KNorm layers no longer hold, over their layers, heads and batch rows
        (a padded batch's padding not counted): the ratio a :attr:`~EvictionSettings.threshold` cache reached, or a
        ratio cache's own (tokens appended since the last eviction included)."""
        held = seen = 0
        for layer in self.layers:
            if isinstance(layer, KNormLayer) and layer.is_initialized:
                counts = layer.stored_per_head()
                held += int(counts.sum())
                rows = layer.row_lengths if layer.row_lengths is not None else torch.full(
                    counts.shape[:1], layer.cumulative_length)
                seen += int(rows.sum()) * counts.shape[1]
        return 1.0 - held / seen if seen else 0.0

    def nbytes(self, include_positions: bool = False) -> int:
        """Bytes held by the cached keys and values (with ``head_budget="heads"`` the whole store, its free room
        included), plus the index overhead of per-head slices (``ends`` and ``lengths``, (B, H_kv) int64 each per
        layer with ``head_budget="heads"``), plus the int64 position table if asked."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.nbytes + layer.values.nbytes
                for index in ("ends", "lengths"):  # a RaggedKNormLayer's per-head slices
                    if getattr(layer, index, None) is not None:
                        total += getattr(layer, index).nbytes
                if include_positions and getattr(layer, "positions", None) is not None:
                    total += layer.positions.nbytes
        return total
