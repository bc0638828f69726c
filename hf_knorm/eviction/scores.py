"""Eviction scores for :class:`~hf_knorm.KNormCache`: which prompt tokens a layer keeps, per KV head.

A score is a small frozen dataclass (its fields are its hyperparameters) called on one layer's cached states::

    score(keys, values, positions, layer_idx) -> importance (B, H_kv, S), float32, higher = kept

- ``keys``, ``values``: (B, H_kv, S, D) as cached (post-RoPE keys), or in the unbalanced model's basis for a K/V-balanced
  model scored with ``score_basis="original"`` (the cache undoes the balancing scales before calling the score);
- ``positions``: (B, H_kv, S) int64, the absolute position of every token;
- ``layer_idx``: the layer (a seeded score draws per layer).

None of them reads the question, so every one works under the kvpress protocol (context compressed before the
question is known). All but :class:`KVzip` read no attention weights either and work with any attention implementation
(SDPA, flash, the plugin's polynomial normalizations); ``KVzip`` reads the softmax attention of a reconstruction pass
(computed by the plugin, :mod:`hf_knorm.eviction.max_weight`), so the cache defers it (``reconstructs = True``: the
importance is handed to :meth:`hf_knorm.KNormCache.compress_prompts`). The cache applies the protections
(``sink_tokens``, ``recent_window``) and the per-layer count on top.

Adding a score: a dataclass here with a ``name`` and a docstring naming its source, an entry in :data:`SCORES`, and a
row in ``tests/eviction/test_knorm_scores.py``'s plain reference (``hf_knorm.eviction.reference.reference_importance``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KeyNorm:
    """The paper's score: keep the keys with the **lowest** L2 norm, importance ``-||k||``.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430
    (kvpress ``KnormPress``). The default of :class:`~hf_knorm.KNormCache`; every earlier result uses it.
    """

    name: ClassVar[str] = "key_norm"

    def __call__(self, keys, values, positions, layer_idx):
        return -keys.float().norm(dim=-1)


@dataclass(frozen=True)
class ValueOverKey:
    """Keep large ``||v|| / ||k||``: the key norm as the proxy of attention (low ``||k||`` = attended, as in KNorm)
    times what an attended token writes into the output, its value's norm.

    A token's contribution to an attention output is its weight times its value; scoring attention times ``||v||`` is
    VATP (Guo et al., "Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value
    Also Matters", arXiv 2406.12335) and the ``use_vnorm`` factor of kvpress's ``ExpectedAttentionPress``; here the
    attention is replaced by KNorm's ``1 / ||k||`` so that no attention weight is needed.
    """

    name: ClassVar[str] = "value_over_key"

    def __call__(self, keys, values, positions, layer_idx):
        return values.float().norm(dim=-1) / keys.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def distinctiveness(states: torch.Tensor) -> torch.Tensor:
    """``-cos(x, a)`` per token, ``a`` the mean of the head's unit vectors: (B, H_kv, S, D) -> (B, H_kv, S) fp32."""
    states = states.float()
    anchor = F.normalize(states, p=2, dim=-1).mean(dim=-2, keepdim=True)  # (B, H_kv, 1, D)
    return -F.cosine_similarity(states, anchor, dim=-1)


def pooled(importance: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean of each token's importance and its neighbours', over a centred window of ``kernel`` (odd) stored tokens
    (cut at the ends): (B, H_kv, S) -> (B, H_kv, S). SnapKV's pooling (Li et al., arXiv 2404.14469), so that a kept
    token tends to keep its neighbours."""
    if kernel == 1:
        return importance
    batch, heads, length = importance.shape
    flat = importance.reshape(batch * heads, 1, length)
    return F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False).reshape(importance.shape)


def _check_pool(pool) -> None:
    if not isinstance(pool, int) or pool < 1 or pool % 2 == 0:
        raise ValueError(f"pool must be an odd integer >= 1 (a centred window of tokens), got {pool!r}.")


@dataclass(frozen=True)
class KeyDiff:
    """Keep the keys least similar to the head's mean direction: importance ``-cos(k, a)``, ``a`` the mean of the
    unit keys of the head (over the tokens being scored).

    KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
    Resource-Constrained Environments", arXiv 2504.15364; kvpress ``KeyDiffPress``): distinctive keys are the ones
    queries can single out; the many near-duplicate keys of filler text are interchangeable.

    Args:
        pool (int): Odd window over which the score is averaged (:func:`pooled`); 1 (the default) is KeyDiff as
            published.
    """

    name: ClassVar[str] = "key_diff"
    pool: int = 1

    def __post_init__(self):
        _check_pool(self.pool)

    def __call__(self, keys, values, positions, layer_idx):
        return pooled(distinctiveness(keys), self.pool)


@dataclass(frozen=True)
class KVDiff:
    """Keep tokens whose key **and** value stand out from the head's mean directions, with their neighbours:
    importance = pooled(z(key distinctiveness) + z(value distinctiveness)), ``z`` standardizing over the head's tokens.

    KeyDiff's score (arXiv 2504.15364) applied to the values as well (what a token writes, as VATP, arXiv 2406.12335,
    argues), each standardized so neither dominates, then averaged over a centred window of ``pool`` tokens as SnapKV
    (arXiv 2404.14469) pools its attention scores: retrieval needs the tokens around a distinctive one (the "magic
    number for Paris is" before the digits), which a per-token score scatters away. The recommended score: the best of
    these on the default model's needle and passkey tests, perplexity within 2% of uncompressed at ratio 0.5
    (docs/results/knorm.md, "Eviction scores").

    Args:
        pool (int): Odd window of the average (:func:`pooled`), default 5.
    """

    name: ClassVar[str] = "kv_diff"
    pool: int = 5

    def __post_init__(self):
        _check_pool(self.pool)

    def __call__(self, keys, values, positions, layer_idx):
        def standardized(x):
            return (x - x.mean(-1, keepdim=True)) / x.std(-1, correction=0, keepdim=True).clamp_min(1e-12)

        return pooled(standardized(distinctiveness(keys)) + standardized(distinctiveness(values)), self.pool)


@dataclass(frozen=True)
class Recent:
    """Keep the most recent tokens: importance = position. With ``sink_tokens=4`` this is StreamingLLM's cache
    (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453; kvpress
    ``StreamingLLMPress``): the query-agnostic baseline of a fixed window."""

    name: ClassVar[str] = "recent"

    def __call__(self, keys, values, positions, layer_idx):
        return positions.float()


@dataclass(frozen=True)
class Random:
    """Evict uniformly at random, reproducibly: the floor every score must beat (kvpress ``RandomPress``).

    The draws come from a CPU generator seeded with ``seed`` and the layer index, one uniform per (batch row, head,
    token), so a run is repeatable on any device.
    """

    name: ClassVar[str] = "random"
    seed: int = 0

    def __call__(self, keys, values, positions, layer_idx):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx)
        return torch.rand(keys.shape[:-1], generator=generator).to(keys.device)


@dataclass(frozen=True)
class KVzip:
    """Keep the pairs the model attends most while it **reconstructs the context** from the cache: importance = the
    largest softmax weight any query of the reconstruction gives the pair (max over the reconstruction's tokens and
    the query heads sharing the KV head; the softmax over the whole row, cached context and the reconstruction's own
    keys causally).

    KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416;
    kvpress ``KVzipPress``, PR #93): after the context is prefilled, the model is fed "Repeat the previous context
    exactly." (in the chat template's user turn) and then the context itself as the assistant's answer, teacher-forced,
    attending to the cached context; a context longer than ``chunk_size`` tokens is repeated chunk by chunk, each chunk
    after the first prompted with "Repeat the part of the previous context exactly, starting with" and the previous
    chunk's last ``tail`` tokens (the authors' prompts and sizes). Query-agnostic like the other scores, but it reads
    attention, so it needs the model: the cache stores the prompt whole until
    :func:`hf_knorm.eviction.reconstruction.compress_by_reconstruction` (run by ``knorm_generate`` and the
    ``knorm-text-generation`` pipeline) has scored it. Cost: about one more prefill (docs/knorm.md).

    Args:
        chunk_size (int): Context tokens repeated per reconstruction forward (the paper: 2k; default 2048).
        tail (int): Tokens of the previous chunk quoted in a later chunk's prompt (default 8, the authors').
    """

    name: ClassVar[str] = "kvzip"
    reconstructs: ClassVar[bool] = True  # the cache waits for compress_by_reconstruction
    shared_scale: ClassVar[bool] = True  # attention weights: comparable across layers and heads (layer_budget="global")
    chunk_size: int = 2048
    tail: int = 8

    def __post_init__(self):
        for field in ("chunk_size", "tail"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < (1 if field == "chunk_size" else 0):
                raise ValueError(f"KVzip's {field} must be an integer >= {1 if field == 'chunk_size' else 0}, "
                                 f"got {value!r}.")

    def __call__(self, keys, values, positions, layer_idx):
        raise ValueError(
            "score='kvzip' ranks the cached pairs by the attention of a reconstruction pass, which needs the model and "
            "its tokenizer: use hf_knorm.eviction.pipeline.knorm_generate(..., tokenizer=...), the "
            "knorm-text-generation pipeline, or hf_knorm.eviction.reconstruction.compress_by_reconstruction after the "
            "prefill."
        )


DEFAULT_SURROGATE = Path(__file__).resolve().parent.parent / "assets" / "kvzap" / "SmolLM2-135M-Instruct.safetensors"
"""The KVzap surrogate shipped with the plugin, fitted on the default model by ``scripts/knorm/fit_kvzap.py``: what
``score="kvzap"`` reads."""


@functools.lru_cache(maxsize=8)
def _surrogate(file: str | None):
    from .surrogate import KVzapSurrogate

    return KVzapSurrogate.load(DEFAULT_SURROGATE if file is None else file)


@dataclass(frozen=True)
class KVzap:
    """Keep the pairs a fitted surrogate predicts KVzip would keep: importance = the surrogate's predicted ``log`` of
    KVzip's importance, from each pair's key (its rotary rotation undone) and value
    (:mod:`hf_knorm.eviction.surrogate`).

    KVzap (arXiv 2601.07891; kvpress ``KVzapPress``) fits a linear map (or an MLP) from hidden states to the log of
    KVzip+'s scores; this one maps the cached keys and values, which are linear in the hidden state, to the log of
    :class:`KVzip`'s own importance, so it needs no reconstruction pass: the cache ranks the prompt at the prefill,
    with any attention implementation, and its values are on one scale across layers and heads
    (``layer_budget="global"``). What it keeps of KVzip's gain: docs/results/knorm.md, "KVzap".

    Args:
        file (str, optional): A surrogate saved by :meth:`~hf_knorm.eviction.surrogate.KVzapSurrogate.save` for the
            model in use; ``None`` (the default, ``score="kvzap"``) is the one shipped for the default model
            (:data:`DEFAULT_SURROGATE`). Calling it on layers of another shape raises;
            :func:`hf_knorm.eviction.pipeline.knorm_cache_for` also checks it belongs to the model.
    """

    name: ClassVar[str] = "kvzap"
    shared_scale: ClassVar[bool] = True  # predicted log attention weights (layer_budget="global")
    file: str | None = None

    def surrogate(self):
        """The fitted :class:`~hf_knorm.eviction.surrogate.KVzapSurrogate` (read once per file)."""
        return _surrogate(None if self.file is None else str(Path(self.file).resolve()))

    def check_model(self, model) -> None:
        """Raise ``ValueError`` unless the surrogate was fitted on ``model`` (:meth:`~hf_knorm.eviction.surrogate.
        KVzapSurrogate.check_model`)."""
        self.surrogate().check_model(model)

    def __call__(self, keys, values, positions, layer_idx):
        return self.surrogate().predict(keys, values, positions, layer_idx)


SCORES: dict[str, type] = {cls.name: cls for cls in (KeyNorm, ValueOverKey, KeyDiff, KVDiff, Recent, Random, KVzip,
                                                 KVzap)}
"""Every score by name; ``KNormCache(score=name)`` builds it with its default hyperparameters."""


def resolve_score(score):
    """A score object from its spelling (:func:`score_spelling`: a name in :data:`SCORES`, optionally with integer
    hyperparameters, e.g. ``"key_diff+pool3"``) or a score instance (any callable with a ``name``).

    Raises:
        ValueError: An unknown name (the message lists the accepted ones) or hyperparameter.
    """
    if isinstance(score, str):
        name, *extras = score.split("+")
        if name not in SCORES:
            raise ValueError(f"Unknown score {score!r}; accepted: {', '.join(SCORES)} (or a score instance from "
                             "hf_knorm.eviction.scores).")
        fields = [field.name for field in dataclasses.fields(SCORES[name]) if field.type in ("int", int)]
        values = {}
        for extra in extras:
            match = re.fullmatch(r"([a-z_]+?)(-?\d+)", extra)
            if not match or match.group(1) not in fields:
                raise ValueError(f"Bad score spelling {score!r}: after the name only integer hyperparameters of "
                                 f"{name} may follow ({', '.join(f'+{f}N' for f in fields) or 'it has none'}).")
            values[match.group(1)] = int(match.group(2))
        return SCORES[name](**values)
    if not callable(score) or not isinstance(getattr(score, "name", None), str):
        raise ValueError(f"score must be one of {', '.join(SCORES)} or a score instance, got {score!r}.")
    return score


def score_spelling(score) -> str:
    """The text that :func:`resolve_score` turns back into ``score``: its name, then each hyperparameter that differs
    from its default as ``+<field><value>`` (``KeyDiff(pool=3)`` -> ``"key_diff+pool3"``, ``KVDiff()`` ->
    ``"kv_diff"``). JSON-serializable, so a score can be recorded in a model's config.

    Raises:
        ValueError: ``score`` is not one of the registered scores of :data:`SCORES` (a custom score has no spelling).
    """
    score = resolve_score(score)
    if SCORES.get(score.name) is not type(score):
        raise ValueError(
            f"Score {score!r} is not one of the registered scores ({', '.join(SCORES)}), so it cannot be written as "
            "text (e.g. into config.json); pass it at call time instead (knorm_cache_for(model, score=...))."
        )
    extras = [(field.name, getattr(score, field.name)) for field in dataclasses.fields(score)
              if getattr(score, field.name) != field.default]
    if any(not isinstance(value, int) for _, value in extras):
        raise ValueError(f"Score {score!r} names a file, which has no spelling as text (e.g. in config.json); pass the "
                         "instance at call time instead (knorm_cache_for(model, score=...)).")
    extras = [f"+{name}{value}" for name, value in extras]
    return score.name + "".join(extras)
