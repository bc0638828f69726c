"""Nucleus (top-p) filtering without sorting the vocabulary: the teacher samples' sampler.

Nucleus sampling (Holtzman et al., arXiv 1904.09751) keeps, per row, the most probable tokens whose probabilities
sum to ``top_p`` and masks the rest. Transformers' ``TopPLogitsWarper`` finds them by sorting every row of the
``(B, V)`` scores at each generated token; on a CPU that sort is the largest cost after the model itself (SmolLM2:
``V = 49,152``, 32 rows, 167 ms a step on one thread, where the 1,024 largest take 16 ms and the model's forward
about 280 ms). :class:`NucleusFilter` takes the ``candidates`` largest instead and decides there, which is exact
whenever the nucleus fits among them: a token is kept iff the mass of the tokens ranked above it is below ``top_p``
(the warper's rule, "the mass at or below it is above ``1 - top_p``", read from the other end; the most probable
token always kept). A row whose nucleus is larger than ``candidates`` goes to ``TopPLogitsWarper`` itself.

The two sum the probabilities in a different order, so a row could differ only where a token's cumulative mass lies
within float rounding (~1e-7) of the threshold; the sampled tokens are then drawn by the same ``torch.multinomial``
from the same random stream. Tested equal to the warper, mask for mask and token for token
(``tests/conversion/test_nucleus.py``).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, TopPLogitsWarper

CANDIDATES = 1024
"""Tokens per row the nucleus is looked for among before a row falls back to the full sort."""


class NucleusFilter(LogitsProcessor):
    """``scores (B, V)`` with every token outside each row's nucleus set to ``-inf``: the tokens
    ``TopPLogitsWarper(top_p)`` keeps, found among each row's ``candidates`` largest.

    Args:
        top_p: the nucleus's mass, ``0 < top_p < 1``.
        candidates: how many of each row's largest scores to look among (a row whose nucleus is larger is sorted
            whole, by ``TopPLogitsWarper``).

    Raises:
        ValueError: ``top_p`` outside ``(0, 1)`` or ``candidates < 1``.
    """

    def __init__(self, top_p: float, candidates: int = CANDIDATES):
        if not 0 < top_p < 1:
            raise ValueError(f"top_p is the nucleus's probability mass, strictly between 0 and 1 (1 keeps every "
                             f"token: no filter), got {top_p!r}.")
        if candidates < 1:
            raise ValueError(f"candidates is a number of tokens >= 1, got {candidates!r}.")
        self.top_p, self.candidates = float(top_p), int(candidates)
        self.full_sort = TopPLogitsWarper(top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        count = min(self.candidates, scores.shape[-1])
        largest, order = scores.softmax(dim=-1).topk(count, dim=-1)  # (B, count), most probable first
        above = largest.cumsum(dim=-1) - largest  # the mass of the tokens ranked above each
        kept = above < self.top_p
        remove = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, order, ~kept)
        filtered = scores.masked_fill(remove, -float("inf"))
        overflowing = kept[:, -1]  # the last candidate is still inside: the nucleus may go on past the candidates
        if overflowing.any():
            rows = overflowing.nonzero().squeeze(-1)
            filtered[rows] = self.full_sort(input_ids[rows], scores[rows])
        return filtered
