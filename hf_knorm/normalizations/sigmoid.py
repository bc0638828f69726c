"""Sigmoid attention ``w_ij = sigma(s_ij + b)``: Ramapuram et al., "Theory, Analysis, and Best Practices for
Sigmoid Self-Attention", arXiv 2409.04431 (ICLR 2025; FlashSigmoid).

No row normalization: each key is weighted by its own score. The bias ``b`` keeps the row's total weight near 1:

- ``bias=-log n``: per row, ``n`` the keys it may attend (:func:`.base.row_counts`: ``i + 1`` for a causal row, the
  same for that token decoded alone against its cache) -- the paper's rule applied to each row;
- ``bias=-6.93`` (a number): the paper's usage, one float ``-log n`` of the training length (``-log 1024``);
- ``bias=learned`` / ``bias=learned(-5)``: one value per query head, an ``nn.Parameter`` starting at
  :data:`LEARNED_INIT` (or the number given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Learnable, Normalization, _number, arguments, check_keys, masked, read_value, row_counts
from .routes import PER_ROW_SHIFT, LogWeight

PER_ROW = PER_ROW_SHIFT
LEARNED_INIT = -math.log(1024)
"""A learned bias starts at the paper's ``-log n`` of a 1,024-token training length."""


@dataclass(frozen=True)
class Sigmoid(Normalization):
    """``sigma(s + b)``. Attribute ``bias``: ``"-log n"``, a number, or :class:`~.base.Learnable`."""

    bias: float | str | Learnable = PER_ROW

    family = "sigmoid"
    formula = "sigmoid(s_ij + b) (b = -log n_i, a constant, or learned per head), no row normalization"
    source = "Ramapuram et al., Sigmoid Self-Attention, arXiv 2409.04431"
    examples = ("sigmoid(bias=-log n)", "sigmoid(bias=learned)", "sigmoid(bias=-6.93)")

    @property
    def name(self) -> str:
        if isinstance(self.bias, Learnable):
            return f"sigmoid(bias={self.bias.spelling(LEARNED_INIT)})"
        return f"sigmoid(bias={self.bias if self.bias == PER_ROW else _number(self.bias)})"

    @property
    def log_weights(self) -> LogWeight:
        """``log sigma(s + b)``: FlexAttention computes it (its log-sum-exp gives the unnormalized sum)."""
        return LogWeight("logsigmoid", shift=self.bias)

    def learnable(self):
        return {"bias": self.bias.init} if isinstance(self.bias, Learnable) else {}

    def weights(self, scores, allowed, params=None, inplace=False):
        if inplace and self.bias == PER_ROW and allowed is not None and allowed.numel() * 4 <= scores.numel():
            # One addition of a mask shared by the heads: -log n on allowed pairs, -inf on masked ones, whose
            # sigmoid is exactly 0 (a pass over the scores less than adding the bias and then masking).
            counts = allowed.sum(dim=-1, keepdim=True, dtype=scores.dtype).clamp_min_(1.0)
            return scores.add_(torch.where(allowed, counts.log_().neg_(), float("-inf"))).sigmoid_()
        if isinstance(self.bias, Learnable):
            bias = params["bias"].to(scores.dtype)
        elif self.bias == PER_ROW:
            bias = -row_counts(scores, allowed).log_()
        else:
            bias = self.bias
        weights = scores.add_(bias).sigmoid_() if inplace else torch.sigmoid(scores + bias)
        return masked(weights, allowed, inplace)

    @classmethod
    def parse(cls, text):
        given = arguments(text, cls.family)
        if given is None:
            return None
        check_keys(cls.family, given, ("bias",))
        bias = given.get("bias", "-logn")
        if bias.replace(" ", "").lower() == "-logn":
            return cls(bias=PER_ROW)
        return cls(bias=read_value(cls.family, "bias", bias, LEARNED_INIT))
