"""Softmax with a sink in the denominator: ``w_ij = e^{s_ij} / (e^{sigma_h} + sum_k e^{s_ik})``.

A row may give weight to nothing (the sink, a key of logit ``sigma_h`` and value 0) instead of parking it on the first
tokens. ``sigma_h`` learned per head is gpt-oss's attention sink (OpenAI, gpt-oss model card, arXiv 2508.10925;
Transformers' ``GptOssAttention.sinks``); ``sigma = 0`` fixed is the "off-by-one" softmax-1 (E. Miller, "Attention
Is Off By One", 2023). Rows sum to less than 1; a row with no key gets zero weights.

Spellings: ``softmax(sink=0)`` (softmax-1), ``softmax(sink=learned)`` (starts at 0), ``softmax(sink=learned(-2))``.
SDPA computes it exactly: the sink is one more key, its logit carried by an extra query dimension
(:mod:`hf_knorm.attention.sdpa`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Learnable, Normalization, _number, arguments, check_keys, masked, read_value
from .routes import SoftmaxLogits

LEARNED_INIT = 0.0


@dataclass(frozen=True)
class SinkSoftmax(Normalization):
    """Attribute ``sink``: the sink's logit, a number or :class:`~.base.Learnable` (per query head)."""

    sink: float | Learnable = 0.0

    family = "sink-softmax"
    formula = "e^s_ij / (e^sigma_h + sum_k e^s_ik) (sigma_h fixed or learned per head)"
    source = "gpt-oss's learned attention sinks (arXiv 2508.10925); softmax-1 (Miller, 2023)"
    examples = ("softmax(sink=learned)", "softmax(sink=0)")
    row_normalizer = "max+sum"

    @property
    def softmax_logits(self) -> SoftmaxLogits:
        """Softmax with one more key of logit ``sigma_h`` and value 0: SDPA computes it with that key prepended."""
        return SoftmaxLogits(sink=self.sink)

    @property
    def name(self) -> str:
        sink = self.sink.spelling(LEARNED_INIT) if isinstance(self.sink, Learnable) else _number(self.sink)
        return f"softmax(sink={sink})"

    def learnable(self):
        return {"sink": self.sink.init} if isinstance(self.sink, Learnable) else {}

    def sink_logit(self, params, like: torch.Tensor) -> torch.Tensor:
        """The sink's logit broadcastable to ``like`` (the scores)."""
        if isinstance(self.sink, Learnable):
            return params["sink"].to(like.dtype)
        return like.new_tensor(float(self.sink))

    def weights(self, scores, allowed, params=None, inplace=False):
        sink = self.sink_logit(params, scores).expand(*scores.shape[:-1], 1)
        logits = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
        with_sink = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)  # the sink's key is always there
        return masked(with_sink[..., :-1].contiguous(), allowed)

    @classmethod
    def parse(cls, text):
        given = arguments(text, "softmax")
        if not given:  # plain softmax, or another family
            return None
        check_keys("softmax", given, ("sink",))
        return cls(sink=read_value("softmax(sink=...)", "sink", given["sink"], LEARNED_INIT))
