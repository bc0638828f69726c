"""The teacher samples' nucleus filter against Transformers' TopPLogitsWarper: the same tokens kept in every row
(peaked and flat distributions, nuclei inside and beyond the candidates), and the same tokens generated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessorList, TopPLogitsWarper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import lm  # noqa: E402

from hf_knorm.conversion.nucleus import NucleusFilter  # noqa: E402


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_it_keeps_the_tokens_the_warper_keeps(top_p):
    generator = torch.Generator().manual_seed(0)
    vocabulary = 5000
    # rows from nearly one-hot to nearly uniform: nuclei of 1 token to thousands
    temperature = torch.logspace(-1.5, 1.2, 96).unsqueeze(-1)
    scores = torch.randn(96, vocabulary, generator=generator) * 3 / temperature
    scores[0, 7] = scores[0].max() + 100.0  # one token holds all the mass
    input_ids = torch.zeros(96, 3, dtype=torch.long)
    expected = TopPLogitsWarper(top_p)(input_ids, scores.clone())
    sizes = (expected > -float("inf")).sum(-1)
    candidates = 64
    assert sizes.min() == 1 and sizes.max() > candidates  # both paths: inside the candidates and the full sort
    filtered = NucleusFilter(top_p, candidates=candidates)(input_ids, scores.clone())
    torch.testing.assert_close(filtered, expected, rtol=0, atol=0)


def test_it_generates_the_warpers_tokens():
    model = lm().eval()
    prompt = torch.randint(0, model.config.vocab_size, (6, 5), generator=torch.Generator().manual_seed(1))

    def draw(**sampler):
        torch.manual_seed(3)
        with torch.no_grad():
            return model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=40,
                                  min_new_tokens=40, pad_token_id=0, **sampler)

    for candidates in (2, 1024):  # the full sort in most rows; no full sort
        ours = draw(top_p=1.0, logits_processor=LogitsProcessorList([NucleusFilter(0.9, candidates)]))
        assert torch.equal(ours, draw(top_p=0.9))


def test_a_top_p_that_filters_nothing_or_everything_is_refused():
    for top_p in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            NucleusFilter(top_p)
    with pytest.raises(ValueError, match="candidates"):
        NucleusFilter(0.9, candidates=0)
