"""Softpick: ``w_ij = relu(e^{s_ij} - 1) / (sum_k |e^{s_ik} - 1| + eps)``.

Zuhri, Fuadi, Aji, "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax", arXiv 2504.20966.
A key whose score is below 0 gets no weight but still counts in the denominator, so rows sum to at most 1 and need
not put weight anywhere (no attention sink).

Computed as the paper's kernel does, shifted by the row's maximum for range: with ``m = max(0, max_k s_ik)``,
``w_ij = relu(e^{s_ij - m} - e^{-m}) / (sum_k |e^{s_ik - m} - e^{-m}| + eps)`` (the definition itself when every
score is <= 0; ``eps`` is added after the shift, as in the reference implementation). Masked keys are in neither
sum; a row with no key gets zero weights.

Its GPU route (:attr:`Softpick.log_weight_ratio`): the same weights multiplied through by ``e^m``,
``relu(e^s - 1) / (sum_k |e^{s_k} - 1| + eps e^m)``, a ratio of two weights with element-wise logarithms that
FlexAttention computes in two passes (:class:`~.routes.LogWeightRatio`, :mod:`hf_knorm.attention.flex`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Normalization, _number, arguments, check_keys, masked, read_value
from .routes import LogWeightRatio

DEFAULT_EPS = 1e-6
_LOG2_E = 1 / math.log(2)


@dataclass(frozen=True)
class Softpick(Normalization):
    """Attribute ``eps``: the denominator's floor (the paper: 1e-6)."""

    eps: float = DEFAULT_EPS

    family = "softpick"
    formula = "relu(e^s_ij - 1) / (sum_k |e^s_ik - 1| + eps)"
    source = "Zuhri et al., Softpick, arXiv 2504.20966"
    examples = ("softpick",)
    row_normalizer = "max+sum"

    @property
    def log_weight_ratio(self) -> LogWeightRatio:
        """``log relu(e^s - 1)`` over ``log |e^s - 1|`` with the floor ``eps e^m``: FlexAttention's two passes."""
        return LogWeightRatio("expm1", self.eps)

    @property
    def name(self) -> str:
        return "softpick" if self.eps == DEFAULT_EPS else f"softpick(eps={_number(self.eps)})"

    def weights(self, scores, allowed, params=None, inplace=False):
        # Masked scores set to 0 first: m = max(0, max_k s_ik) is the same with them (a row with no key: m = 0).
        moved = masked(scores, allowed, inplace)
        shift = moved.amax(dim=-1, keepdim=True).clamp_min(0.0)
        if not inplace:
            moved = masked(torch.exp(moved - shift) - torch.exp(-shift), allowed)  # masked keys: made exactly 0
            denominator = moved.abs().sum(dim=-1, keepdim=True) + self.eps
            return moved.clamp_min(0.0) / denominator
        # e^x as 2^(x log2 e): PyTorch's exp2 takes half of exp's time on the CPU; the product's rounding adds a
        # relative error of at most |x| 2^-24 (fp32), below 1e-6 for the weights that count (x > -16).
        moved.sub_(shift).mul_(_LOG2_E).exp2_().sub_(shift.neg().exp_())
        moved = masked(moved, allowed, inplace=True)  # e^{-m} - e^{-m}: 0 but for the last bits of two kernels
        total = moved.sum(dim=-1, keepdim=True)
        positive = moved.clamp_min_(0.0).sum(dim=-1, keepdim=True)
        denominator = positive.mul_(2.0).sub_(total).add_(self.eps)  # sum |x| = 2 sum relu(x) - sum x
        return moved.mul_(denominator.reciprocal_())

    @classmethod
    def parse(cls, text):
        given = arguments(text, cls.family)
        if given is None:
            return None
        check_keys(cls.family, given, ("eps",))
        eps = read_value(cls.family, "eps", given.get("eps", str(DEFAULT_EPS)))
        if eps <= 0:
            raise ValueError(f"softpick: eps must be > 0, got {eps}.")
        return cls(eps=eps)
