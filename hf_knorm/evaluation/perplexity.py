"""Teacher-forced perplexity of a causal LM on held-out texts, in fixed windows, with a progress bar.

The texts are tokenized, joined (each text's tokens after the previous one's) and cut into non-overlapping windows of
``window`` tokens; each window is one forward pass with no cache and no context from the previous window, and every
token of a window but the first is scored. Perplexity = exp(total NLL / scored tokens). Run it inside
``KVTransform`` and ``routed_through_plugin`` to score a model whose attention reads transformed (compressed) K/V,
or inside ``hf_knorm.patch`` for another normalization. :func:`perplexity_after_compression` scores continuations read
through a compressed KNorm cache instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..compat import cache_kwargs, output_cache


@dataclass(frozen=True)
class PerplexityResult:
    """One evaluation.

    Attributes:
        perplexity (float): ``exp(nll)``.
        nll (float): Mean negative log-likelihood, nats per scored token.
        tokens, windows (int): Scored tokens (each window's first token is not scored) and forward passes.
        compression (float or None): Read through a compressed cache (:func:`perplexity_after_compression`): the mean
            over windows of the share of pairs seen that the cache no longer held after the last token
            (``KNormCache.compression_achieved``); ``None`` otherwise.
    """

    perplexity: float
    nll: float
    tokens: int
    windows: int
    compression: float | None = None


def token_windows(tokenizer, texts: list[str] | str, window: int = 1024,
                  max_tokens: int | None = None) -> list[torch.Tensor]:
    """Cut the tokenized ``texts`` into ``(window,)`` id tensors.

    Args:
        tokenizer: Any callable returning ``{"input_ids": list[int]}`` for a text (a Transformers tokenizer).
        texts (str or list of str): One text or several; their tokens are concatenated in order.
        window (int): Tokens per window (the model's context must hold it).
        max_tokens (int, optional): Stop after this many tokens in all (rounded down to whole windows).

    Returns:
        list of torch.Tensor: ``(window,)`` int64 ids each; a trailing partial window is dropped unless it is the only
        one.

    Raises:
        ValueError: No text, a window shorter than 2 tokens, or fewer than 2 tokens in all.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or window < 2:
        raise ValueError("perplexity needs at least one text and a window of at least 2 tokens.")
    budget = max_tokens if max_tokens is not None else math.inf
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        if len(ids) >= budget:
            break
    ids = ids[: int(min(len(ids), budget))]
    windows = [torch.tensor(ids[i:i + window]) for i in range(0, len(ids) - window + 1, window)]
    if not windows and len(ids) >= 2:
        windows = [torch.tensor(ids)]
    if not windows:
        raise ValueError("The texts hold fewer than 2 tokens; perplexity is undefined.")
    return windows


@torch.no_grad()
def perplexity_of_windows(model: nn.Module, windows: list[torch.Tensor], progress: bool = True,
                          desc: str = "perplexity", labels: list[torch.Tensor] | None = None) -> PerplexityResult:
    """Teacher-forced perplexity of ``model`` over ``windows`` (``(n,)`` id tensors), one window per forward pass.

    ``labels`` (one ``(n,)`` tensor per window, ``-100`` where no loss falls, as a Trainer's ``labels``): only those
    tokens are scored, e.g. a conversation's assistant turns; default: every token but a window's first.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for index, ids in enumerate(tqdm(windows, desc=desc, disable=not progress, leave=False)):
        ids = ids.to(device)[None]  # (1, n)
        targets = ids[0, 1:] if labels is None else labels[index].to(device)[1:]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits  # (1, n, V)
        nll = F.cross_entropy(logits[0, :-1].float(), targets, reduction="sum", ignore_index=-100)
        if not torch.isfinite(nll):
            raise ValueError(f"{desc}: non-finite loss on a window; the model (or its K/V transform) produced NaN/inf.")
        total += nll.item()
        count += int((targets != -100).sum())
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(windows))


def perplexity(model: nn.Module, tokenizer, texts: list[str] | str, window: int = 1024, max_tokens: int | None = None,
               progress: bool = True) -> PerplexityResult:
    """Teacher-forced perplexity of ``model`` on ``texts`` (see :func:`token_windows` and the module docstring)."""
    return perplexity_of_windows(model, token_windows(tokenizer, texts, window, max_tokens), progress)


@torch.no_grad()
def perplexity_after_compression(model: nn.Module, windows: list[torch.Tensor], context: int,
                                 variants: dict[str, dict], progress: bool = True,
                                 tokenizer=None) -> dict[str, PerplexityResult]:
    """Teacher-forced perplexity of each window's continuation read through a compressed KV cache of its beginning.

    Per window (``(n,)`` ids, ``n > context + 1``): the first ``context`` tokens are prefilled **once** into a full
    cache; for each variant that cache is compressed (``KNormCache.from_dynamic_cache(full, config=model.config,
    **options)``, exactly what a ``KNormCache`` prefill stores) and the remaining ``n - context`` tokens are run over
    it teacher-forced, uncompressed (in one forward, or one token per forward for a cache whose layers hold different
    counts; head budgets under the ``knorm_ragged`` attention; a ``decoding_budget`` or ``threshold`` cache keeps
    evicting as it reads them). Scored: every token
    predicted through the compressed cache, i.e. tokens ``context + 1 .. n - 1`` (token ``context`` is predicted by the
    exact prefill and is the same for every variant). ``{}`` (ratio 0) is the uncompressed model.

    Args:
        variants (dict): Row name -> :class:`~hf_knorm.KNormCache` options (``compression_ratio``, ``score``, ...).
        tokenizer: Needed by ``score="kvzip"`` (its reconstruction prompt is text): each window's context is then
            reconstructed once per options but the ratio (:func:`hf_knorm.eviction.reconstruction.reconstruction_scores`)
            and every ratio's cache compressed by that importance.

    Returns:
        dict: Row name -> :class:`PerplexityResult` over all windows.
    """
    from transformers import DynamicCache

    from ..eviction.cache import KNormCache
    from ..eviction.ragged import ragged_attention_for
    from ..eviction.reconstruction import reconstruction_scores, shared_scoring

    device = next(model.parameters()).device
    totals = {name: [0.0, 0, 0.0] for name in variants}  # NLL, tokens, compression summed over windows
    for ids in tqdm(windows, desc="perplexity after compression", disable=not progress, leave=False):
        if ids.shape[0] < context + 2:
            raise ValueError(f"A window of {ids.shape[0]} tokens leaves nothing to score after {context} of context.")
        ids = ids.to(device)[None]  # (1, n)
        full = output_cache(model(input_ids=ids[:, :context], **cache_kwargs(DynamicCache()), use_cache=True))
        continuation = ids[:, context:]  # (1, m)
        reconstructed = {}  # KVzip's importance of this window's context, per options but the ratio
        for name, options in variants.items():
            cache = KNormCache.from_dynamic_cache(full, config=model.config, **options)
            if cache.awaits_importance():
                if tokenizer is None:
                    raise ValueError(f"{name}: score='kvzip' reconstructs the context from its text; pass tokenizer=.")
                shared = shared_scoring(options)
                if shared not in reconstructed:
                    scored = KNormCache.from_dynamic_cache(full, config=model.config, **options)
                    reconstructed[shared] = reconstruction_scores(model, scored, ids[:, :context], tokenizer)
                cache.compress_prompts({index: scores.clone() for index, scores in reconstructed[shared].items()})
            with ragged_attention_for(model, cache):  # head_budget="heads": the attention that masks per head
                if cache.is_uniform():
                    logits = model(input_ids=continuation, **cache_kwargs(cache), use_cache=True).logits  # (1, m, V)
                else:
                    logits = torch.cat([model(input_ids=continuation[:, i:i + 1], **cache_kwargs(cache),
                                              use_cache=True).logits
                                        for i in range(continuation.shape[1])], dim=1)
            nll = F.cross_entropy(logits[0, :-1].float(), continuation[0, 1:], reduction="sum")
            if not torch.isfinite(nll):
                raise ValueError(f"{name}: non-finite loss after compression.")
            totals[name][0] += nll.item()
            totals[name][1] += continuation.shape[1] - 1
            totals[name][2] += cache.compression_achieved()
    return {name: PerplexityResult(math.exp(total / count), total / count, count, len(windows), gone / len(windows))
            for name, (total, count, gone) in totals.items()}
