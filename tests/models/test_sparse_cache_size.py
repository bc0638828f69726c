"""A patched model's sparse cache resized in place (``hf_knorm.models.sparse_cache_size.set_sparse_cache``).

- Resized, the model is the one a fresh patch with the new cache and the same learned values gives, bit for bit
  (fp64); its learned values and their ``requires_grad`` are kept, and the cache changes its outputs.
- The score is kept, or changed when given; ``0`` is the window and the sinks alone; it is saved and reloaded.
- ``repatch`` without the sinks (an ablation) is a fresh patch without them and the same learned values, bit for bit.
- A model that is not patched, has no window, or a bad size or score is refused, and left as it was.
"""

import dataclasses

import pytest
import torch
from tiny_models import tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.models.patching import held_normalization
from hf_knorm.models.sparse_cache_size import repatch, set_sparse_cache
from hf_knorm.models.window_mix import set_window_mix, window_mixes
from hf_knorm.normalizations.sparse_choice import DEFAULT_SCORE

SPELLING = "x/1 + softmax window 4 + sinks 1 + sparse 3 (key_norm)"


def _mixed(spelling: str = SPELLING):
    model = hf_knorm.patch(tiny_model("llama", dtype=torch.float64), spelling)
    generator = torch.Generator().manual_seed(1)
    set_window_mix(model, [torch.rand(len(layer), generator=generator, dtype=torch.float64) + 0.5
                           for layer in window_mixes(model)])
    return model


def _logits(model) -> torch.Tensor:
    ids = tiny_inputs("llama", batch=2, length=24)["input_ids"]  # 19 keys older than the window: the cache matters
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_resized_model_is_a_fresh_patch_with_its_learned_values():
    model = _mixed()
    mixes = window_mixes(model)
    before = _logits(model)
    next(p for name, p in model.named_parameters() if name.endswith("hf_knorm_window_mix")).requires_grad_(False)

    assert set_sparse_cache(model, 8) is model
    assert hf_knorm.patched_normalization(model) == "x/1 + softmax window 4 + sinks 1 + sparse 8 (key_norm)"
    assert window_mixes(model) == mixes
    frozen = [p.requires_grad for name, p in model.named_parameters() if name.endswith("hf_knorm_window_mix")]
    assert frozen[0] is False and all(frozen[1:])
    fresh = hf_knorm.patch(tiny_model("llama", dtype=torch.float64),
                           "x/1 + softmax window 4 + sinks 1 + sparse 8 (key_norm)")
    set_window_mix(fresh, mixes)
    resized = _logits(model)
    torch.testing.assert_close(resized, _logits(fresh), rtol=0, atol=0)
    assert not torch.allclose(resized, before)  # 8 pairs are not 3

    set_sparse_cache(model, 3)  # and back: the model it was
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)


def test_repatched_without_sinks_the_model_is_a_fresh_patch_without_them_and_its_learned_values():
    model = _mixed()
    mixes, before = window_mixes(model), _logits(model)
    normalization = held_normalization(model)

    repatch(model, normalization, dataclasses.replace(normalization, sinks=0))
    assert hf_knorm.patched_normalization(model) == "x/1 + softmax window 4 + sparse 3 (key_norm)"
    assert window_mixes(model) == mixes
    fresh = hf_knorm.patch(tiny_model("llama", dtype=torch.float64), "x/1 + softmax window 4 + sparse 3 (key_norm)")
    set_window_mix(fresh, mixes)
    torch.testing.assert_close(_logits(model), _logits(fresh), rtol=0, atol=0)
    assert not torch.allclose(_logits(model), before)  # the sink mattered


def test_the_score_is_kept_or_given_and_zero_is_the_window_and_sinks_alone(tmp_path):
    model = _mixed()
    set_sparse_cache(model, 5, "value_over_key")
    assert hf_knorm.patched_normalization(model).endswith("sparse 5 (value_over_key)")
    set_sparse_cache(model, 6)
    assert hf_knorm.patched_normalization(model).endswith("sparse 6 (value_over_key)")
    set_sparse_cache(model, 0)
    assert hf_knorm.patched_normalization(model) == "x/1 + softmax window 4 + sinks 1"
    set_sparse_cache(model, 2)  # no cache before: the library's default score
    assert hf_knorm.patched_normalization(model).endswith(f"sparse 2 ({DEFAULT_SCORE})")

    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model").eval()
    assert hf_knorm.patched_normalization(loaded) == hf_knorm.patched_normalization(model)
    assert window_mixes(loaded) == window_mixes(model)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("sparse, score, message", [
    (-1, None, "integer >= 0"), (2.5, None, "integer >= 0"), (4, "kv_diff", "cannot be chosen the same way"),
    (4, "nope", "Unknown score"),
])
def test_a_bad_size_or_score_is_refused_and_the_model_left_as_it_was(sparse, score, message):
    model = _mixed()
    mixes, before = window_mixes(model), _logits(model)
    with pytest.raises(ValueError, match=message):
        set_sparse_cache(model, sparse, score)
    assert hf_knorm.patched_normalization(model) == SPELLING
    assert window_mixes(model) == mixes
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)


def test_a_model_with_its_own_sliding_window_refuses_a_cache_and_keeps_its_window_and_mix():
    model = hf_knorm.patch(tiny_model("mistral", dtype=torch.float64), "x/1 + softmax window 4")
    set_window_mix(model, [torch.full((len(layer),), 0.25, dtype=torch.float64) for layer in window_mixes(model)])
    mixes, ids = window_mixes(model), tiny_inputs("mistral", batch=1, length=12)["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with pytest.raises(ValueError, match="own sliding window"):
        set_sparse_cache(model, 4)
    assert hf_knorm.patched_normalization(model) == "x/1 + softmax window 4"
    assert window_mixes(model) == mixes
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_a_model_without_a_window_or_not_patched_is_refused():
    with pytest.raises(ValueError, match="not patched"):
        set_sparse_cache(tiny_model("llama"), 4)
    with pytest.raises(ValueError, match="has no softmax window"):
        set_sparse_cache(hf_knorm.patch(tiny_model("llama"), "x/1"), 4)
