"""Scalable softmax: ``w_ij = softmax_j(s_h * log(n_i) * s_ij)``.

Nakanishi, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399 (Llama 4's attention temperature tuning is
the same idea). Softmax flattens as a row grows; multiplying its scores by ``log n`` keeps the largest one standing
out. ``n_i`` is the keys row ``i`` may attend (:func:`.base.row_counts`: ``i + 1`` for a causal row, the same for
that token decoded alone against its cache).

Spellings: ``ssmax(scale=learned)`` (one ``s_h`` per query head, starting at :data:`LEARNED_INIT`),
``ssmax(scale=learned(0.3))``, ``ssmax(scale=0.144)`` (fixed). SDPA computes it exactly: each query row is
multiplied by its own ``s_h log n_i`` (:mod:`hf_knorm.attention.sdpa`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Learnable, Normalization, _number, arguments, check_keys, read_value, row_counts
from .routes import SoftmaxLogits
from .softmax import Softmax

LEARNED_INIT = 1 / math.log(1024)
"""A learned scale starts where SSMax equals softmax on a row of 1,024 keys (``s_h log n = 1``)."""


@dataclass(frozen=True)
class SSMax(Normalization):
    """Attribute ``scale``: ``s_h``, a number or :class:`~.base.Learnable` (per query head)."""

    scale: float | Learnable = Learnable(LEARNED_INIT)

    family = "ssmax"
    formula = "softmax_j(s_h log(n_i) s_ij) (s_h fixed or learned per head)"
    source = "Nakanishi, Scalable-Softmax, arXiv 2501.19399"
    examples = ("ssmax(scale=learned)", "ssmax(scale=0.144)")
    row_normalizer = "max+sum"

    @property
    def softmax_logits(self) -> SoftmaxLogits:
        """Softmax of the scores times ``s_h log n_i``: SDPA computes it on queries scaled row by row."""
        return SoftmaxLogits(log_n_scale=self.scale)

    @property
    def name(self) -> str:
        scale = self.scale.spelling(LEARNED_INIT) if isinstance(self.scale, Learnable) else _number(self.scale)
        return f"ssmax(scale={scale})"

    def learnable(self):
        return {"scale": self.scale.init} if isinstance(self.scale, Learnable) else {}

    def row_factor(self, params, counts: torch.Tensor) -> torch.Tensor:
        """``s_h * log n_i`` for rows of key counts ``counts`` ``(..., q, 1)``."""
        scale = params["scale"].to(counts.dtype) if isinstance(self.scale, Learnable) else self.scale
        return counts.log() * scale

    def weights(self, scores, allowed, params=None, inplace=False):
        factor = self.row_factor(params, row_counts(scores, allowed))
        return Softmax().weights(scores.mul_(factor) if inplace else scores * factor, allowed, inplace=inplace)

    @classmethod
    def parse(cls, text):
        given = arguments(text, cls.family)
        if given is None:
            return None
        check_keys(cls.family, given, ("scale",))
        return cls(scale=read_value(cls.family, "scale", given.get("scale", "learned"), LEARNED_INIT))
