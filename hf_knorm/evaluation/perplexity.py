"""Teacher-forced perplexity of a causal LM on held-out texts, in fixed windows, with a progress bar.

The texts are tokenized, joined (each text's tokens after the previous one's) and cut into non-overlapping windows of
``window`` tokens; each window is one forward pass with no cache and no context from the previous window, and every
token of a window but the first is scored. Perplexity = exp(total NLL / scored tokens). Run it inside
``KVTransform`` and ``routed_through_plugin`` to score a model whose attention reads transformed (compressed) K/V,
or inside ``hf_knorm.patch`` for another normalization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm


@dataclass(frozen=True)
class PerplexityResult:
    """One evaluation.

    Attributes:
        perplexity (float): ``exp(nll)``.
        nll (float): Mean negative log-likelihood, nats per scored token.
        tokens, windows (int): Scored tokens (each window's first token is not scored) and forward passes.
    """

    perplexity: float
    nll: float
    tokens: int
    windows: int


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
                          desc: str = "perplexity") -> PerplexityResult:
    """Teacher-forced perplexity of ``model`` over ``windows`` (``(n,)`` id tensors), one window per forward pass."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for ids in tqdm(windows, desc=desc, disable=not progress, leave=False):
        ids = ids.to(device)[None]  # (1, n)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits  # (1, n, V)
        nll = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
        if not torch.isfinite(nll):
            raise ValueError(f"{desc}: non-finite loss on a window; the model (or its K/V transform) produced NaN/inf.")
        total += nll.item()
        count += ids.shape[1] - 1
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(windows))


def perplexity(model: nn.Module, tokenizer, texts: list[str] | str, window: int = 1024, max_tokens: int | None = None,
               progress: bool = True) -> PerplexityResult:
    """Teacher-forced perplexity of ``model`` on ``texts`` (see :func:`token_windows` and the module docstring)."""
    return perplexity_of_windows(model, token_windows(tokenizer, texts, window, max_tokens), progress)
