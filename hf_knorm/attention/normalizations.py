"""Attention normalizations: softmax and the polynomial family ``x^p/c`` of "Rethinking Softmax".

Source: Saratchandran, Zheng, Ji, Zhang, Lucey, "Rethinking Softmax: Self-Attention with Polynomial Activations",
arXiv 2410.18613. Softmax bounds the Frobenius norm of the attention matrix by sqrt(N); a polynomial phi(s) = s^p / c
applied elementwise to the scaled scores, with c = sqrt(N), keeps that norm in the same range without normalizing rows.

Semantics chosen here (the paper trained encoders only; causal masks, padding and caches are ours to define):

- s_ij is the model's own score: ``scaling * q_i . k_j`` plus whatever the architecture adds (Gemma2's softcap).
- ``w_ij = s_ij ** p / c``: no row normalization; an odd power keeps the sign of the score (negative weights are
  intended by the paper).
- Masked pairs contribute exactly 0: the score is zeroed *before* the power (phi(0) = 0, and no inf or NaN can come
  from the power of a large masked value, in the forward or the backward pass).
- ``c = sqrtN``: ``c_i = sqrt(number of keys query i may attend)``, so a token gets the same constant whether it is
  computed in a full prefill or decoded alone against a cache; for an unmasked encoder this is the paper's sqrt(N).
- Scores and weights are computed in fp32 whatever the input dtype.

Accepted spellings (the paper's legend): ``softmax``, ``x/1``, ``x/16``, ``x^3/1``, ``x^3/16`` (``x³/16`` too),
``x^3/sqrtN``; generally ``x^p/c`` with an integer ``p >= 1`` and a constant ``c > 0`` or ``sqrtN``.

A polynomial normalization may carry a **softmax window** of ``W`` keys (``x^3/16 + softmax window 64``; in code
``with_window(parse_normalization("x^3/16"), 64)`` or ``hf_knorm.patch(model, "x^3/16", softmax_window=64)``): for
query ``i``, the keys of the last ``W`` positions are weighted by softmax over them, older keys by ``x^p/c``
(:mod:`.window` defines and computes it; LoLCATs arXiv 2410.10254, Liger arXiv 2503.01496). ``W = 0`` is the pure
normalization, the same object. The window may also keep the sequence's first ``S`` keys, the **attention sinks**
(``x^3/16 + softmax window 64 + sinks 4``; ``with_window(..., 64, sinks=4)``, ``patch(..., attention_sinks=4)``):
softmax weights them beside the window, and the polynomial part reads neither (StreamingLLM, Xiao et al., arXiv
2309.17453: a model trained with softmax parks most of many heads' weight on its first tokens, and a window without
them falls apart). The spelling with the window (and sinks) is the normalization's name everywhere (config, card,
reports), and it parses back to the same object.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

ACCEPTED_FORMS = "softmax, x/1, x/16, x^3/1, x^3/16 (x³/16), x^3/sqrtN, or generally x^p/c with integer p >= 1 and c > 0 or sqrtN"
PAPER_NORMALIZATIONS = ("softmax", "x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN")

_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
_WINDOW = re.compile(r"^(?P<base>.*?)\s*\+\s*softmax\s*window\s*(?P<window>\S*)"
                     r"(?:\s*\+\s*sinks\s*(?P<sinks>\S*))?\s*$", re.IGNORECASE)
_POLYNOMIAL = re.compile(r"^x(?:\^(?P<power>[+-]?\d+)|(?P<sup>[⁰¹²³⁴⁵⁶⁷⁸⁹]+))?/(?P<constant>sqrt\(?N\)?|[^/]+)$")


@dataclass(frozen=True)
class Normalization:
    """One attention normalization.

    Attributes:
        power: the exponent ``p`` of ``x^p/c``; ``None`` for softmax.
        constant: the divisor ``c``; ``None`` for softmax and for the sqrtN rule.
        sqrt_n: divide each row by the square root of its number of attended keys.
        window: ``W``, the keys of the last ``W`` positions weighted by softmax (:mod:`.window`); 0 = none.
        sinks: ``S``, each sequence's first ``S`` real tokens, weighted by softmax with the window (attention
            sinks; refused on a layer with its own sliding window, which leaves them behind); 0 = none, and 0
            without a window.
    """

    power: int | None
    constant: float | None = None
    sqrt_n: bool = False
    window: int = 0
    sinks: int = 0

    @property
    def is_softmax(self) -> bool:
        return self.power is None

    @property
    def polynomial(self) -> Normalization:
        """The normalization without its softmax window (itself when it has none): what weights the older keys."""
        return replace(self, window=0, sinks=0) if self.window else self

    @property
    def name(self) -> str:
        """The canonical spelling, e.g. ``"x^3/16"``, ``"x/1"``, ``"x^3/sqrtN"``, ``"softmax"``,
        ``"x^3/16 + softmax window 64"``, ``"x^3/16 + softmax window 64 + sinks 4"``."""
        if self.is_softmax:
            return "softmax"
        if self.window:
            sinks = f" + sinks {self.sinks}" if self.sinks else ""
            return f"{self.polynomial.name} + softmax window {self.window}{sinks}"
        base = "x" if self.power == 1 else f"x^{self.power}"
        if self.sqrt_n:
            return f"{base}/sqrtN"
        constant = int(self.constant) if float(self.constant).is_integer() else self.constant
        return f"{base}/{constant}"

    def __str__(self) -> str:
        return self.name

    def weights(self, scores: torch.Tensor, allowed: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
        """Turn scores into attention weights.

        Args:
            scores: fp32 (or fp64) scores, shape ``(..., q, kv)``.
            allowed: bool mask broadcastable to ``scores`` (True = may attend), or ``None`` for no mask.
            inplace: overwrite ``scores`` (inference only: saves memory traffic; autograd needs the original).

        Returns:
            Weights of the shape of ``scores``; masked pairs are exactly 0, and so is a row with no allowed key.

        Raises:
            ValueError: the normalization has a softmax window (its weights depend on positions: :mod:`.window`).
        """
        if self.window:
            raise ValueError(f"{self.name} weights keys by their position; compute it with "
                             "hf_knorm.attention.window.window_attention (the kernels take its two parts).")
        if self.is_softmax:
            if allowed is None:
                return torch.softmax(scores, dim=-1)
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            # A row with no allowed key (a padded query) is 0/0 in softmax: give it zero weights instead of NaN.
            return weights.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        if not inplace:
            scores = scores.clone()
        if allowed is not None:
            scores.masked_fill_(~allowed, 0.0)  # before the power: phi(0) = 0, and no inf/NaN from a masked value
        if self.power != 1:
            scores.pow_(self.power)
        if not self.sqrt_n:
            return scores.div_(self.constant)
        if allowed is None:
            return scores.div_(math.sqrt(scores.shape[-1]))
        counts = allowed.sum(dim=-1, keepdim=True, dtype=scores.dtype).clamp_min(1.0)
        return scores.div_(counts.sqrt_())


@lru_cache(maxsize=64)
def parse_normalization(spelling: str | Normalization) -> Normalization:
    """Parse a spelling such as ``"x^3/16"`` into a :class:`Normalization`.

    Raises:
        ValueError: the spelling is not one of the accepted forms (the message lists them).
    """
    if isinstance(spelling, Normalization):
        return spelling
    if not isinstance(spelling, str):
        raise ValueError(f"A normalization is a string, got {type(spelling).__name__}. Accepted: {ACCEPTED_FORMS}.")
    windowed = _WINDOW.match(spelling)
    if windowed is not None:
        window = windowed["window"]
        if not window.isdigit():
            raise ValueError(f"Normalization {spelling!r}: the softmax window is a number of keys, an integer >= 0, "
                             f"got {window!r}. Spell it like 'x^3/16 + softmax window 64'.")
        sinks = windowed["sinks"]
        if sinks is not None and not sinks.isdigit():
            raise ValueError(f"Normalization {spelling!r}: the sinks are a number of keys, an integer >= 0, got "
                             f"{sinks!r}. Spell it like 'x^3/16 + softmax window 64 + sinks 4'.")
        return with_window(parse_normalization(windowed["base"]), int(window), sinks=int(sinks or 0))
    text = spelling.strip().replace(" ", "")
    if text.lower() == "softmax":
        return Normalization(power=None)
    match = _POLYNOMIAL.match(text)
    if match is None:
        raise ValueError(f"Unknown normalization {spelling!r}. Accepted: {ACCEPTED_FORMS}.")
    power_text = match["power"] or (match["sup"] or "1").translate(_SUPERSCRIPTS)
    power = int(power_text)
    if power < 1:
        raise ValueError(f"Normalization {spelling!r}: the power p must be an integer >= 1, got {power}.")
    constant_text = match["constant"]
    if constant_text.startswith("sqrt"):
        return Normalization(power=power, sqrt_n=True)
    try:
        constant = float(constant_text)
    except ValueError:
        raise ValueError(
            f"Normalization {spelling!r}: the constant c must be a positive number or sqrtN, got {constant_text!r}. "
            f"Accepted: {ACCEPTED_FORMS}."
        ) from None
    if not (constant > 0 and math.isfinite(constant)):
        raise ValueError(f"Normalization {spelling!r}: the constant c must be a finite number > 0, got {constant_text}.")
    return Normalization(power=power, constant=constant)


def with_window(normalization: Normalization, window: int, sinks: int | None = None) -> Normalization:
    """``normalization`` with a softmax window of ``window`` keys (``0``: without one, the pure normalization) and
    ``sinks`` attention sinks beside it (``None``: the ones ``normalization`` has, else 0).

    Raises:
        ValueError: ``window`` or ``sinks`` is not an integer >= 0, ``normalization`` is softmax (a softmax window on
            softmax is softmax: patch with ``"softmax"`` alone), it already has another window or other sinks, or
            sinks without a window.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"softmax_window is a number of keys, an integer >= 0 (0 = no window), got {window!r}.")
    if sinks is not None and (isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0):
        raise ValueError(f"attention_sinks is a number of keys, an integer >= 0 (0 = none), got {sinks!r}.")
    if window and normalization.is_softmax:
        raise ValueError(f"softmax_window={window} with softmax: every key is already weighted by softmax. Pass "
                         "softmax_window=0, or a polynomial normalization such as 'x^3/16' to weight the keys "
                         "older than the window.")
    if normalization.window and window != normalization.window:
        raise ValueError(f"{normalization.name} already has a softmax window of {normalization.window}; "
                         f"softmax_window={window} contradicts it. Give the window once.")
    if sinks is not None and normalization.sinks and sinks != normalization.sinks:
        raise ValueError(f"{normalization.name} already has {normalization.sinks} attention sinks; "
                         f"attention_sinks={sinks} contradicts it. Give the sinks once.")
    sinks = normalization.sinks if sinks is None else sinks
    if sinks and not window:
        raise ValueError(f"attention_sinks={sinks} without a softmax window: the sinks are keys that softmax weights "
                         "beside the window. Give softmax_window=W > 0 too, or attention_sinks=0.")
    return replace(normalization, window=window, sinks=sinks)
