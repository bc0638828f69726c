"""Cached decoding and padded batches through the plugin, for every decoder family.

- Token-by-token decoding with the KV cache gives the logits of the full forward pass (the sqrtN row rule is the
  same in both), through sliding windows (mistral, gemma2, gemma3 windows of 5 < 14 tokens).
- A left-padded batch gives each sequence's own logits and greedy generations.
- Seeded sampling through the plugin draws what the plain reference attention draws (not what softmax draws).
"""

import pytest
import torch
from tiny_models import DECODER_TYPES, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_knorm
from hf_knorm.normalizations import parse_normalization
from hf_knorm.attention.reference import reference_attention
from hf_knorm.attention.masks import explicit_bool_mask
from hf_knorm.compat import cache_kwargs, output_cache

NORMALIZATIONS = ("softmax", "x/1", "x^3/16", "x^3/sqrtN")
ATOL = 1e-4  # fp32, after 2 layers with weights scaled x4 (logits of size ~10)


def _ids(length, seed=0, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.compat
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_token_by_token_decoding_equals_full_forward(model_type, normalization):
    model = hf_knorm.patch(tiny_model(model_type), normalization)
    ids = _ids(14)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :4], use_cache=True)
        steps = [out.logits]
        for position in range(4, 14):
            out = model(input_ids=ids[:, position : position + 1], **cache_kwargs(output_cache(out)), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=ATOL)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_left_padded_batch_equals_each_sequence_alone(model_type, normalization):
    model = hf_knorm.patch(tiny_model(model_type), normalization)
    long, short = _ids(12, seed=1)[0], _ids(7, seed=2)[0]
    pad = model.config.pad_token_id
    ids = torch.stack([long, torch.cat([torch.full((5,), pad), short])])
    mask = torch.stack([torch.ones(12, dtype=torch.long), torch.cat([torch.zeros(5), torch.ones(7)]).long()])
    with torch.no_grad():
        options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=pad)  # no early EOS
        batched = model.generate(input_ids=ids, attention_mask=mask, **options)
        for row, sequence in enumerate((long, short)):
            alone = model.generate(input_ids=sequence[None], **options)
            assert batched[row, 12:].tolist() == alone[0, len(sequence) :].tolist()
        # logits of the real tokens, with positions counted from each sequence's first real token
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        alone_logits = model(input_ids=short[None]).logits
    torch.testing.assert_close(logits[1, 5:], alone_logits[0], rtol=0, atol=ATOL)


def reference_x3_16(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The plain reference attention with ``x^3/16``, as an ``AttentionInterface`` function (for an unpatched model)."""
    return reference_attention(query, key, value, attention_mask, parse_normalization("x^3/16"), scaling=scaling,
                               softcap=kwargs.get("softcap"))


AttentionInterface.register("test_reference_x3_16", reference_x3_16)
AttentionMaskInterface.register("test_reference_x3_16", explicit_bool_mask)


def _sample(model, ids):
    torch.manual_seed(123)
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_neox"])
def test_sampling_follows_the_patched_normalization_and_is_seeded(model_type):
    """Seeded sampling through the plugin repeats, and draws what the plain reference of the same normalization
    draws, from the same logits; the unpatched (softmax) model's logits differ, so the plugin's path is the one taken."""
    ids = _ids(6)
    patched = _sample(hf_knorm.patch(tiny_model(model_type), "x^3/16"), ids)
    again = _sample(hf_knorm.patch(tiny_model(model_type), "x^3/16"), ids)
    reference = _sample(tiny_model(model_type, attn_implementation="test_reference_x3_16"), ids)
    softmax = _sample(tiny_model(model_type), ids)
    assert patched.sequences.shape == (1, 14) and torch.equal(patched.sequences, again.sequences)
    assert torch.equal(patched.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(patched.logits), torch.stack(reference.logits), rtol=0, atol=ATOL)
    assert not torch.allclose(patched.logits[0], softmax.logits[0], rtol=0, atol=1e-2)


@pytest.mark.compat
def test_polynomial_generation_differs_from_softmax():
    """The normalization is really in force during generation (guards against a silent softmax fallback)."""
    model = tiny_model("llama")
    ids = _ids(6)
    with torch.no_grad():
        softmax = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        hf_knorm.patch(model, "x^3/1")
        cubic = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert not torch.equal(softmax, cubic)
