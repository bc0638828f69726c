"""Teacher-forced perplexity in windows equals Transformers' own loss."""

import math

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from hf_knorm.evaluation.perplexity import perplexity, perplexity_of_windows, token_windows


class _CharTokenizer:
    """One token per character (ids 3..VOCAB-1), enough to test windowing."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


def test_windows_cover_the_tokens_in_order():
    windows = token_windows(_CharTokenizer(), ["abcdefgh", "ijklmnop"], window=5)
    assert [len(w) for w in windows] == [5, 5, 5]  # 16 tokens: the partial last window is dropped
    assert windows[1][0].item() == 3 + ord("f") % (VOCAB - 3)
    assert len(token_windows(_CharTokenizer(), "abcdefgh", window=5, max_tokens=5)) == 1
    assert len(token_windows(_CharTokenizer(), "abc", window=5)[0]) == 3  # a single short window is kept
    with pytest.raises(ValueError):
        token_windows(_CharTokenizer(), ["a"], window=5)


def test_matches_transformers_loss():
    model = tiny_model("llama")
    windows = [torch.randint(3, VOCAB, (17,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    result = perplexity_of_windows(model, windows, progress=False)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    assert result.tokens == 3 * 16 and result.windows == 3
    assert result.nll == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll))
    assert perplexity(model, _CharTokenizer(), "hello world, hello", window=8, progress=False).windows == 2


def test_perplexity_after_compression():
    from hf_knorm.evaluation.perplexity import perplexity_after_compression
    from hf_knorm.eviction.cache import KNormCache

    model = tiny_model("llama")
    windows = [torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    variants = {"full": {}, "half": {"compression_ratio": 0.5, "score": "key_diff"},
                "layer0 kept": {"compression_ratio": 0.5, "layer_ratios": {0: 0.0}},
                # head budgets read through the knorm_ragged attention; a floor of 1 keeps the uniform selection
                "half heads": {"compression_ratio": 0.5, "score": "key_diff", "head_budget": "heads", "head_floor": 1.0},
                "half heads adaptive": {"compression_ratio": 0.5, "score": "key_diff", "head_budget": "heads"}}
    results = perplexity_after_compression(model, windows, context=12, variants=variants, progress=False)
    assert all(r.tokens == 2 * 7 and r.windows == 2 for r in results.values())
    with torch.no_grad():  # ratio 0: the plain model's loss on the continuation's tokens 13..19
        logits = [model(input_ids=w[None]).logits[0, 12:-1] for w in windows]
        nll = sum(torch.nn.functional.cross_entropy(l, w[13:], reduction="sum").item() for l, w in zip(logits, windows))
        # a compressed variant equals prefilling a KNormCache and teacher-forcing the continuation over it
        direct = 0.0
        for w in windows:
            cache = KNormCache(0.5, score="key_diff", config=model.config)
            model(input_ids=w[None, :12], cache=cache, use_cache=True)
            out = model(input_ids=w[None, 12:], cache=cache, use_cache=True).logits[0, :-1]
            direct += torch.nn.functional.cross_entropy(out, w[13:], reduction="sum").item()
    assert results["full"].nll == pytest.approx(nll / 14, rel=1e-5)
    assert results["half"].nll == pytest.approx(direct / 14, rel=1e-5)
    assert results["half"].nll != pytest.approx(results["full"].nll, rel=1e-4)
    assert math.isfinite(results["layer0 kept"].nll)
    assert results["half heads"].nll == pytest.approx(results["half"].nll, rel=1e-5)
    assert math.isfinite(results["half heads adaptive"].nll)
    # the share gone after the last token: none for the full cache; 6 of the 12 context tokens of the 20 read
    assert results["full"].compression == 0.0 and results["half"].compression == pytest.approx(6 / 20)
    with pytest.raises(ValueError, match="nothing to score"):
        perplexity_after_compression(model, windows, context=19, variants=variants, progress=False)
