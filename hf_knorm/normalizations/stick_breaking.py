"""Stick-breaking attention: ``w_ij = beta_ij * prod_{k > j} (1 - beta_ik)``, ``beta = sigma(s)``.

Tan, Shen, Yang, Courville, Panda, "Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth
Study", arXiv 2410.17980. Each row breaks a stick from its most recent key backwards: the nearest key takes the
fraction ``beta`` of what is left, the next one a fraction of the rest, and so on; rows sum to at most 1, and the
order of the keys replaces a position encoding (the model's own RoPE stays: patching changes the weights only).

``k`` runs over the keys row ``i`` may attend after ``j`` (its own key included under a causal mask, as
Transformers' masks have it); masked keys break nothing. Computed in log space: ``log w_ij = log sigma(s_ij) +
sum_{k > j} log sigma(-s_ik)``, a reversed cumulative sum over the row (so a chunk needs whole rows, which the chunked
kernel has).

Its GPU route (:attr:`stick_break`, :class:`~.routes.StickBreak`): flash-linear-attention's Triton kernel
(``fla.ops.stickbreaking_attn``, from the paper's authors' implementation) computes the same weights with
``attend_current=True`` (a row's own key counted), on the calls :mod:`hf_knorm.attention.fla_stick_breaking` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Normalization, arguments, check_keys, masked, minus_inf_masked
from .routes import StickBreak


@dataclass(frozen=True)
class StickBreaking(Normalization):
    family = "stick-breaking"
    formula = "sigmoid(s_ij) prod_{k > j} (1 - sigmoid(s_ik))"
    source = "Tan et al., Stick-breaking attention, arXiv 2410.17980"
    examples = ("stick-breaking",)
    row_normalizer = "row"
    stick_break = StickBreak(own_key=True)

    @property
    def name(self) -> str:
        return "stick-breaking"

    def weights(self, scores, allowed, params=None, inplace=False):
        if inplace:
            return self._products(scores, allowed)
        remaining = masked(F.logsigmoid(-scores), allowed)  # log(1 - beta): 0 for a masked key (breaks nothing)
        later = remaining.flip(-1).cumsum(-1).flip(-1) - remaining  # sum over the keys after j
        return masked(torch.exp(F.logsigmoid(scores) + later), allowed)

    @staticmethod
    def _products(scores, allowed):
        """Inference, ``scores`` overwritten: ``beta_ij * prod_{k > j} (1 - beta_ik)`` as products (one sigmoid
        each for ``beta`` and ``1 - beta`` and a reversed cumulative product, where the log form takes two
        log-sigmoids, a reversed cumulative sum and an exponential, each slower on the CPU); the same weights up to
        rounding, underflowing to 0 where the log form's exponential does."""
        logits = minus_inf_masked(scores, allowed, inplace=True)  # masked: beta = 0, 1 - beta = 1 (breaks nothing)
        kept = logits.flip(-1).neg_().sigmoid_().cumprod_(-1).flip(-1)  # prod_{k >= j} (1 - beta_ik)
        weights = logits.sigmoid_()  # beta
        weights[..., :-1].mul_(kept[..., 1:])  # the last key: beta alone
        return weights

    @classmethod
    def parse(cls, text):
        given = arguments(text, cls.family)
        if given is None:
            return None
        check_keys(cls.family, given, ())
        return cls()
