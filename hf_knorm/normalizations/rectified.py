"""Rectified powers ``relu(s)^p / c``: ReLU attention and squared ReLU.

- ReLU attention, ``relu(s) / n``: Wortsman, Lee, Gilmer, Kornblith, "Replacing softmax with ReLU in Vision
  Transformers", arXiv 2309.08586 (``relu(s) / L``; the ``1/L`` is what makes it work).
- Squared ReLU, ``relu(s)^2 / n``: Hua, Dai, Liu, Le, "Transformer Quality in Linear Time" (FLASH), arXiv 2202.10447.
- ``relu(s)^3 / c``: this project's measurement (docs/research/2026-12-conversion.md, "Why the polynomial part is
  decoration"): unlike the paper's odd ``s^3``, the rectified power gives negative scores no weight, as softmax does.

``w_ij = max(s_ij, 0)^p / c`` on the keys row ``i`` may attend, 0 elsewhere; no row normalization. ``c`` is a
constant, ``n`` (the row's key count, :func:`.base.row_counts`: ``i + 1`` for a causal row) or ``sqrtN``.
Spellings: ``relu(x)/n``, ``relu(x)^2/n``, ``relu(x)^3/16``, ``relu(x)^2/sqrtN``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .base import Normalization, masked, row_counts
from .routes import LogWeight, Pointwise

_SPELLING = re.compile(r"^relu\(x\)(?:\^(?P<power>[+-]?\d+))?/(?P<divisor>.+)$", re.IGNORECASE)
ROW_RULES = ("n", "sqrtN")


@dataclass(frozen=True)
class Rectified(Normalization):
    """``relu(s)^p / c``. Attributes: ``power`` ``p >= 1``; ``divisor``: a number ``c > 0``, ``"n"`` or ``"sqrtN"``."""

    power: int
    divisor: float | str

    family = "rectified"
    formula = "max(s_ij, 0)^p / c (c a constant, n_i or sqrt(n_i)), no row normalization"
    source = "ReLU attention (Wortsman et al., arXiv 2309.08586); squared ReLU (FLASH, arXiv 2202.10447)"
    examples = ("relu(x)/n", "relu(x)^2/n", "relu(x)^3/16")

    @property
    def name(self) -> str:
        base = "relu(x)" if self.power == 1 else f"relu(x)^{self.power}"
        divisor = self.divisor
        if not isinstance(divisor, str) and float(divisor).is_integer():
            divisor = int(divisor)
        return f"{base}/{divisor}"

    @property
    def pointwise(self) -> Pointwise:
        """``max(s, 0)^p / c``: the Triton kernel computes it (and the PyTorch kernel's backward its derivative)."""
        if isinstance(self.divisor, str):
            return Pointwise("relu_power", self.power, row_rule=self.divisor)
        return Pointwise("relu_power", self.power, inv_constant=1.0 / self.divisor)

    @property
    def log_weights(self) -> LogWeight:
        """``p log(s)`` where ``s > 0`` (``-inf`` elsewhere) plus ``log r(n)``: FlexAttention computes it."""
        return self.pointwise.log_form

    def weights(self, scores, allowed, params=None, inplace=False):
        weights = scores.clamp_min_(0.0) if inplace else scores.clamp_min(0.0)
        weights = masked(weights, allowed, inplace)  # masked before the power: no inf from a masked score
        if self.power != 1:
            weights = weights.pow_(self.power) if inplace else weights.pow(self.power)
        if self.divisor == "n":
            factor = row_counts(weights, allowed).reciprocal_()
        elif self.divisor == "sqrtN":
            factor = row_counts(weights, allowed).rsqrt_()
        else:
            return weights.div_(self.divisor) if inplace else weights / self.divisor
        return weights.mul_(factor) if inplace else weights * factor

    @classmethod
    def parse(cls, text):
        match = _SPELLING.match(text)
        if match is None:
            return None
        power = int(match["power"] or 1)
        if power < 1:
            raise ValueError(f"Normalization {text!r}: the power p must be an integer >= 1, got {power}.")
        divisor = match["divisor"]
        rule = {"n": "n", "sqrtn": "sqrtN", "sqrt(n)": "sqrtN"}.get(divisor.lower())
        if rule is not None:
            return cls(power=power, divisor=rule)
        try:
            constant = float(divisor)
        except ValueError:
            constant = math.nan
        if not (constant > 0 and math.isfinite(constant)):
            raise ValueError(f"Normalization {text!r}: the divisor is a finite number > 0, n or sqrtN, got {divisor!r}.")
        return cls(power=power, divisor=constant)
