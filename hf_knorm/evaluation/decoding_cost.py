"""What decoding costs against the length of the context: softmax with its K/V cache, ``x/1`` with its state.

For each context length, a cache is filled to that length and the model decodes ``new_tokens`` more, one forward per
token; the figures are the median seconds per token and the bytes the cache holds. Softmax runs the model's own
attention (SDPA) over a ``DynamicCache``; ``x/1`` (any ``p = 1`` spelling) runs the plugin over a
:class:`~hf_knorm.recurrent.cache.RecurrentStateCache`. The caches are filled with random keys and values (random states): the time of a
decoding step and the size of a cache do not depend on what they hold, and a real 32k-token prefill of both would cost
minutes of the CPU that the measurement does not need (the tests check that prefilled and decoded tokens are exact).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
from transformers import DynamicCache

from ..attention.linear_kernel import is_linear
from ..normalizations import parse_normalization
from ..compat import cache_kwargs
from ..models.patching import patch, patched_normalization, unpatch
from ..plots import plot_scaling
from ..recurrent.cache import RecurrentStateCache


def decoding_cost(model: nn.Module, lengths: list[int], normalizations=("softmax", "x/1"), new_tokens: int = 8,
                  seed: int = 0) -> list[dict]:
    """Seconds per new token and cache bytes at each context length, per normalization.

    Args:
        model: an unpatched causal LM (its own attention is the softmax baseline); patched with each ``p = 1``
            normalization for its rows and unpatched again (the model is left as it came).
        lengths: context lengths (tokens already in the cache).
        normalizations: ``"softmax"`` and/or ``p = 1`` spellings.
        new_tokens: decoded tokens per measurement (after one warm-up token).

    Returns:
        Rows ``{"normalization", "context", "seconds_per_token", "cache_bytes"}``.
    """
    if patched_normalization(model) is not None:
        raise ValueError("decoding_cost measures softmax with the model's own attention: pass an unpatched model.")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for spelling in normalizations:
        normalization = parse_normalization(spelling)
        if not (normalization.is_softmax or is_linear(normalization)):
            raise ValueError(f"decoding_cost compares softmax with p = 1 normalizations (x/1, x/16), not {spelling}.")
        if not normalization.is_softmax:
            patch(model, normalization)
        try:
            for length in lengths:
                cache = _filled_cache(model, normalization.is_softmax, length, generator)
                cache_bytes = _cache_bytes(cache)  # at ``length`` tokens, before decoding
                seconds = _seconds_per_token(model, cache, new_tokens, generator)
                rows.append(dict(normalization=normalization.name, context=length, seconds_per_token=seconds,
                                 cache_bytes=cache_bytes))
        finally:
            if not normalization.is_softmax:
                unpatch(model)
    return rows


def _filled_cache(model: nn.Module, softmax: bool, length: int, generator: torch.Generator):
    """A cache of the kind the model decodes with, holding ``length`` tokens of random content.

    One real token through a fresh cache gives every layer its shapes; then a ``DynamicCache`` gets ``length`` random
    keys and values per layer, and a state cache random states that count ``length`` tokens."""
    cache = DynamicCache() if softmax else RecurrentStateCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_token(model, generator), use_cache=True, **cache_kwargs(cache))
    if softmax:
        filled = DynamicCache()
        for index, layer in enumerate(cache.layers):
            shape = (*layer.keys.shape[:2], length, layer.keys.shape[-1])
            keys = torch.randn(shape, generator=generator).to(layer.keys)
            values = torch.randn((*shape[:-1], layer.values.shape[-1]), generator=generator).to(layer.values)
            filled.update(keys, values, index)
        return filled
    for layer in cache.layers:
        state = torch.randn(layer.state.shape, generator=generator).to(layer.state) * 0.01
        layer.write(state, torch.full_like(layer.count, float(length)))
        layer.cumulative_length = length
    return cache


def _token(model: nn.Module, generator: torch.Generator) -> torch.Tensor:
    vocabulary = model.get_input_embeddings().num_embeddings
    return torch.randint(0, vocabulary, (1, 1), generator=generator).to(model.device)


def _seconds_per_token(model: nn.Module, cache, new_tokens: int, generator: torch.Generator) -> float:
    """Median seconds of one decoding forward (after a warm-up token)."""
    times = []
    with torch.no_grad():
        for step in range(new_tokens + 1):
            token = _token(model, generator)
            start = time.perf_counter()
            model(input_ids=token, use_cache=True, **cache_kwargs(cache))
            if step:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cache_bytes(cache) -> int:
    if isinstance(cache, RecurrentStateCache):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def plot_decoding_cost(rows: list[dict], path):
    """The decoding figure: cache MiB and milliseconds per token against the context, one curve per normalization."""
    names = list(dict.fromkeys(row["normalization"] for row in rows))
    curves = {name: [row for row in rows if row["normalization"] == name] for name in names}
    label = {"softmax": "softmax, K/V cache"}
    return plot_scaling(
        [("cache size", "MiB", [(label.get(name, f"{name}, state"), [r["context"] for r in picked],
                                 [r["cache_bytes"] / 2**20 for r in picked]) for name, picked in curves.items()]),
         ("time per new token", "ms", [(label.get(name, f"{name}, state"), [r["context"] for r in picked],
                                        [r["seconds_per_token"] * 1e3 for r in picked])
                                       for name, picked in curves.items()])],
        path, xlabel="context (tokens)", title="Decoding after a context of N tokens")
