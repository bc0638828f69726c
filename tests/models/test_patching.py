"""Patching every registered family: softmax equals Transformers' own attention; guards; unpatch restores."""

import copy

import pytest
import torch
import transformers as tf
from tiny_models import ALL_TYPES, DECODER_TYPES, tiny_config, tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.models.architectures import SUPPORTED_ARCHITECTURES

pytestmark = pytest.mark.compat


def _output(model, inputs, **kwargs):
    out = model(**inputs, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _padded(model_type, inputs):
    """Right padding for encoders, left padding for decoders: the second row loses its first/last 4 tokens."""
    if "attention_mask" in inputs:
        inputs = dict(inputs, attention_mask=inputs["attention_mask"].clone())
        if model_type in DECODER_TYPES:
            inputs["attention_mask"][1, :4] = 0
            inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp_min(0)
        else:
            inputs["attention_mask"][1, -4:] = 0
    return inputs


@pytest.mark.parametrize("model_type", ALL_TYPES)
@pytest.mark.parametrize("padding", [False, True], ids=["full", "padded"])
def test_softmax_through_the_plugin_equals_the_native_attention(model_type, padding):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model_type, length=16)
    if padding:
        inputs = _padded(model_type, inputs)
    with torch.no_grad():
        native = _output(model, inputs)
        hf_knorm.patch(model, "softmax")
        ours = _output(model, inputs)
    real = inputs.get("attention_mask", torch.ones(native.shape[:2])).bool()
    torch.testing.assert_close(ours[real], native[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_softmax_gradients_equal_the_native_attention(model_type):
    native_model = tiny_model(model_type)
    patched = hf_knorm.patch(copy.deepcopy(native_model), "softmax")
    inputs = tiny_inputs(model_type, length=10)
    grads = []
    for model in (native_model, patched):
        model.zero_grad()
        _output(model, inputs).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "bert"])
def test_output_attentions_returns_post_normalization_weights(model_type):
    model = hf_knorm.patch(tiny_model(model_type), "x^3/16")
    inputs = _padded(model_type, tiny_inputs(model_type, length=8))
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    weights = out.attentions[0]
    assert weights.shape == (2, 4, 8, 8)
    mask = inputs["attention_mask"].bool()
    # masked keys get exactly zero weight; polynomial rows are not normalized
    assert (weights[1][..., ~mask[1]] == 0).all()
    assert not torch.allclose(weights[0].sum(-1), torch.ones(4, 8))


def test_output_attentions_softmax_equals_eager():
    eager = tiny_model("llama", attn_implementation="eager")
    patched = hf_knorm.patch(copy.deepcopy(eager), "softmax")
    inputs = tiny_inputs("llama", length=8)
    with torch.no_grad():
        expected = eager(**inputs, output_attentions=True).attentions
        ours = patched(**inputs, output_attentions=True).attentions
    assert len(ours) == len(expected) == eager.config.num_hidden_layers
    for layer_expected, layer_ours in zip(expected, ours):
        torch.testing.assert_close(layer_ours, layer_expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_unpatch_restores_exactly(model_type):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model_type)
    original_config = model.config.to_dict()
    with torch.no_grad():
        before = _output(model, inputs)
        hf_knorm.patch(model, "x^3/16")
        during = _output(model, inputs)
        hf_knorm.unpatch(model)
        after = _output(model, inputs)
    assert not torch.allclose(before, during)
    assert torch.equal(before, after)
    assert model.config._attn_implementation == tiny_model(model_type).config._attn_implementation
    assert model.config.to_dict() == original_config


def test_patching_twice():
    model = hf_knorm.patch(tiny_model("llama"), "x/16")
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        once = _output(model, inputs)
        with pytest.warns(UserWarning, match="already patched with x/16"):
            hf_knorm.patch(model, "x/16")
        assert torch.equal(_output(model, inputs), once)
    with pytest.raises(ValueError, match=r"already patched with x/16.*unpatch"):
        hf_knorm.patch(model, "x^3/16")
    hf_knorm.unpatch(model)
    hf_knorm.patch(model, "x^3/16")
    assert hf_knorm.patched_normalization(model) == "x^3/16"


def test_unpatching_an_unpatched_model_raises():
    with pytest.raises(ValueError, match="not patched"):
        hf_knorm.unpatch(tiny_model("llama"))


@pytest.mark.parametrize(
    "config",
    [
        tf.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4),
        tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
    ],
    ids=["falcon", "bloom"],
)
def test_unsupported_architecture_names_the_supported_ones(config):
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"does not support model_type .*Supported: bert, gemma2"):
        hf_knorm.patch(model, "x^3/16")


def test_unknown_normalization_leaves_the_model_untouched():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="Unknown normalization"):
        hf_knorm.patch(model, "cubic")
    assert hf_knorm.patched_normalization(model) is None and model.config._attn_implementation == "sdpa"


def test_patch_is_per_instance():
    first, second = tiny_model("llama"), tiny_model("llama")
    hf_knorm.patch(first, "x^3/16")
    hf_knorm.patch(second, "x/1")
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        a, b = _output(first, inputs), _output(second, inputs)
    assert not torch.allclose(a, b)
    assert tiny_model("llama").config._attn_implementation == "sdpa"


def test_every_registered_architecture_has_a_tiny_model():
    assert set(SUPPORTED_ARCHITECTURES) == set(ALL_TYPES)
    for model_type in ALL_TYPES:
        assert tiny_config(model_type).model_type == model_type
        assert hf_knorm.models.architectures.attention_modules(tiny_model(model_type))


def test_training_step_runs_and_matches_across_chunk_sizes(monkeypatch):
    """A training step's gradients do not depend on how the rows are chunked (40 rows in 1 chunk or in 8)."""
    from hf_knorm.attention import kernel

    model = hf_knorm.patch(tiny_model("mistral"), "x^3/16").train()
    inputs = tiny_inputs("mistral", length=40)
    grads = []
    for chunk_elements in (1 << 20, 2 * 4 * 5 * 40):
        monkeypatch.setattr(kernel, "DEFAULT_CHUNK_ELEMENTS", chunk_elements)
        model.zero_grad()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_models(dtype):
    """Softmax through the plugin is as exact in half precision as Transformers' own attention; x^3/1 stays finite.

    Tolerance, from the dtype's resolution: the exact result is the same (half-rounded) weights and inputs run in
    fp32 with Transformers' attention. Transformers' own half-precision run is within ``2 eps`` of the logits' scale
    of it (measured: about ``1 eps``, 0.019 in bf16 and 0.0026 in fp16 at logits of ~2.4), and ours must be within
    twice Transformers' own error (measured: 1.2x in bf16, 0.9x in fp16). A defect of the attention (a mask, a
    scale) moves logits by far more than a few ulps.
    """
    model = tiny_model("llama", dtype=dtype)
    exact = copy.deepcopy(model).float()
    inputs = _padded("llama", tiny_inputs("llama", length=16))
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        reference = _output(exact, inputs)[real]
        native = _output(model, inputs).float()[real]
        hf_knorm.patch(model, "softmax")
        ours = _output(model, inputs).float()[real]
        hf_knorm.unpatch(model)
        hf_knorm.patch(model, "x^3/1")
        cubic = _output(model, inputs)
    resolution = torch.finfo(dtype).eps * reference.abs().max().item()
    native_error = (native - reference).abs().max().item()
    assert native_error <= 2 * resolution, f"Transformers' own {dtype} run is {native_error:.2e} off"
    torch.testing.assert_close(ours, reference, rtol=0, atol=2 * native_error)
    assert cubic.dtype == dtype and torch.isfinite(cubic).all()

def _config_holders(model) -> list:
    """Every ``(module name, attribute, config)`` a module of ``model`` holds."""
    return [(name, attribute, value) for name, module in model.named_modules() for attribute, value in
            vars(module).items() if isinstance(value, tf.PretrainedConfig)]


def test_patching_leaves_the_config_it_was_built_from_and_its_other_models_alone():
    """The seed figure's workflow: one config, one model per normalization (``from_config`` keeps the config object
    as ``model.config``). Patching the student leaves the config, a teacher built from it before and a model built
    from it after as they were; the student holds one config of its own everywhere, before and after unpatch."""
    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    before = config.to_dict()
    torch.manual_seed(0)
    teacher = tf.AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(0)
    student = tf.AutoModelForCausalLM.from_config(config).eval()
    assert teacher.config is config and student.config is config  # what Transformers does: the reason for the copy
    generation_config = student.generation_config
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        taught = _output(teacher, inputs)
        hf_knorm.patch(student, "x^3/16")
        assert config.to_dict() == before and config._attn_implementation == "sdpa"
        assert hf_knorm.patched_normalization(teacher) is None
        assert torch.equal(_output(teacher, inputs), taught)
        second = tf.AutoModelForCausalLM.from_config(config)
        assert hf_knorm.patched_normalization(second) is None and second.config._attn_implementation == "sdpa"
        holders = _config_holders(student)
        assert {(name, attribute) for name, attribute, _ in holders} == {
            (name, attribute) for name, attribute, _ in _config_holders(teacher)}
        assert all(held is student.config for _, _, held in holders), "every module holds the student's one copy"
        assert student.config is not config and hf_knorm.patched_normalization(student) == "x^3/16"
        assert student.generation_config is generation_config
        assert not torch.allclose(_output(student, inputs), taught)
        hf_knorm.unpatch(student)
        assert all(held is student.config for _, _, held in _config_holders(student))
        assert student.config.to_dict() == before and student.config is not config
        assert torch.equal(_output(student, inputs), taught)
        assert student.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (2, 14)


def test_patching_keeps_sub_configs_the_objects_their_sub_models_hold():
    """A composite config (Llava: a text and a vision config) is copied as one: the language model holds the copy
    of ``config.text_config``, so ``set_attn_implementation`` reaches every sub-model through the sub-configs."""
    from hf_knorm.models.patching import own_config

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)
    config = tf.LlavaConfig(text_config=tf.LlamaConfig(**text), vision_config=tf.CLIPVisionConfig(**vision),
                            image_token_index=63)
    model = tf.LlavaForConditionalGeneration(config)
    own_config(model)
    assert model.config is not config and model.config.text_config is not config.text_config
    assert model.model.language_model.config is model.config.text_config
    assert model.model.vision_tower.config is model.config.vision_config
    held = {id(value) for _, _, value in _config_holders(model)}
    assert not held & {id(config), id(config.text_config), id(config.vision_config)}
    model.set_attn_implementation("eager")
    assert model.model.language_model.config._attn_implementation == "eager"
    assert config.text_config._attn_implementation != "eager"


def test_a_peft_wrapped_model_reads_the_patched_config_through_the_wrapper():
    """PEFT's ``PeftModel`` forwards ``config`` to the model it wraps (it holds none): patching through the wrapper
    gives the wrapped model its own config, which the wrapper reads; unpatch gives the original implementation."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    shared = model.config
    hf_knorm.patch(wrapped, "x^3/16")
    assert "config" not in vars(wrapped) and wrapped.config is model.config is not shared
    assert all(held is model.config for _, _, held in _config_holders(wrapped))
    assert hf_knorm.patched_normalization(wrapped) == "x^3/16" and shared._attn_implementation == "sdpa"
    hf_knorm.unpatch(wrapped)
    assert wrapped.config._attn_implementation == "sdpa" and hf_knorm.patched_normalization(wrapped) is None
