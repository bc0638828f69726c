"""The crossover: ``generate`` keeps the plain K/V cache for a call whose sequences stay at or below the length where
the recurrent state stops being larger (:mod:`hf_knorm.recurrent.crossover`).

- :func:`state_bytes` bounds what a decoded ``RecurrentStateCache`` holds once full, within 2% of it, for each kind
  of state layer (``x/1``; a window; window, sinks and a sparse cache by a per-token score; the default conversion's
  shape with a prefix score and clusters);
- ``generate`` decodes a model with a sparse cache with a ``DynamicCache`` up to the crossover and the state from one
  token past it, the same tokens either way; a cache passed in is kept; a model without a sparse cache decodes with
  the state below its crossover too.
"""

import pytest
import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.models.cluster_codebook import fit_cluster_codebook
from hf_knorm.recurrent.cache import RecurrentStateCache
from hf_knorm.recurrent.crossover import crossover_length, plain_bytes, state_bytes

from tiny_models import tiny_model

SPELLINGS = ["x/1", "x/16 + softmax window 8", "x/1 + softmax window 8 + sinks 2 + sparse 4 (key_norm)",
             "x/1 + softmax window 8 + sinks 2 + sparse 4 (prefix_kv_diff) + clusters 4"]
KV_HEADS, HEAD_DIM = 2, 16  # the tiny llama's


def _model(spelling: str):
    model = hf_knorm.patch(tiny_model("llama"), spelling).eval()
    if "clusters" in spelling:
        fit_cluster_codebook(model, torch.randint(3, 120, (1, 64), generator=torch.Generator().manual_seed(1)))
    return model


def _ids(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_state_bound_holds_what_a_full_state_cache_holds(spelling):
    model = _model(spelling)
    cache = RecurrentStateCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_ids(30), use_cache=True, **cache_kwargs(cache))  # more than W + S + K + the score's reach
        model(input_ids=_ids(3), use_cache=True, **cache_kwargs(cache))  # and decoded steps after it
    normalization = hf_knorm.parse_normalization(spelling)
    bound = 2 * model.config.num_hidden_layers * state_bytes(normalization, KV_HEADS, HEAD_DIM, torch.float32)
    assert 0.98 * bound <= cache.nbytes() <= bound


def test_the_default_conversions_crossover_is_near_a_thousand_tokens():
    """SmolLM2's 3 KV heads of dimension 64, fp32: about 970 tokens (the issue's 'about 960')."""
    default = hf_knorm.parse_normalization("x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters "
                                           "600")
    assert 950 <= crossover_length(default, 3, 64, torch.float32) <= 990
    assert crossover_length(hf_knorm.parse_normalization("x/1"), 3, 64, torch.float32) == 32
    length = crossover_length(default, 3, 64, torch.float32)
    assert plain_bytes(3, 64, torch.float32, length) <= state_bytes(default, 3, 64, torch.float32) < plain_bytes(
        3, 64, torch.float32, length + 1)


@pytest.mark.parametrize("spelling", SPELLINGS[2:])
def test_generate_keeps_the_plain_cache_up_to_the_crossover_with_the_same_tokens(spelling):
    model = _model(spelling)
    crossover = crossover_length(hf_knorm.parse_normalization(spelling), KV_HEADS, HEAD_DIM, torch.float32)
    prompt = 6
    for longest, kind in [(crossover, DynamicCache), (crossover + 1, RecurrentStateCache)]:
        new = longest + 1 - prompt  # generate's cache holds max_length - 1 tokens
        out = model.generate(_ids(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True)
        assert type(output_cache(out)) is kind, (longest, crossover)
        other = RecurrentStateCache(config=model.config) if kind is DynamicCache else DynamicCache()
        forced = model.generate(_ids(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                return_dict_in_generate=True, **cache_kwargs(other))
        assert output_cache(forced) is other  # a cache passed in is kept
        assert torch.equal(out.sequences, forced.sequences)


@pytest.mark.parametrize("spelling", SPELLINGS[:2])
def test_a_model_without_a_sparse_cache_decodes_with_the_state_below_its_crossover(spelling):
    model = _model(spelling)
    crossover = crossover_length(hf_knorm.parse_normalization(spelling), KV_HEADS, HEAD_DIM, torch.float32)
    out = model.generate(_ids(4), max_new_tokens=crossover - 4, min_new_tokens=crossover - 4, do_sample=False,
                         return_dict_in_generate=True)
    assert type(output_cache(out)) is RecurrentStateCache
