"""The polynomial family ``x^p/c`` of "Rethinking Softmax" (Saratchandran, Zheng, Ji, Zhang, Lucey, arXiv 2410.18613).

Softmax bounds the Frobenius norm of the attention matrix by sqrt(N); ``phi(s) = s^p / c`` applied elementwise to
the scaled scores, with ``c = sqrt(N)``, keeps that norm in the same range without normalizing rows.

Semantics chosen here (the paper trained encoders only; causal masks, padding and caches are ours to define):

- ``w_ij = s_ij ** p / c``: no row normalization; an odd power keeps the sign of the score (negative weights are
  intended by the paper).
- Masked pairs contribute exactly 0: the score is zeroed *before* the power (phi(0) = 0, and no inf or NaN can come
  from the power of a large masked value, in the forward or the backward pass).
- ``c = sqrtN``: ``c_i = sqrt(n_i)``, ``n_i`` the keys query ``i`` may attend (:func:`.base.row_counts`), so a token
  gets the same constant in a full prefill and decoded alone against a cache; for an unmasked encoder this is the
  paper's sqrt(N).

Spellings (the paper's legend): ``x/1``, ``x/16``, ``x^3/1``, ``x^3/16`` (``x³/16`` too), ``x^3/sqrtN``; generally
``x^p/c`` with an integer ``p >= 1`` and a constant ``c > 0`` or ``sqrtN``. ``p = 1`` runs in linear time
(:mod:`hf_knorm.attention.linear_kernel`); on CUDA the Triton kernel computes every power.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .base import Normalization, masked, row_counts
from .routes import LogWeight, Pointwise

_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
_SPELLING = re.compile(r"^x(?:\^(?P<power>[+-]?\d+)|(?P<sup>[⁰¹²³⁴⁵⁶⁷⁸⁹]+))?/(?P<constant>sqrt\(?N\)?|[^/]+)$")


@dataclass(frozen=True)
class Polynomial(Normalization):
    """``x^p/c``. Attributes: ``power`` ``p``; ``constant`` ``c`` (``None`` for the sqrtN rule); ``sqrt_n``."""

    power: int
    constant: float | None = None
    sqrt_n: bool = False

    family = "polynomial"
    formula = "s_ij^p / c (c a constant or sqrt(n_i)), no row normalization"
    source = "Saratchandran et al., Rethinking Softmax, arXiv 2410.18613"
    examples = ("x^3/16", "x/1", "x/16", "x^3/1", "x^3/sqrtN")

    @property
    def pointwise(self) -> Pointwise:
        """``s^p / c``: the Triton kernel computes every power, the linear-time kernels ``p = 1``."""
        if self.sqrt_n:
            return Pointwise("power", self.power, row_rule="sqrtN")
        return Pointwise("power", self.power, inv_constant=1.0 / self.constant)

    @property
    def log_weights(self) -> LogWeight | None:
        """An even power's ``p log|s|`` plus ``log r(n)`` (FlexAttention computes it); an odd power has negative
        weights and no logarithm: ``None`` (the Triton kernel computes it)."""
        return self.pointwise.log_form

    def unit_constant_twin(self) -> Polynomial | None:
        return None if self.sqrt_n else Polynomial(power=self.power, constant=1.0)

    @property
    def name(self) -> str:
        base = "x" if self.power == 1 else f"x^{self.power}"
        if self.sqrt_n:
            return f"{base}/sqrtN"
        constant = int(self.constant) if float(self.constant).is_integer() else self.constant
        return f"{base}/{constant}"

    def weights(self, scores, allowed, params=None, inplace=False):
        if allowed is not None:
            scores = masked(scores, allowed, inplace)  # before the power: phi(0) = 0, no inf/NaN from a masked value
        elif not inplace:
            scores = scores.clone()
        if self.power != 1:
            scores.pow_(self.power)
        if not self.sqrt_n:
            return scores.div_(self.constant)
        return scores.mul_(row_counts(scores, allowed).rsqrt_())

    @classmethod
    def parse(cls, text):
        match = _SPELLING.match(text)
        if match is None:
            return None
        power = int(match["power"] or (match["sup"] or "1").translate(_SUPERSCRIPTS))
        if power < 1:
            raise ValueError(f"Normalization {text!r}: the power p must be an integer >= 1, got {power}.")
        constant_text = match["constant"]
        if constant_text.startswith("sqrt"):
            return cls(power=power, sqrt_n=True)
        try:
            constant = float(constant_text)
        except ValueError:
            raise ValueError(f"Normalization {text!r}: the constant c must be a positive number or sqrtN, got "
                             f"{constant_text!r}.") from None
        if not (constant > 0 and math.isfinite(constant)):
            raise ValueError(f"Normalization {text!r}: the constant c must be a finite number > 0, got {constant_text}.")
        return cls(power=power, constant=constant)
