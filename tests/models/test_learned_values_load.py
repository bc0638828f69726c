"""The build hook of ``hf_knorm.compat.add_parameters_when_built`` (``PreTrainedModel.post_init`` and
``_init_weights`` wrapped class-wide at ``import hf_knorm``): a model that Transformers builds from a patched config,
with no hf_knorm call, has the normalization's learned values before its weights load, so plain ``from_pretrained``
reads them and ``from_config`` starts them at the family's initial values; values a checkpoint lacks start there too
(not uninitialized memory). The hook is installed once; a second one is refused."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tiny_models import tiny_inputs, tiny_model

import hf_knorm
from hf_knorm import compat
from hf_knorm.models import parameters
from hf_knorm.models.parameters import PREFIX, learned_values, set_learned_values

pytestmark = pytest.mark.compat

SPELLING = "sigmoid(bias=learned)"


def _patched_with_trained_values():
    model = hf_knorm.patch(tiny_model("llama"), SPELLING)
    layers = len(learned_values(model, "bias"))
    heads = model.config.num_attention_heads
    set_learned_values(model, "bias", [[-1.0 - 0.25 * layer - 0.5 * head for head in range(heads)]
                                       for layer in range(layers)])
    return model


def _initial_values(model):
    value = hf_knorm.parse_normalization(SPELLING).learnable()["bias"]
    return [torch.full_like(layer, float(value)) for layer in learned_values(model, "bias")]


def test_a_plain_load_reads_the_learned_values_and_gives_the_same_logits(tmp_path):
    model = _patched_with_trained_values()
    model.save_pretrained(tmp_path)  # Transformers' own save
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # Transformers' own load: no hf_knorm call
    for saved, read in zip(learned_values(model, "bias"), learned_values(loaded, "bias")):
        assert torch.equal(saved, read)
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_a_model_built_from_the_config_starts_at_the_initial_values(tmp_path):
    model = _patched_with_trained_values()
    model.save_pretrained(tmp_path)
    built = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(tmp_path))
    for value, initial in zip(learned_values(built, "bias"), _initial_values(built)):
        assert torch.equal(value, initial)


def test_values_a_checkpoint_lacks_start_at_the_initial_values(tmp_path):
    model = _patched_with_trained_values()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({name: tensor for name, tensor in weights.items() if PREFIX not in name},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    for value, initial in zip(learned_values(loaded, "bias"), _initial_values(loaded)):
        assert torch.equal(value, initial)  # not uninitialized memory, not the trained values


def test_the_hook_is_installed_once_and_a_second_one_is_refused():
    post_init, init_weights = tf.PreTrainedModel.post_init, tf.PreTrainedModel._init_weights
    assert post_init.__wrapped__.__qualname__ == "PreTrainedModel.post_init"
    assert init_weights.__wrapped__.__qualname__ == "PreTrainedModel._init_weights"
    parameters.register()
    assert tf.PreTrainedModel.post_init is post_init and tf.PreTrainedModel._init_weights is init_weights
    with pytest.raises(ValueError, match="The build hook 'add' is already registered with .*_add_when_built"):
        compat.add_parameters_when_built(lambda model: None, parameters._initialize_missing)
    with pytest.raises(ValueError, match="'initialize' is already registered with .*_initialize_missing"):
        compat.add_parameters_when_built(parameters._add_when_built, lambda module: None)
    assert compat._BUILD_HOOKS == dict(add=parameters._add_when_built, initialize=parameters._initialize_missing)
    assert tf.PreTrainedModel.post_init is post_init and tf.PreTrainedModel._init_weights is init_weights
