"""Softmax, the control: ``w_ij = e^{s_ij} / sum_k e^{s_ik}`` over the keys row ``i`` may attend.

Through the plugin it equals Transformers' own attention (tested against ``sdpa`` and ``eager`` on every supported
architecture). A row with no key (a padded query) gets zero weights instead of softmax's 0/0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Normalization, arguments, minus_inf_masked
from .routes import SoftmaxLogits


@dataclass(frozen=True)
class Softmax(Normalization):
    """Softmax over the keys each query may attend (spelling ``softmax``): the control, equal to Transformers' own
    attention."""

    family = "softmax"
    formula = "e^s_ij / sum_k e^s_ik"
    source = "Vaswani et al., arXiv 1706.03762"
    examples = ("softmax",)
    row_normalizer = "max+sum"
    softmax_logits = SoftmaxLogits()
    is_softmax = True

    @property
    def name(self) -> str:
        return "softmax"

    def weights(self, scores, allowed, params=None, inplace=False):
        if allowed is None:
            return torch.softmax(scores, dim=-1)
        weights = torch.softmax(minus_inf_masked(scores, allowed, inplace), dim=-1)
        empty = ~allowed.any(dim=-1, keepdim=True)  # a row with no key: 0, not NaN
        return weights.masked_fill_(empty, 0.0) if inplace else weights.masked_fill(empty, 0.0)

    @classmethod
    def parse(cls, text):
        return cls() if arguments(text, cls.family) == {} else None
