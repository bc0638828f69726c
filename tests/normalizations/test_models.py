"""Every registered family in tiny patched models (``family_cases.py``: one spelling per family, the learnable
variants, softmax windows beside a family), learnable values set to random values away from their inits.

- The model against its twin whose attention is the plain reference (explicit masks), fp64: logits and every
  parameter's gradient (the learnable values included) within 1e-9 of their largest entry; left padding, GQA (4 query
  heads over 2 KV heads); llama, mistral (its own sliding window of 5 positions, shorter than the text) and gemma2
  (softcapped scores, sliding layers): every spelling on llama, one per family and a window on the others (sinks are
  refused on the models with sliding-window layers).
- Token-by-token decoding with the KV cache equals the full forward: fp32 logits within 1e-5 absolute (logits of
  size ~2; measured at most 2.8e-6, over llama, mistral and gemma2).
- Greedy ``generate`` picks the argmax of the full forward re-run on what it generated.
- A Trainer trains each family: the loss and the learnable values stay finite, every learnable value moves, and
  ``NormLoggerCallback`` logs every layer's norms (finite) at every logging step and into ``norms.jsonl``.
- ``hf_knorm.record_norms`` gives the Frobenius norms of the weights the model returns (``output_attentions``).
- ``hf_knorm.save_pretrained`` + ``hf_knorm.from_pretrained`` give identical logits, and the learned values come back;
  so does a plain Transformers load (``hf_knorm`` imported: the learned values are parameters of every model built
  from a patched config, :mod:`hf_knorm.models.parameters`).
- ``torch.compile(fullgraph=True)`` equals eager mode, forward and backward (logits within 1e-5, gradients within
  1e-4 of their largest entry, as tests/attention/test_compile.py), on two families (:data:`COMPILED`).
- A bf16 model against the fp32 model: logits within :data:`BF16_ATOL` (measured: at most 0.063, relu(x)/n, on
  logits of size ~2.5; softmax 0.031), its learnable values in the model's dtype. The error is the bf16 rounding of the
  weights and of the activations around the attention (the attention computes in fp32: on this model, computing it
  in bf16 moves the error by 0.005), so this bounds gross failures (overflow, a value lost in bf16), not the
  attention's own precision.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers as tf
from family_cases import FAMILY_EXAMPLES, SPELLINGS, WITH_SINKS, randomize_learned
from tiny_models import assert_same_step, logits_and_grads, tiny_inputs, tiny_model
from training_helpers import args, history_lines, lm_data
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_knorm
from hf_knorm.attention.interface import normalization_of
from hf_knorm.attention.masks import explicit_bool_mask
from hf_knorm.attention.reference import reference_attention, reference_window_attention
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.models.parameters import PREFIX
from hf_knorm.normalizations import parse_normalization
from hf_knorm.normalizations.windowed import MIX
from hf_knorm.recording.per_step import STATISTICS

REFERENCE = "test_families_reference"
MODEL_TYPES = ("llama", "mistral", "gemma2")
DECODE_ATOL = 1e-5
BF16_ATOL = 0.1
"""bf16 weights and activations against fp32 (the attention itself computes in fp32 either way), on logits of size
~2.5 (real rows of a left-padded batch): measured at most 0.063 over the families (relu(x)/n; x^3/16 0.056, softmax
0.031)."""


def reference_families(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The plain reference of the model's normalization with the module's learnable values, as an
    ``AttentionInterface`` function."""
    normalization = normalization_of(module)
    params = normalization.values_on(module)
    options = dict(scaling=scaling, softcap=kwargs.get("softcap"), params=params)
    if normalization.window:
        output, _ = reference_window_attention(query, key, value, attention_mask, normalization, mix=params[MIX],
                                               **options)
    else:
        output, _ = reference_attention(query, key, value, attention_mask, normalization, **options)
    return output, None


AttentionInterface.register(REFERENCE, reference_families)
AttentionMaskInterface.register(REFERENCE, explicit_bool_mask)


def _patched(model_type: str, spelling: str, dtype=torch.float32, seed: int = 0):
    """A tiny model patched with ``spelling``, its learnable values random (the same for a given seed)."""
    model = hf_knorm.patch(tiny_model(model_type, dtype=dtype), spelling)
    randomize_learned(model, parse_normalization(spelling), seed=seed)
    return model


def _learned(model) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if PREFIX in name}


SLIDING_CASES = (*FAMILY_EXAMPLES, "sigmoid(bias=learned) + softmax window 4")
"""What mistral and gemma2 run (their sliding windows and softcap meet every family in test_kernel.py too): one
spelling per family, and a window beside a learnable family (sinks are refused there: below)."""


def _cases(model_types):
    """(model type, spelling): every spelling on llama, :data:`SLIDING_CASES` on the others."""
    return [(model_type, spelling) for model_type in model_types
            for spelling in (SPELLINGS if model_type == "llama" else SLIDING_CASES)]


@pytest.mark.parametrize("model_type, spelling", _cases(MODEL_TYPES))
def test_the_model_equals_its_reference_twin_with_gradients(model_type, spelling):
    model = _patched(model_type, spelling, dtype=torch.float64)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(REFERENCE)
    inputs = tiny_inputs(model_type, length=10)  # longer than mistral's sliding window (5) and the softmax window (4)
    inputs["attention_mask"][1, :3] = 0  # left padding
    got, want = logits_and_grads(model, inputs), logits_and_grads(reference, inputs)
    assert_same_step(got, want, logits_atol=1e-9 * want[0].abs().max().item(), grads_relative=1e-9, grads_floor=1e-15)
    for name, grad in got[1].items():
        if PREFIX in name:  # the learnable values take part
            assert grad.abs().max() > 0, name


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
@pytest.mark.parametrize("spelling", WITH_SINKS)
def test_sinks_are_refused_on_sliding_window_layers(model_type, spelling):
    with pytest.raises(ValueError, match="own sliding window"):
        hf_knorm.patch(tiny_model(model_type), spelling)


@pytest.mark.parametrize("model_type, spelling", _cases(MODEL_TYPES))
def test_token_by_token_decoding_equals_the_full_forward(model_type, spelling):
    model = _patched(model_type, spelling)
    ids = tiny_inputs(model_type, batch=1, length=10)["input_ids"]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :4], use_cache=True)
        steps = [out.logits]
        for position in range(4, 10):
            out = model(input_ids=ids[:, position: position + 1], **cache_kwargs(output_cache(out)), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=DECODE_ATOL)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_greedy_generation_is_the_argmax_of_the_full_forward(spelling):
    model = _patched("llama", spelling)
    ids = tiny_inputs("llama", batch=1, length=6)["input_ids"]
    with torch.no_grad():
        generated = model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                   pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        full = model(input_ids=generated.sequences).logits[0, 5:-1]
    torch.testing.assert_close(torch.stack(generated.logits, dim=1)[0], full, rtol=0, atol=DECODE_ATOL)
    full[:, model.config.eos_token_id] = -math.inf  # min_new_tokens: generate may not pick EOS
    assert generated.sequences[0, 6:].tolist() == full.argmax(-1).tolist()


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_trainer_trains_every_family_and_the_callback_logs_its_norms(spelling, tmp_path):
    model = _patched("llama", spelling).train()
    before = _learned(model)
    assert set(before) == {f"model.layers.{layer}.self_attn.{PREFIX}{name}" for layer in range(2)
                           for name in parse_normalization(spelling).learnable()}
    trainer = tf.Trainer(model=model, args=args(tmp_path, max_steps=2, logging_steps=1),
                         train_dataset=lm_data(count=8, length=12), callbacks=[hf_knorm.NormLoggerCallback()])
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert [entry["step"] for entry in entries] == [1, 2]
    for entry in entries:
        assert math.isfinite(entry["loss"])
        for layer in range(2):
            for statistic in STATISTICS:
                value = entry[f"norms/layer_{layer:02d}/{statistic}"]
                assert math.isfinite(value) and value > 0, (layer, statistic, value)
    lines = history_lines(tmp_path / "norms.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["normalization"] == spelling and len(line["layers"]) == 2 for line in lines)
    after = _learned(model)
    for name, value in after.items():
        assert torch.isfinite(value).all(), name
        assert (value - before[name]).abs().min() > 0, f"{name} did not move: {before[name]} -> {value}"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_record_norms_reads_the_weights_the_model_computes(spelling):
    model = _patched("llama", spelling)
    inputs = tiny_inputs("llama", length=12)
    inputs["attention_mask"][0, :3] = 0
    with torch.no_grad():
        with hf_knorm.record_norms(model) as recorder:
            model(**inputs)
        attentions = model(**inputs, output_attentions=True).attentions
    assert len(recorder.layers) == len(attentions) == 2
    for layer, weights in zip(recorder.layers, attentions, strict=True):
        frobenius = weights.double().square().sum(dim=(-2, -1)).sqrt().flatten()  # (B * H_q,)
        torch.testing.assert_close(layer.attention_frobenius().double(), frobenius, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(layer.key_channel_norms()).all() and torch.isfinite(layer.value_channel_norms()).all()
    assert hf_knorm.patched_normalization(model) == parse_normalization(spelling).name  # left as it was


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_saved_model_loads_with_its_learned_values_and_identical_logits(spelling, tmp_path):
    model = _patched("llama", spelling, seed=3).eval()
    inputs = tiny_inputs("llama", length=12)
    hf_knorm.save_pretrained(model, tmp_path)
    loaded = hf_knorm.from_pretrained(tmp_path).eval()
    assert loaded.config.hf_knorm["normalization_record"] == parse_normalization(spelling).to_record()
    saved, restored = _learned(model), _learned(loaded)
    assert saved.keys() == restored.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # Transformers' own load, hf_knorm imported
    assert _learned(plain).keys() == saved.keys()
    with torch.no_grad():
        assert torch.equal(plain(**inputs).logits, model(**inputs).logits)


COMPILED = ("sigmoid(bias=learned)", "sigmoid(bias=learned) + softmax window 4")
"""Families compiled: learnable values through the custom op, and a window beside a learnable family (the mix and
the base's value). Backend ``aot_eager``: Dynamo's tracing (no graph break allowed) and AOTAutograd's forward and
backward graphs around the same custom op, 5 s a case; inductor takes 55 s on the first with a cold cache (both pass
it; tests/attention/test_compile.py runs inductor on the op). Every family's custom ops run through the dispatcher
in test_kernel.py."""


@pytest.mark.parametrize("spelling", COMPILED)
def test_the_compiled_model_equals_eager_without_graph_breaks(spelling):
    torch._dynamo.reset()
    model = _patched("llama", spelling).train()
    inputs = tiny_inputs("llama", length=12)
    inputs["attention_mask"][0, :3] = 0
    eager = logits_and_grads(model, inputs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break is an error
    assert_same_step(logits_and_grads(compiled, inputs), eager, logits_atol=1e-5, grads_relative=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_bf16_model_stays_close_to_fp32(spelling):
    inputs = tiny_inputs("llama", length=12)
    inputs["attention_mask"][0, :3] = 0
    half_model = _patched("llama", spelling, dtype=torch.bfloat16)
    assert all(value.dtype == torch.bfloat16 for value in _learned(half_model).values())  # the model's dtype
    with torch.no_grad():
        full = _patched("llama", spelling)(**inputs).logits
        half = half_model(**inputs).logits
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    real = inputs["attention_mask"].bool()  # padded queries are read by nothing
    error = (half.float() - full)[real].abs().max().item()
    assert error < BF16_ATOL, f"bf16 logits {error:.3f} from fp32 (logits of size {full.abs().max():.1f})"
